"""The agent quickstart end to end on CPU (scripts/agent_quickstart.sh, shortened): a tiny tool-token
model, `megarl sft` on calculator demonstrations, then multi-turn GRPO with the built-in calculator
running in its isolated tool process. The reward and the tool-call rate both rise, every step logs the
agent metrics, and rollouts.jsonl holds one readable trajectory per step. The same warmed-up model then
runs a few steps of the agent loop in trainer.rollout_mode async with partial rollouts, trajectories carried
between steps (rollout.over_sampling)."""

import json

import pytest

from megarl import SftTrainer, Trainer
from megarl.cli.main import main
from megarl.tools.builtin.calculator import calculator
from megarl.trainer.metrics import AGENT_METRICS

from .conftest import REPO, read_metrics

STEPS = 20
WINDOW = 5


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """The tiny tool-token model after `megarl sft` on calculator demonstrations, and the task's data (root/data)."""
    root = tmp_path_factory.mktemp("agent")
    # The CLI's commands, run in this process: a subprocess per command only added an interpreter start.
    assert main(["init-tiny-model", "--tool-tokens", "--out", str(root / "tiny-model")]) == 0
    assert (
        main(
            [
                "make-data",
                "--task",
                "calc_tool_demos",
                "--out",
                str(root / "sft-data"),
                "--n-train",
                "2048",
                "--n-val",
                "16",
            ]
        )
        == 0
    )
    assert main(["make-data", "--task", "calc", "--out", str(root / "data")]) == 0
    SftTrainer.from_config(
        REPO / "configs" / "sft_agent.yaml",
        [
            f"model.path={root / 'tiny-model'}",
            f"data.train_files=[{root / 'sft-data' / 'train.jsonl'}]",
            f"train.output_dir={root / 'sft-model'}",
        ],
    ).fit()
    return root


def agent_overrides(root, run_dir, **extra) -> list[str]:
    """The agent quickstart recipe on the warmed-up model, writing under `run_dir`, validation off."""
    values = {
        "model.path": root / "sft-model",
        "data.train_files": f"[{root / 'data' / 'train.jsonl'}]",
        "data.val_files": f"[{root / 'data' / 'val.jsonl'}]",
        "trainer.output_dir": run_dir,
        "checkpoint.dir": run_dir / "checkpoints",
        "trainer.test_freq": 0,
    } | extra
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def agent_run(sft_model):
    trainer = Trainer.from_config(
        REPO / "configs" / "agent_quickstart.yaml",
        agent_overrides(sft_model, sft_model / "runs", **{"trainer.total_steps": STEPS}),
    )
    trainer.fit()
    return trainer, read_metrics(trainer.run_dir / "metrics.jsonl")


def _mean(metrics, name, part):
    values = [m[name] for m in part]
    return sum(values) / len(values)


def test_reward_and_tool_call_rate_rise(agent_run):
    _, metrics = agent_run
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    first, last = metrics[:WINDOW], metrics[-WINDOW:]
    for name in ("reward/mean", "agent/tool_call_rate"):
        assert _mean(metrics, name, last) > _mean(metrics, name, first), [round(m[name], 3) for m in metrics]
    assert all(set(AGENT_METRICS) <= set(m) for m in metrics)
    # Tool observations are in the responses and out of the loss.
    assert all(0 < m["agent/masked_token_fraction"] < 1 for m in metrics)


def test_rollouts_jsonl_shows_a_whole_trajectory_per_step(agent_run):
    trainer, _ = agent_run
    records = [json.loads(line) for line in (trainer.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    called = [r for r in records if any(m["role"] == "tool" for m in r["messages"])]
    assert called, records[-1]
    record = called[-1]
    expression = record["prompt"].rsplit("user: ", 1)[1].split("\n")[0]  # "37+58", as the tiny template renders it
    call = record["messages"][0]
    assert call["role"] == "assistant" and call["tool_calls"][0]["name"] == "calculator"
    observation = record["messages"][1]
    assert observation == {
        "role": "tool",
        "name": "calculator",
        "content": calculator(call["tool_calls"][0]["arguments"]["expression"]),
    }
    a, b = (int(n) for n in expression.split("+"))
    answer = record["messages"][-1]["content"].strip()
    assert record["reward"] == (1.0 if answer == str(a + b) else 0.0)


ASYNC_STEPS = 3
SHOWN = (
    "rollout/policy_version_lag/max",
    "rollout/carried_groups",
    "rollout/restarted_groups",
    "rollout/token_version_lag/mean",
    "rollout/partial_samples",
    "agent/tool_call_rate",
    "reward/mean",
)


def test_the_agent_loop_trains_in_async_mode_with_turns_across_weight_updates(sft_model):
    """trainer.rollout_mode async, max_staleness 2, partial rollouts of 8 tokens (a calculator call is ~30),
    4 prompts' trajectories more than a batch needs in flight (rollout.over_sampling): the trajectories, tool
    calls included, are generated in the driver's rollout thread while the actor trains (split placement: the
    engine on a slot of its own), a weight load landing between two segments of a turn or between two turns,
    and those of the groups not in a step's batch carried into the next step's generation; every step trains
    within the bound and logs the agent metrics."""
    trainer = Trainer.from_config(
        REPO / "configs" / "agent_quickstart.yaml",
        agent_overrides(
            sft_model,
            sft_model / "async-runs",
            **{
                "trainer.total_steps": ASYNC_STEPS,
                "trainer.rollout_mode": "async",
                "trainer.max_staleness": 2,
                "rollout.partial_rollout": 8,
                "rollout.over_sampling": 4,
                "placement.mode": "split",
                "placement.gpus_per_node": 3,
                "placement.rollout_gpus": 1,
            },
        ),
    )
    trainer.fit()
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, ASYNC_STEPS + 1))
    lags = [m["rollout/policy_version_lag/max"] for m in metrics]
    assert lags[0] == 0 and all(0 <= lag <= 2 for lag in lags) and max(lags) >= 1, lags  # ahead, within the bound
    assert all(m["rollout/stale_dropped_samples"] == 0 for m in metrics)
    assert [m["rollout/carried_groups"] for m in metrics] == [4.0] * ASYNC_STEPS
    for m in metrics:
        assert set(AGENT_METRICS) <= set(m)
        assert m["agent/tool_call_rate"] > 0 and 0 < m["agent/masked_token_fraction"] < 1  # tools ran, masked out
        assert 0 <= m["rollout/token_version_lag/mean"] <= m["rollout/policy_version_lag/max"]
        assert 0 <= m["rollout/partial_samples"] <= 16 * 8 and m["actor/grad_norm"] > 0  # of 16 prompts x 8 samples
    print("async agent run:", [{k: m[k] for k in SHOWN} for m in metrics])
    records = [json.loads(line) for line in (trainer.run_dir / "rollouts.jsonl").read_text().splitlines()]
    tool_messages = [m for r in records for m in r["messages"] if m["role"] == "tool"]
    assert tool_messages and all(m["name"] == "calculator" for m in tool_messages)
