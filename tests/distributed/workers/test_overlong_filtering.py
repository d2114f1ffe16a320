"""DAPO's overlong filtering in the actor update: a `loss_mask` that drops the truncated samples trains
exactly as the update of the batch without them (token-mean loss, megatron-core on gloo)."""

import dataclasses

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

TRUNCATED = torch.tensor([False, True, False, False, True, False, False, False])
TOLERANCE = 1e-5


def _rank_main(model_dir, old_log_probs, advantages):
    from megarl.algorithms.dapo import filtered_loss_mask
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, 1, seed=0)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    loss_fn = PolicyLoss(ActorConfig(entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1))
    kept = torch.nonzero(~TRUNCATED)[:, 0]
    runs = {
        "filtered": (dataclasses.replace(batch, loss_mask=filtered_loss_mask(batch.response_mask, TRUNCATED)), 4),
        "without": (batch.select(kept), 3),
        "unfiltered": (batch, 4),
    }
    out = {}
    for name, (part, micro) in runs.items():
        actor = MegatronActor.from_hf(
            model_dir,
            groups,
            optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
            model=FLOAT32_LOCAL,
        )
        metrics = actor.update_policy(part, loss_fn, mini_batch_size=len(part), micro_batch_size=micro)
        out[name] = metrics, {n: p.detach().clone().numpy() for n, p in actor.named_parameters_for_sync()}
    return out


@pytest.fixture(scope="module")
def rank(tiny_qwen2, hf_reference):
    gen = torch.Generator().manual_seed(11)
    old_log_probs = hf_reference[0] + 0.05 * torch.randn(hf_reference[0].shape, generator=gen)
    advantages = torch.randn(old_log_probs.shape, generator=gen)
    [result] = run_distributed(_rank_main, 1, str(tiny_qwen2), old_log_probs, advantages)
    return result


def test_filtered_update_equals_the_update_without_the_truncated_samples(rank):
    (filtered, filtered_params), (without, without_params) = rank["filtered"], rank["without"]
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
        assert filtered[key] == pytest.approx(without[key], rel=TOLERANCE, abs=TOLERANCE), key
    for name, value in without_params.items():
        diff = float(np.abs(filtered_params[name] - value).max())
        assert diff <= TOLERANCE, f"parameter {name} differs by {diff:.2e}"
    # The truncated samples did count without the filter.
    unfiltered = rank["unfiltered"][0]
    assert unfiltered["tokens"] > filtered["tokens"] and unfiltered["loss"] != pytest.approx(filtered["loss"])
