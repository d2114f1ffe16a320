"""The training loop's own logic, run by `Trainer.fit` against an in-process fake of its worker groups
(`tests/fake_cluster.py`): resume replay, one record per step, the stop conditions, validation cadence,
one_step_off's batch kept in the checkpoint. What only the real workers show (Megatron's optimizer and
RNG restored, vLLM engines reloaded, a killed driver) stays in tests/e2e/trainer/test_trainer_e2e.py."""

import inspect
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from fake_cluster import FakeCluster, FakeEngine, FakePolicyWorker, FakeRoles, fake_cluster
from quickstart_assets import make_assets, overrides, read_metrics

import megarl.trainer.trainer as trainer_module
from megarl import Trainer, interrupt
from megarl.cli.train import _train
from megarl.cluster.protocol import Cluster
from megarl.cluster.roles import Roles
from megarl.cluster.running import RunningCluster, start_cluster
from megarl.config.validate import checked_config
from megarl.rewards.functions import RewardFunctionError
from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import (
    read_manifest,
    step_dir_name,
    verify_checksums,
)
from megarl.workers.policy_worker import PolicyWorker
from megarl.workers.rollout.rollout_worker import RolloutWorker

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
TRAINED = (
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/loss",
)
"""What a step trained and measured: a step trained again after a resume gives the same values."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("fake_cluster_assets"))


def fit(monkeypatch, args: list[str], bad_steps=()) -> Trainer:
    with fake_cluster(monkeypatch, bad_steps):
        trainer = Trainer.from_config(QUICKSTART, args)
        trainer.fit()
    return trainer


def assert_trained_alike(again: list[dict], before: list[dict], keys=TRAINED) -> None:
    assert [r["step"] for r in again] == [r["step"] for r in before]
    for ours, theirs in zip(again, before):
        for key in keys:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-9, abs=1e-12), (ours["step"], key)


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(
    "fake,real",
    [
        (FakePolicyWorker, PolicyWorker),
        (FakeEngine, RolloutWorker),
        (FakeRoles, Roles),
    ],
)
def test_the_fakes_keep_the_real_signatures(fake, real):
    """Every method a fake defines exists on the class it stands for, with the same parameters, so a
    change of the real contract fails here rather than leaving the loop tests on a stale fake."""
    own = [
        name
        for name, value in vars(fake).items()
        if callable(value) and (not name.startswith("_") or name == "__init__")
    ]
    for name in own:
        if name == "__init__" and fake in (FakePolicyWorker, FakeEngine):
            continue  # a worker's construction is start_roles', which the fake cluster replaces
        assert hasattr(real, name), f"{fake.__name__}.{name}: {real.__name__} has no {name}"
        assert _parameters(getattr(fake, name)) == _parameters(getattr(real, name)), (fake.__name__, name)
    assert issubclass(FakeRoles, Roles)
    # The fake starts the cluster with the real start's arguments (the trainer's seam).
    assert _parameters(FakeCluster.start_cluster)[1:] == _parameters(start_cluster)


def test_the_fake_policy_learns(assets, tmp_path, monkeypatch):
    """The fake's updates change what the engines sample (else a resume replaying the wrong weights
    would still match): the entropy falls as the policy concentrates."""
    trainer = fit(monkeypatch, overrides(assets, tmp_path, **{"trainer.total_steps": 6}))
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert metrics[-1]["actor/entropy"] < metrics[0]["actor/entropy"]
    assert [m["sync/weight_version"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert isinstance(trainer.cluster, Cluster) and trainer.cluster.engines.shut_down


def test_a_colocated_step_is_eight_driver_round_trips_checked_or_not(assets, tmp_path, monkeypatch):
    """`perf/round_trips` of the quickstart (colocated, engines that sleep): generate, the engines' sleep,
    the Megatron onload, the staged batch (staged, updated, dropped), the training state's offload, the
    sync (the engines' wake and receive beside the policy's send and parameter offload), the engines'
    wake with their side of the check; one more with a checkpoint. Issue 30's goal: at most 10."""
    args = overrides(assets, tmp_path, **{"trainer.total_steps": 4, "rollout.sync.verify_every": 2})
    metrics = read_metrics(fit(monkeypatch, args).run_dir / "metrics.jsonl")
    assert ["sync/logprob_max_abs_diff" in m for m in metrics] == [True, True, False, True]
    assert [m["sync/checksum_tensors"] for m in metrics if "sync/checksum_tensors" in m] == [1.0] * 3
    assert [m["perf/round_trips"] for m in metrics] == [8, 8, 8, 9]  # the last step saves a checkpoint
    assert "memory/rollout/awake/rss_gib" in metrics[-1] and "timing/wake_up" in metrics[-1]


def test_resume_auto_passes_over_a_same_size_damaged_checkpoint_saying_so(assets, tmp_path, monkeypatch, capsys):
    """A newest checkpoint damaged without changing its size (a flipped bit: what a size check cannot
    see) is found by its SHA-256 before any rank loads it; `resume: auto` says so and falls back to the
    newest intact checkpoint, from which the run continues exactly (issue 18 item 3): steps 5-6 train
    again as the uninterrupted run trained them (its weights, optimizer state, data position restored)."""
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **{"trainer.total_steps": 6, "checkpoint.save_freq": 2})
    reference = read_metrics(fit(monkeypatch, args).run_dir / "metrics.jsonl")
    manager = CheckpointManager(run_dir / "checkpoints")
    assert [c.step for c in manager.complete()] == [4, 6]  # the quickstart's checkpoint.max_keep=2
    intact, newest = [c.path for c in manager.complete()]
    damaged = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert manager.latest().path == newest  # the sizes still agree: listing alone cannot tell
    capsys.readouterr()

    fit(monkeypatch, [*args, "checkpoint.resume=auto"])
    out = capsys.readouterr().out
    relative = damaged.relative_to(newest).as_posix()
    assert f"checkpoint.resume=auto: passing over {newest}: {newest} is damaged: {relative} has SHA-256 " in out
    assert f"checkpoint.resume=auto: resuming from {intact}, the newest intact checkpoint" in out
    after = read_metrics(run_dir / "quickstart" / "metrics.jsonl")
    assert [m["step"] for m in after] == list(range(1, 7))
    assert after[:4] == reference[:4]  # the records up to the checkpoint are the first run's
    assert_trained_alike(after[4:], reference[4:])
    verify_checksums(newest, read_manifest(newest))  # the rerun's save replaced the damaged one


class StopAfterCheckpoint(RuntimeError):
    pass


def test_exactly_one_record_per_step_when_a_stop_falls_between_checkpoint_and_record(assets, tmp_path, monkeypatch):
    """A run stopped after step 4's checkpoint but before step 4's metrics record: resumed, it writes that
    record from the checkpoint, and metrics.jsonl holds exactly one record per step (issue 18 item 4)."""
    args = overrides(assets, tmp_path, **{"trainer.total_steps": 4, "checkpoint.save_freq": 2})
    with fake_cluster(monkeypatch):
        to_rollout = RunningCluster.to_rollout

        def stop_at_step_4(self, step):  # runs right after the step's checkpoint, before its record
            if step == 4:
                raise StopAfterCheckpoint
            return to_rollout(self, step)

        monkeypatch.setattr(RunningCluster, "to_rollout", stop_at_step_4)
        first = Trainer.from_config(QUICKSTART, args)
        with pytest.raises(StopAfterCheckpoint):
            first.fit()
    assert [m["step"] for m in read_metrics(first.run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert first.checkpoints.latest().step == 4
    monkeypatch.undo()

    resumed = fit(monkeypatch, [*args, "trainer.total_steps=6", "checkpoint.resume=auto"])
    metrics = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    # Step 4's record is what the step had measured when it saved: its rollout and update, not what came after.
    assert {"reward/mean", "actor/pg_loss"} <= set(metrics[3]) and "timing/sync" not in metrics[3]


ONE_STEP_OFF = {
    "trainer.rollout_mode": "one_step_off",
    "placement.mode": "split",
    "placement.gpus_per_node": 3,
    "placement.rollout_gpus": 1,
    "trainer.total_steps": 4,
    "checkpoint.save_freq": 2,
    "trainer.test_freq": 2,
    "algorithm.dynamic_sampling.enable": "true",
    "algorithm.dynamic_sampling.max_rounds": 20,
}


def test_one_step_off_resumes_from_the_middle_with_the_batch_the_checkpoint_kept(assets, tmp_path, monkeypatch):
    """The run stopped after step 2's checkpoint: a copy without step 4's resumes from it, trains step 3 on
    the batch the checkpoint kept (generated beside step 2 with step 1's weights) and step 4 on one its
    engines generate with step 2's weights, as the uninterrupted run did (moved here from
    tests/e2e/trainer/test_one_step_off.py, which keeps the uninterrupted run on the real cluster)."""
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **ONE_STEP_OFF)
    metrics = read_metrics(fit(monkeypatch, args).run_dir / "metrics.jsonl")
    assert [m["rollout/policy_version_lag/max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["dapo/rounds"] >= 1 and m["reward/std"] > 0 for m in metrics)
    extra = json.loads((run_dir / "checkpoints" / step_dir_name(2) / "extra.json").read_text())
    assert extra["stream"]["ahead"]["policy_version"] == 1
    last = json.loads((run_dir / "checkpoints" / step_dir_name(4) / "extra.json").read_text())
    assert last["stream"] == {"ahead": None}

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / step_dir_name(4))
    fit(monkeypatch, [arg.replace(str(run_dir), str(copy)) for arg in args])
    resumed = read_metrics(copy / "quickstart" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert_trained_alike(resumed[2:], metrics[2:], (*TRAINED, "dapo/rounds", "rollout/policy_version_lag/max"))
    assert resumed[-1]["val/reward/mean"] == pytest.approx(metrics[-1]["val/reward/mean"], rel=1e-9)


def train_command(monkeypatch, args: list[str], probe_gap=0.0) -> int:
    """`megarl train`'s run and its errors' exit codes (`megarl.cli.train._train`) on the fake cluster,
    with this directory's reward functions importable (`loop_rewards`)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with fake_cluster(monkeypatch, probe_gap=probe_gap):
        return _train(checked_config(QUICKSTART, args))


def test_a_sync_gap_over_the_threshold_stops_the_run_before_the_next_rollout(assets, tmp_path, monkeypatch, capsys):
    """Engines whose probe log-probs are 1e-3 from the actor's, every tensor loaded bit for bit: the
    first sync's check fails, `megarl train` exits 1 with the message naming the layout, the gap and
    the threshold, and no step is logged, so no rollout used the synced weights (moved from
    tests/e2e/reliability/test_numerical_faults.py, a whole job; that a real TP-2 actor and TP-1 engine
    show a gap the check measures is tests/e2e/trainer/test_trainer_e2e.py's, the bf16 engines' test)."""
    args = overrides(assets, tmp_path, **{"rollout.sync.logprob_gap_threshold": 1e-4, "trainer.total_steps": 3})
    code = train_command(monkeypatch, args, probe_gap=1e-3)
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(
        r"megarl train: failed: SyncVerificationError: weight sync train TP=2/PP=1 → rollout TP=1: rollout "
        r"log-probs differ from the actor's by 0\.001 \(mean 0\.001\) > threshold 0\.0001",
        err,
    ), err
    metrics_file = tmp_path / "quickstart" / "metrics.jsonl"
    assert not metrics_file.exists() or read_metrics(metrics_file) == []


def test_consecutive_nan_steps_stop_the_run_naming_max_bad_steps(assets, tmp_path, monkeypatch, capsys):
    """Valid float32 rewards whose group sums overflow: NaN advantages, a NaN gradient on every step, each
    update skipped; two in a row end the run right after the second one's record, exit 1, the message
    naming the setting (moved from tests/e2e/reliability/test_numerical_faults.py; that megatron-core's
    optimizer skips a NaN step and reports it is tests/distributed/workers/test_megatron_workers.py's)."""
    code = train_command(
        monkeypatch,
        overrides(
            assets,
            tmp_path,
            **{
                "reward.function": "loop_rewards:group_sum_overflow",
                "trainer.max_bad_steps": 2,
                "trainer.total_steps": 6,
            },
        ),
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "megarl train: failed: BadStepsError: 2 consecutive steps" in err and "trainer.max_bad_steps=2" in err, err
    records = read_metrics(tmp_path / "quickstart" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2], "the run must stop right after the 2nd bad step"
    assert all(
        r["actor/skipped_steps"] >= 1 and r["actor/optimizer_steps"] == r["actor/skipped_steps"] for r in records
    )


def test_a_good_step_between_bad_ones_starts_the_count_again(assets, tmp_path, monkeypatch):
    args = overrides(assets, tmp_path / "a", **{"trainer.total_steps": 6, "trainer.max_bad_steps": 2})
    with pytest.raises(trainer_module.BadStepsError, match=r"2 consecutive steps .*trainer.max_bad_steps=2"):
        fit(monkeypatch, args, bad_steps={2, 3})
    records = read_metrics(tmp_path / "a" / "quickstart" / "metrics.jsonl")
    assert [r["actor/skipped_steps"] for r in records] == [0, 1, 1]
    args = overrides(assets, tmp_path / "b", **{"trainer.total_steps": 5, "trainer.max_bad_steps": 2})
    apart = fit(monkeypatch, args, bad_steps={2, 4})
    assert [r["step"] for r in read_metrics(apart.run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_a_reward_beyond_float32_stops_the_run_at_scoring(assets, tmp_path, monkeypatch, capsys):
    """Exit 2, the message naming the function, the value, the sample's index and its response, and no
    step trained (moved from tests/e2e/reliability/test_numerical_faults.py)."""
    code = train_command(
        monkeypatch,
        overrides(assets, tmp_path, **{"reward.function": "loop_rewards:beyond_float32", "trainer.total_steps": 3}),
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(
        r"megarl train: reward.function 'loop_rewards:beyond_float32' returned 1e\+39 \(float\) "
        r"as score \d+; .*float32.*; the response it scored: '.+'",
        err,
    ), err
    metrics_file = tmp_path / "quickstart" / "metrics.jsonl"
    assert not metrics_file.exists() or read_metrics(metrics_file) == [], (
        "no step may train on a reward the trainer cannot hold"
    )


def test_a_reward_function_returning_the_wrong_length_stops_the_run(assets, tmp_path, monkeypatch):
    """(moved from tests/e2e/trainer/test_trainer_e2e.py::test_reward_faults_are_counted_and_wrong_length_stops)"""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(RewardFunctionError, match="wrong_length"):
        fit(
            monkeypatch,
            overrides(assets, tmp_path, **{"trainer.total_steps": 2, "reward.function": "loop_rewards:wrong_length"}),
        )


@pytest.mark.parametrize(
    "signum,mode",
    [(signal.SIGTERM, {}), (signal.SIGHUP, ONE_STEP_OFF)],
    ids=["SIGTERM-sync", "SIGHUP-one-step-off"],
)
def test_a_stop_signal_ends_the_run_after_the_step_it_came_in_with_one_line(
    assets, tmp_path, monkeypatch, capsys, signum, mode
):
    """A stop signal during step 3: the step finishes and is logged, the loop stops before step 4, and
    `megarl train` prints one line naming the signal, the step, its phase and the last checkpoint, with the
    shell's exit code (143 / 129); also with step 4's batch generating beside step 3 (one_step_off: the
    SIGHUP case, moved from tests/e2e/reliability/test_stop_signals.py). (That the signal also ends every
    process and leaves no /dev/shm file is the whole job's: tests/e2e/reliability/test_stop_signals.py.)"""
    monkeypatch.setattr(interrupt, "_requested", None)  # the process-wide request, this test's only
    with fake_cluster(monkeypatch):
        to_rollout = RunningCluster.to_rollout

        def signalled_in_step_3(self, step):
            if step == 3:
                os.kill(os.getpid(), signum)
            return to_rollout(self, step)

        monkeypatch.setattr(RunningCluster, "to_rollout", signalled_in_step_3)
        args = overrides(assets, tmp_path, **mode | {"trainer.total_steps": 6, "checkpoint.save_freq": 2})
        code = _train(checked_config(QUICKSTART, args))
    err = capsys.readouterr().err
    assert code == 128 + signum, err
    [line] = [line for line in err.splitlines() if line.startswith("megarl train: stopped by")]
    assert re.fullmatch(
        rf"megarl train: stopped by {signal.Signals(signum).name} during step 3 \(step\); last checkpoint: "
        r"step 2 \(.+\); continue from it by running the same command with checkpoint.resume=auto",
        line,
    ), line
    assert "Traceback" not in err
    metrics = read_metrics(tmp_path / "quickstart" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    if mode:  # step 3 trained beside step 4's generation
        assert metrics[2]["rollout/policy_version_lag/max"] == 1


def test_validation_runs_every_test_freq_steps_and_at_the_end(assets, tmp_path, monkeypatch):
    trainer = fit(monkeypatch, overrides(assets, tmp_path, **{"trainer.total_steps": 5, "trainer.test_freq": 2}))
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if "val/reward/mean" in m] == [2, 4, 5]
    assert all(("timing/validation" in m) == ("val/reward/mean" in m) for m in metrics)


ASYNC = {
    "trainer.rollout_mode": "async",
    "trainer.max_staleness": 2,
    "placement.mode": "split",
    "placement.gpus_per_node": 3,
    "placement.rollout_gpus": 1,
    "trainer.total_steps": 4,
    "checkpoint.save_freq": 2,
    "checkpoint.max_keep": 3,
    "rollout.partial_rollout": 1,
    "trainer.test_freq": 2,
}


def resume_from_step_2(monkeypatch, run_dir: Path, copy: Path, args: list[str]) -> Path:
    """The 4-step run in `run_dir` copied to `copy` without its checkpoints after step 2, and resumed there."""
    shutil.copytree(run_dir, copy)
    for step in (3, 4):
        shutil.rmtree(copy / "checkpoints" / step_dir_name(step), ignore_errors=True)
    fit(monkeypatch, [arg.replace(str(run_dir), str(copy)) for arg in args])
    return copy


def test_async_resumes_from_the_middle_on_the_batches_the_checkpoint_kept(assets, tmp_path, monkeypatch, capsys):
    """async, max_staleness 2, partial rollouts of a token per segment: the run stopped after step 2's
    checkpoint resumes from it and trains step 3 on the batch the checkpoint kept (its policy version as
    recorded), or says the batch was in flight and generates it again; every later batch is generated
    after the resume; validation (every 2 steps and at the end) takes the engines between two segments
    (moved here from tests/e2e/trainer/test_one_step_off.py, with the uninterrupted run's lag bound,
    checkpointed stream and validation cadence: the async whole jobs are tests/e2e/trainer/
    test_agent_quickstart.py's, partial rollouts and weight loads between segments on vLLM, and
    tests/e2e/reliability/test_async_faults.py's, a stop and the checkpointed batch ahead)."""
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **ASYNC)
    metrics = read_metrics(fit(monkeypatch, args).run_dir / "metrics.jsonl")
    lags = [m["rollout/policy_version_lag/max"] for m in metrics]
    assert lags[0] == 0 and all(0 <= lag <= 2 for lag in lags), lags
    assert [m["step"] for m in metrics if "val/reward/mean" in m] == [2, 4]
    assert [m["sync/weight_version"] for m in metrics] == [1.0, 2.0, 3.0, 4.0]
    stream = json.loads((run_dir / "checkpoints" / step_dir_name(2) / "extra.json").read_text())["stream"]
    assert set(stream["ready"]) <= {"3", "4"} and stream["in_flight"] in (None, 3, 4), stream
    capsys.readouterr()

    copy = resume_from_step_2(monkeypatch, run_dir, tmp_path / "copy", args)
    out = capsys.readouterr().out
    resumed = read_metrics(copy / "quickstart" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    kept = sorted(int(step) for step in stream["ready"])
    said = f"rollout stream: resumed with {len(kept)} batch(es) generated before the checkpoint (steps {kept}); "
    lost = stream["in_flight"]
    assert said + ("no batch was in flight" if lost is None else f"the batch of step {lost} was in flight") in out
    if 3 not in kept:
        return
    assert 2 - stream["ready"]["3"]["policy_version"] == lags[2]
    assert_trained_alike(resumed[2:3], metrics[2:3], (*TRAINED, "rollout/policy_version_lag/max"))


CARRIED = ASYNC | {
    "trainer.max_staleness": 2,
    "trainer.test_freq": 0,
    "rollout.max_new_tokens": 6,
    "rollout.partial_rollout": 2,
    "rollout.over_sampling": 4,
}
"""Async with groups carried over: 4 beside 16 prompts, segments of 2 of 6 tokens."""


def test_over_sampling_carries_groups_between_steps_within_the_staleness_bound(assets, tmp_path, monkeypatch, capsys):
    """async with partial rollouts carried over (`rollout.over_sampling` 4 beside 16 prompts, max_staleness 2):
    every step's batch is full and never over the bound (no stale batch dropped: carried groups too old for it
    start over), 4 groups go on into the next step's generation, and a resume from step 2's checkpoint says
    what it lost of them."""
    run_dir = tmp_path / "run"
    args = overrides(assets, run_dir, **CARRIED)
    metrics = read_metrics(fit(monkeypatch, args).run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["rollout/carried_groups"] for m in metrics] == [4.0] * 4
    assert all(m["rollout/stale_dropped_samples"] == 0 for m in metrics)
    assert all(m["rollout/policy_version_lag/max"] <= 2 for m in metrics)
    assert all(m["rollout/token_version_lag/mean"] <= 2 for m in metrics)
    stream = json.loads((run_dir / "checkpoints" / step_dir_name(2) / "extra.json").read_text())["stream"]
    lost = stream["carried_lost"]
    capsys.readouterr()

    copy = resume_from_step_2(monkeypatch, run_dir, tmp_path / "copy", args)
    said = (
        f"rollout.over_sampling: {lost['groups']} group(s) in flight and {lost['prompts']} prompt(s) not started "
        "yet are lost"
    )
    assert said in capsys.readouterr().out and lost["groups"] >= 4
    assert [m["step"] for m in read_metrics(copy / "quickstart" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_dynamic_sampling_fills_its_rounds_through_the_carried_groups(assets, tmp_path, monkeypatch):
    """DAPO's dynamic sampling with groups carried over: every round asks the carry for 16 groups, keeps those
    with reward variation and asks again until the step is full; the groups each round leaves in flight go on
    into the next round or step, and no batch breaks the staleness bound."""
    run_dir = tmp_path / "run"
    settings = CARRIED | {"algorithm.dynamic_sampling.enable": "true", "algorithm.dynamic_sampling.max_rounds": 20}
    metrics = read_metrics(fit(monkeypatch, overrides(assets, run_dir, **settings)).run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["dapo/rounds"] >= 1 and m["reward/std"] > 0 for m in metrics)
    assert any(m["dapo/groups_kept_ratio"] < 1 for m in metrics), [m["dapo/groups_kept_ratio"] for m in metrics]
    assert all(m["rollout/carried_groups"] == 4 for m in metrics)
    assert all(m["rollout/stale_dropped_samples"] == 0 for m in metrics)
    assert all(m["rollout/policy_version_lag/max"] <= 2 for m in metrics)
