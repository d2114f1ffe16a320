"""The reward model on megatron-core over gloo: scores equal HF's sequence-classification scores on
every (TP, PP) layout and rank, and checkpoints that are not one-label reward models are rejected
with the file named. One world per layout (spawns are the cost); the tests compare its numbers."""

import pytest
import torch
from reward_model_helpers import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

ATOL = 1e-4


def _rank_main(model_dir, tp, pp, micro_batch_size, rejected_dirs):
    """Try `from_hf` on each rejected dir (collecting the errors), then score `ragged_batch()`."""
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.reward_model import MegatronRewardModel

    groups = initialize_model_parallel(tp, pp, seed=0)
    errors = {}
    for name, rejected_dir in rejected_dirs.items():
        try:
            MegatronRewardModel.from_hf(rejected_dir, groups, model=FLOAT32_LOCAL)
        except ValueError as e:
            errors[name] = str(e)
    reward_model = MegatronRewardModel.from_hf(model_dir, groups, model=FLOAT32_LOCAL)
    scores = reward_model.compute_scores(ragged_batch(), micro_batch_size=micro_batch_size)
    return dict(
        # numpy: a torch tensor sent through run_distributed's queue dies with the rank process.
        scores=scores.numpy(),
        dtype=str(scores.dtype),
        frozen=not any(p.requires_grad for chunk in reward_model.chunks for p in chunk.parameters()),
        errors=errors,
    )


@pytest.fixture(scope="module")
def layouts(tiny_reward_model, not_reward_models):
    """name -> every rank's results: one process (4 micro-batches, and the rejected checkpoints),
    TP 2 (2 micro-batches), PP 2 (4 micro-batches through 1F1B)."""
    runs = {"single": (1, 1, 1, 2, not_reward_models), "tp2": (2, 2, 1, 4, {}), "pp2": (2, 1, 2, 2, {})}
    return {
        name: run_distributed(_rank_main, world, str(tiny_reward_model), tp, pp, micro_batch_size, rejected)
        for name, (world, tp, pp, micro_batch_size, rejected) in runs.items()
    }


def test_scores_match_hf_on_every_layout_and_rank(layouts, hf_scores):
    assert hf_scores.std() > 0.1  # distinct scores: a wrong row or token would show
    for name, ranks in layouts.items():
        for rank, result in enumerate(ranks):
            assert result["dtype"] == "torch.float32"
            assert result["frozen"], f"{name} rank {rank}: reward model has trainable parameters"
            scores = torch.from_numpy(result["scores"])
            torch.testing.assert_close(scores, hf_scores, atol=ATOL, rtol=0, msg=lambda m: f"{name} rank {rank}: {m}")


def test_checkpoints_that_are_not_one_label_reward_models_are_rejected(layouts, not_reward_models):
    (single,) = layouts["single"]
    errors = single["errors"]
    assert set(errors) == {"causal_lm", "two_labels"}
    assert not_reward_models["causal_lm"] in errors["causal_lm"] and "'score.weight'" in errors["causal_lm"]
    assert f"{not_reward_models['two_labels']}/config.json" in errors["two_labels"]
    assert "num_labels=1" in errors["two_labels"] and "got 2" in errors["two_labels"]
