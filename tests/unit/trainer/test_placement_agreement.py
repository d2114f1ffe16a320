"""`megarl validate` and `megarl train` agree on every placement (issue 14, item 6): validate runs the
placement checks train runs before Ray starts (`megarl.config.placement`), and what train checks once the
cluster has resolved `trainer.device` (`roles.cluster_device`) refuses nothing validate accepted. Neither
asks this machine's CUDA. Rollout engines span `rollout.tensor_model_parallel_size` devices on every
placement and device (issue 15, item 4), so the seeds' layout (6 GPUs, colocated, rollout TP 2) runs."""

import pytest

from megarl.cluster import roles
from megarl.config.placement import resolve_device
from megarl.config.problems import ConfigError
from megarl.trainer.trainer import Trainer
from tests.unit.reliability.conftest import model_dir, workdir  # noqa: F401
from tests.unit.reliability.test_reliability_cli_inputs import problem_lines, run_cli

SPLIT = ["placement.mode=split", "placement.gpus_per_node=4", "placement.rollout_gpus=2"]
TP_2 = ["rollout.tensor_model_parallel_size=2"]
SEEDS = ["placement.gpus_per_node=6", *TP_2, "data.train_batch_size=12", "actor.ppo_mini_batch_size=12"]
"""The seeds' layout: 6 GPUs, colocated, rollout TP 2 (3 engines); 12 prompts × 8 samples fit actor DP 3."""
PLACEMENTS = {"colocated-tp1": [], "colocated-tp2": TP_2, "split-tp1": SPLIT, "split-tp2": SPLIT + TP_2, "seeds": SEEDS}
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


@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_validate_and_train_accept_every_placement(workdir, capsys, monkeypatch, placement, device):  # noqa: F811
    overrides = [*PLACEMENTS[placement], f"trainer.device={device}"]
    code, out, err = run_cli(capsys, "validate", "recipe.yaml", *overrides)
    assert (code, problem_lines("validate", err)) == (0, []), err
    assert not [line for line in out.splitlines() if line.startswith("warning:")]
    for gpus in {"cpu": [0.0], "cuda": [8.0], "auto": [0.0, 8.0]}[device]:
        assert train_problems(overrides, gpus, monkeypatch) == []


def test_the_seeds_layout_validates_with_three_two_gpu_engines(workdir, capsys):  # noqa: F811
    code, out, err = run_cli(capsys, "validate", "recipe.yaml", *SEEDS, "trainer.device=cuda")
    assert code == 0, err
    lines = out.splitlines()
    assert "rollout:  6 GPUs ÷ TP 2 = 3 engines, 32 samples each" in lines
    assert "           2 processes per training GPU: 1 Megatron, 1 TP worker of a 2-GPU rollout engine" in lines


@pytest.mark.parametrize(
    "setting, gpus, device",
    [
        ("auto", 8.0, "cuda"),
        ("auto", 0.0, "cpu"),
        ("cpu", 8.0, "cpu"),
        ("cuda", 0.5, "cuda"),
    ],
)
def test_the_device_is_resolved_against_the_cluster_not_this_machine(setting, gpus, device):
    assert resolve_device(setting, gpus) == device


def test_cuda_on_a_cluster_without_gpus_stops_train_naming_the_setting(workdir, monkeypatch):  # noqa: F811
    [problem] = train_problems(["trainer.device=cuda"], 0.0, monkeypatch)
    assert problem.startswith("trainer.device = 'cuda': the Ray cluster has 0 GPU resources")
    assert "trainer.device: cpu" in problem
