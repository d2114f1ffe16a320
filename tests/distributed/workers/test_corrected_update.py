"""The actor's off-policy correction changes the update exactly as computed: a `vanilla` update with a
correction equals the uncorrected update whose advantages were multiplied by the correction's weights
(computed here by hand from the engines' and the actor's log-probs), and differs from the update without
it. Weights >= 0 factor out of PPO's clip and dual clip, so the two objectives are the same function.

One DP-2 world (two micro-batches per rank): the correction reads each rank's rows, the mismatch
metrics add up over micro-batches and ranks to the full batch's (`mismatch_metrics` on all 8 rows).
"""

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.algorithms.rollout_correction import mismatch_metrics
from megarl.parallel.spawn import run_distributed

TOKEN_CAP, SEQUENCE_RANGE = 1.5, (0.3, 3.0)


def _update(model_dir, groups, batch, loss):
    """A fresh actor's update of `batch` with `loss`: its metrics and this rank's gradients."""
    from megarl.config.roles import OptimizerConfig
    from megarl.workers.actor import MegatronActor

    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        model=FLOAT32_LOCAL,
    )
    metrics = actor.update_policy(batch, loss, mini_batch_size=len(batch), micro_batch_size=len(batch) // 2)
    grads = {name: p.main_grad.detach().clone().numpy() for name, p in actor.named_parameters_for_sync()}
    return metrics, grads


def _rank_main(model_dir, advantages, ratios):
    from megarl.config.roles import ActorConfig, OptimizerConfig, RolloutCorrectionConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, 1, seed=0)  # DP 2
    full = ragged_batch()
    probe = MegatronActor.from_hf(
        model_dir, groups, optim=OptimizerConfig(weight_decay=0.0, use_distributed_optimizer=False), model=FLOAT32_LOCAL
    )
    full.old_log_probs, _ = probe.compute_log_prob(full, micro_batch_size=4)
    full.rollout_log_probs = full.old_log_probs - ratios.log()  # π_old / π_rollout = ratios
    full.advantages = advantages
    rows = slice(4 * groups.dp_rank, 4 * groups.dp_rank + 4)
    batch, mask = full.select(rows), full.response_mask[rows]
    token_ratios = torch.where(mask, ratios[rows], 1.0)

    # By hand: min(ρ, cap) per token; the product of a response's token ratios, kept inside the range.
    token_weights = token_ratios.clamp(max=TOKEN_CAP)
    sequence_ratio = token_ratios.prod(dim=-1, keepdim=True)
    low, high = SEQUENCE_RANGE
    sequence_weights = torch.where((sequence_ratio >= low) & (sequence_ratio <= high), sequence_ratio, 0.0)

    out = {"old_log_probs": full.old_log_probs.numpy()}
    corrections = {
        "token_truncate": (RolloutCorrectionConfig("token", "truncate", high=TOKEN_CAP), token_weights),
        "sequence_mask": (RolloutCorrectionConfig("sequence", "mask", low=low, high=high), sequence_weights),
    }
    for name, (correction, weights) in corrections.items():
        corrected = PolicyLoss(ActorConfig(rollout_correction=correction), report_mismatch=True)
        out[name] = _update(model_dir, groups, batch, corrected)
        weighted = batch.select(slice(None))
        weighted.advantages = batch.advantages * weights.expand_as(mask)
        out[f"{name}_by_hand"] = _update(model_dir, groups, weighted, PolicyLoss(ActorConfig()))
    out["uncorrected"] = _update(model_dir, groups, batch, PolicyLoss(ActorConfig()))
    return out


@pytest.fixture(scope="module")
def ranks(tiny_qwen2):
    gen = torch.Generator().manual_seed(5)
    shape = ragged_batch().responses.shape
    advantages = torch.randn(shape, generator=gen)
    ratios = 0.5 + 2.5 * torch.rand(shape, generator=gen)  # π_old / π_rollout in [0.5, 3]: some capped
    return run_distributed(_rank_main, 2, str(tiny_qwen2), advantages, ratios), ratios


def _max_relative_difference(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys()
    return max(np.abs(actual[n] - expected[n]).max() / max(np.abs(expected[n]).max(), 1e-12) for n in expected)


@pytest.mark.parametrize("name", ["token_truncate", "sequence_mask"])
def test_the_corrected_update_is_the_update_with_weighted_advantages(ranks, name):
    results, _ = ranks
    for rank in results:
        (metrics, grads), (by_hand, by_hand_grads) = rank[name], rank[f"{name}_by_hand"]
        _, uncorrected_grads = rank["uncorrected"]
        assert metrics["pg_loss"] == pytest.approx(by_hand["pg_loss"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(by_hand["grad_norm"], rel=1e-5)
        assert _max_relative_difference(grads, by_hand_grads) < 1e-4
        assert _max_relative_difference(grads, uncorrected_grads) > 1e-2  # the correction did change the update
        assert 0 < metrics["correction_out_of_range_tokens"] < 1  # some tokens capped / masked, not all


def test_mismatch_metrics_add_up_over_micro_batches_and_ranks(ranks):
    results, ratios = ranks
    old = torch.from_numpy(results[0]["old_log_probs"])
    batch = ragged_batch()
    expected = mismatch_metrics(old, old - ratios.log(), batch.response_mask)
    for rank in results:
        for name in ("token_truncate", "sequence_mask"):
            metrics, _ = rank[name]
            for key, value in expected.items():
                assert metrics[key] == pytest.approx(value.item(), rel=1e-5), (name, key)
