"""`megarl validate` and `megarl train` agree on every placement (issue 14, item 6): validate runs the
placement checks train runs before Ray starts (`megarl.config.placement`), and what train checks once the
cluster has resolved `trainer.device` (`roles.cluster_device`) refuses nothing validate accepted for a
definite device (for `auto`, validate warns of what a GPU cluster would refuse). Neither asks this
machine's CUDA."""

import pytest

from megarl.config import ConfigError, resolve_device
from megarl.trainer import roles
from megarl.trainer.trainer import Trainer
from tests.unit.reliability.test_reliability_cli_inputs import model_dir, problem_lines, run_cli, workdir  # noqa: F401

SPLIT = ["placement.mode=split", "placement.gpus_per_node=4", "placement.rollout_gpus=2"]
TP_2 = ["rollout.tensor_model_parallel_size=2"]
PLACEMENTS = {"colocated-tp1": [], "colocated-tp2": TP_2, "split-tp1": SPLIT, "split-tp2": SPLIT + TP_2}
REFUSED = {("colocated-tp2", "cpu"), ("colocated-tp2", "cuda"), ("split-tp2", "cuda")}
"""An engine spans several GPUs: colocated on any device, split on CUDA (split on CPU runs TP > 1)."""
CLUSTER_GPUS = {"cpu": 0.0, "cuda": 8.0}


def train_problems(overrides: list[str], cluster_gpus: float, monkeypatch) -> list[str]:
    """What `megarl train` refuses: `Trainer.from_config` before Ray, then `cluster_device` on a cluster
    with `cluster_gpus` GPU resources."""
    monkeypatch.setattr(roles, "cluster_gpus", lambda: cluster_gpus)
    try:
        trainer = Trainer.from_config("recipe.yaml", overrides)
        roles.cluster_device(trainer.config)
    except ConfigError as error:
        return [str(problem) for problem in error.problems]
    return []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_validate_and_train_agree(workdir, capsys, monkeypatch, placement, device):  # noqa: F811
    overrides = [*PLACEMENTS[placement], f"trainer.device={device}"]
    code, _, err = run_cli(capsys, "validate", "recipe.yaml", *overrides)
    refused_by_validate = problem_lines("validate", err)
    refused_by_train = train_problems(overrides, CLUSTER_GPUS[device], monkeypatch)
    assert refused_by_validate == refused_by_train
    assert (code == 2) == ((placement, device) in REFUSED)
    assert all(line.startswith("rollout.tensor_model_parallel_size = 2") for line in refused_by_train)


def test_auto_leaves_the_gpu_only_refusal_to_the_cluster(workdir, capsys, monkeypatch):  # noqa: F811
    """trainer.device=auto: validate refuses what no device can host and accepts split TP 2 (it runs on a
    CPU cluster); train refuses it on a GPU cluster once Ray says there are GPUs."""
    overrides = [*PLACEMENTS["split-tp2"], "trainer.device=auto"]
    code, out, _ = run_cli(capsys, "validate", "recipe.yaml", *overrides)
    assert code == 0
    assert train_problems(overrides, CLUSTER_GPUS["cpu"], monkeypatch) == []
    [problem] = train_problems(overrides, CLUSTER_GPUS["cuda"], monkeypatch)
    assert problem.startswith("rollout.tensor_model_parallel_size = 2") and "trainer.device=cuda" in problem
    # validate says so up front, as a warning
    assert [line for line in out.splitlines() if line.startswith("warning:")] == [
        f"warning: on a CUDA cluster `megarl train` stops with: {problem}"]
    colocated = [*PLACEMENTS["colocated-tp2"], "trainer.device=auto"]
    assert run_cli(capsys, "validate", "recipe.yaml", *colocated)[0] == 2


@pytest.mark.parametrize("setting, gpus, device", [
    ("auto", 8.0, "cuda"), ("auto", 0.0, "cpu"), ("cpu", 8.0, "cpu"), ("cuda", 0.5, "cuda"),
])
def test_the_device_is_resolved_against_the_cluster_not_this_machine(setting, gpus, device):
    assert resolve_device(setting, gpus) == device


def test_cuda_on_a_cluster_without_gpus_stops_train_naming_the_setting(workdir, monkeypatch):  # noqa: F811
    [problem] = train_problems(["trainer.device=cuda"], 0.0, monkeypatch)
    assert problem.startswith("trainer.device = 'cuda': the Ray cluster has 0 GPU resources")
    assert "trainer.device: cpu" in problem
