"""The agent quickstart end to end on CPU (scripts/agent_quickstart.sh, shortened): a tiny tool-token
model, `megarl sft` on calculator demonstrations, then multi-turn GRPO with the built-in calculator
running in its isolated tool process. The reward and the tool-call rate both rise, every step logs the
agent metrics, and rollouts.jsonl holds one readable trajectory per step."""

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
def agent_run(tmp_path_factory):
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
    trainer = Trainer.from_config(
        REPO / "configs" / "agent_quickstart.yaml",
        [
            f"model.path={root / 'sft-model'}",
            f"data.train_files=[{root / 'data' / 'train.jsonl'}]",
            f"data.val_files=[{root / 'data' / 'val.jsonl'}]",
            f"trainer.output_dir={root / 'runs'}",
            f"checkpoint.dir={root / 'checkpoints'}",
            f"trainer.total_steps={STEPS}",
            "trainer.test_freq=0",
        ],
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
