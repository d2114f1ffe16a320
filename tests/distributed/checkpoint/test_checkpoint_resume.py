"""Resume is exact: save after a step, train 2 more steps; a fresh world (other seed, so other initial
weights and RNG streams) that loads the checkpoint trains the same 2 steps to bit-identical losses,
LRs, RNG draws and weights (fp32, CPU). For TP=2, and for DP=2 with the distributed optimizer.

Each layout costs two spawns (original, resumed); the DP=2 resumed world also reads the TP=2
checkpoint (weights load at another layout, a full resume is refused). Every check of a world is
done inside it and the numbers compared here.
"""

import numpy as np
import pytest
from checkpoint_toy import ToyJob

from megarl.parallel.spawn import run_distributed

EXTRA = {"step": 1, "data": {"epoch": 0, "position": 3, "seed": 5}, "note": "résumé"}


# Vocab rows padded to a multiple of 256 at every TP (128 x TP=2, 256 x TP=1), so that the TP=1
# world can also read the TP=2 checkpoint's weights.
PADDED_VOCAB_MULTIPLE = 256


def _job(tp: int, seed: int, dist_opt: bool) -> ToyJob:
    return ToyJob(tp, seed=seed, use_distributed_optimizer=dist_opt, vocab_divisible_by=PADDED_VOCAB_MULTIPLE // tp)


def _original(root: str, tp: int, dist_opt: bool) -> dict:
    from megarl.workers.checkpoint import save_checkpoint

    job = _job(tp, 1234, dist_opt)
    first = job.train_step()
    step_dir = save_checkpoint(root, 1, job.groups, **job.parts(), extra=EXTRA)
    saved_eval_loss = job.eval_loss()
    after = [job.train_step() for _ in range(2)]
    return dict(
        step_dir=str(step_dir), first=first, after=after, eval_loss=saved_eval_loss, weights=job.local_weights()
    )


def _resumed(step_dir: str, tp: int, dist_opt: bool, other_layout_step_dir: str | None) -> dict:
    """Resume from `step_dir` and train 2 steps; then, if given, read a checkpoint of another layout:
    a full resume is refused, its weights load."""
    from megarl.workers.checkpoint import CheckpointError, load_checkpoint

    job = _job(tp, 999, dist_opt)
    fresh_eval_loss = job.eval_loss()
    extra = load_checkpoint(step_dir, job.groups, **job.parts())
    result = dict(
        extra=extra,
        fresh_eval_loss=fresh_eval_loss,
        after=[job.train_step() for _ in range(2)],
        weights=job.local_weights(),
    )
    if other_layout_step_dir is not None:
        try:
            load_checkpoint(other_layout_step_dir, job.groups, **job.parts())
        except CheckpointError as e:
            result["refused"] = str(e)
        result["other_extra"] = load_checkpoint(other_layout_step_dir, job.groups, **job.parts(), weights_only=True)
        result["other_eval_loss"] = job.eval_loss()
    return result


def _check_same_continuation(original: list, resumed: list) -> None:
    for rank, (a, b) in enumerate(zip(original, resumed)):
        # Exact equality: the same fp32 arithmetic on the same state.
        assert [s["loss"] for s in b["after"]] == [s["loss"] for s in a["after"]], f"rank {rank}"
        assert [s["lr"] for s in b["after"]] == [s["lr"] for s in a["after"]], f"rank {rank}"
        assert [s["draws"] for s in b["after"]] == [s["draws"] for s in a["after"]], f"rank {rank}"
        assert a["weights"].keys() == b["weights"].keys()
        for name in a["weights"]:
            np.testing.assert_array_equal(b["weights"][name], a["weights"][name], err_msg=f"rank {rank}: {name}")
        assert b["extra"] == EXTRA


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp2"))
    original = run_distributed(_original, 2, root, 2, False)
    resumed = run_distributed(_resumed, 2, original[0]["step_dir"], 2, False, None)
    return original, resumed


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, tp2):
    """TP=1 x DP=2 with the distributed optimizer; its resumed world also reads the TP=2 checkpoint."""
    root = str(tmp_path_factory.mktemp("dp2"))
    original = run_distributed(_original, 2, root, 1, True)
    resumed = run_distributed(_resumed, 2, original[0]["step_dir"], 1, True, tp2[0][0]["step_dir"])
    return original, resumed


def test_tp2_resume_is_exact(tp2):
    original, resumed = tp2
    # The fresh world starts elsewhere: equal continuations come from the checkpoint, not the seed.
    assert resumed[0]["fresh_eval_loss"] != original[0]["eval_loss"]
    # The LR moves every step (warm-up, cosine), so the scheduler position is part of what matches.
    lrs = [original[0]["first"]["lr"]] + [s["lr"] for s in original[0]["after"]]
    assert len(set(lrs)) == 3
    _check_same_continuation(original, resumed)


def test_dp2_distributed_optimizer_resume_is_exact(dp2):
    original, resumed = dp2
    assert resumed[0]["fresh_eval_loss"] != original[0]["eval_loss"]
    # Each DP rank trains on its own half of the batch; both hold the same (averaged) weights.
    assert original[0]["after"][0]["loss"] == original[1]["after"][0]["loss"]
    _check_same_continuation(original, resumed)


def test_weights_load_at_another_layout(tp2, dp2):
    tp2_original, _ = tp2
    _, dp2_resumed = dp2
    for got in dp2_resumed:
        assert "layout" in got["refused"] and "weights only" in got["refused"]
        assert got["other_extra"] == EXTRA
        # Same weights, other arithmetic (no TP reductions): equal up to float rounding.
        assert got["other_eval_loss"] == pytest.approx(tp2_original[0]["eval_loss"], rel=1e-5)
