"""`trainer.profile`: which steps and ranks record, and the driver's part in a recorded step: the request
rides on each group's staging, and one `stop_profile` call per group writes the traces.

The trainer's own `_train_step` runs against recording stand-ins of the worker groups
(`tests/recorded_transfers.py`), whose ranks run `PolicyWorker`'s staging and profiling methods with
a real torch profiler. The stand-ins share this process, and torch runs one profiler per process (a
rank's process in a run; a second one in the process crashes torch's trace export): one rank of the
actor's group records here."""

import json
from pathlib import Path

import pytest
from recorded_transfers import recorded_trainer, run_step

from megarl.config.loader import load_config
from megarl.config.sections import ProfileConfig
from megarl.trainer.profile_schedule import PROFILE_DIR, profile_request
from megarl.workers.profiling import ProfileRequest

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
OLD_LOG_PROB_PASS = ("actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=4")
"""Several mini-batches: the old log-probs need a pass of their own."""
OWN_GROUPS = (
    "actor.use_kl_loss=true",
    "critic.enable=true",
    "algorithm.adv_estimator=gae",
    "critic.ppo_mini_batch_size=16",
    "critic.parallel.tensor_model_parallel_size=1",
    "ref.parallel.tensor_model_parallel_size=1",
)
"""The critic and the reference at TP 1 × DP 2 beside the actor's TP 2: three groups."""


def test_only_the_listed_steps_are_profiled_in_the_run_dir_by_default(tmp_path, monkeypatch):
    profile = ProfileConfig(steps=(3, 5), ranks=(0, 1))
    assert [step for step in range(1, 8) if profile_request(profile, tmp_path, step)] == [3, 5]
    assert profile_request(profile, tmp_path, 3) == ProfileRequest(3, str(tmp_path / PROFILE_DIR), (0, 1))
    assert profile_request(ProfileConfig(), tmp_path, 1) is None  # off by default
    monkeypatch.chdir(tmp_path)  # a relative directory is the driver's: the workers' working directory may differ
    relative = profile_request(ProfileConfig(steps=(1,), ranks="all", dir="traces"), Path("runs/x"), 1)
    assert relative == ProfileRequest(1, str(tmp_path / "traces"), None)
    assert profile_request(ProfileConfig(steps=(1,)), Path("runs/x"), 1).directory == str(tmp_path / "runs/x/profile")


def test_the_recipe_keys_load(tmp_path):
    config = load_config(
        QUICKSTART, ["trainer.profile.steps=[2, 4]", "trainer.profile.ranks=all", f"trainer.profile.dir={tmp_path}"]
    )
    assert config.trainer.profile == ProfileConfig(steps=(2, 4), ranks="all", dir=str(tmp_path))
    assert load_config(QUICKSTART, []).trainer.profile.ranks == (0,)


def test_a_profiled_step_writes_one_trace_per_chosen_rank_with_its_phases_and_nothing_for_other_steps(tmp_path):
    trainer = recorded_trainer(
        QUICKSTART,
        [
            *OLD_LOG_PROB_PASS,
            "trainer.profile.steps=[2]",
            "trainer.profile.ranks=[1]",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    assert (
        len({id(group) for group in trainer.cluster.roles.groups.values()}) == 1
        and trainer.cluster.roles.policy.world_size == 2
    )
    for step in (1, 2):
        run_step(trainer, step)
        written = trainer.cluster.stop_profiles()
        if step == 1:
            assert written == []  # the step was not profiled: no rank recorded
    root = trainer.run_dir / PROFILE_DIR
    assert written == [str(root / "step_2" / "actor_rank1.pt.trace.json")]
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["step_2", "step_2/actor_rank1.pt.trace.json"]
    names = _names(root / "step_2" / "actor_rank1.pt.trace.json")
    assert {"compute_log_prob", "update_actor", "aten::div"} <= names  # the stand-in log-probs divide


def test_stopping_is_one_call_per_worker_group():
    trainer = recorded_trainer(QUICKSTART, list(OWN_GROUPS))
    groups = {id(group.workers): group.workers for group in trainer.cluster.roles.groups.values()}
    assert len(groups) == 3
    assert trainer.cluster.stop_profiles() == []  # nothing was recording
    assert [_count(workers, "stop_profile") for workers in groups.values()] == [1, 1, 1]


def _count(workers, method: str) -> int:
    return sum(call.method == method for call in workers.calls)


def _names(path: Path) -> set[str]:
    return {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
