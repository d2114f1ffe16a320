"""Packed micro-batches (samples concatenated under a token budget, attention and positions restarting
per sample) compute what padded micro-batches compute: log-probs, entropy, critic values, the update's
losses, metrics and gradients, for several budgets, on megatron-core's local spec over gloo.

Two worlds of two ranks: TP 2 (vocab-parallel log-probs, split attention heads) and TP 1 × PP 2 (the
pipeline schedule, whose stages exchange one shape: packed rows padded to the budget). The ragged
batch's longest sample has 11 tokens: a budget of 11 gives mostly one sample per row, 24 a few per
row, 96 the whole batch in one row.
"""

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

BUDGETS = (11, 24, 96)
PADDED_MICRO_BATCH = 4
TOLERANCE = 1e-5


def _update(actor, batch, loss_fn, cut):
    """The update's metrics and this rank's gradients (Megatron keeps them in `main_grad` until the
    next step zeroes them)."""
    metrics = actor.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=cut)
    grads = {name: p.main_grad.detach().clone().numpy() for name, p in actor.named_parameters_for_sync()}
    return metrics, grads


def _rank_main(model_dir, tp, pp, old_log_probs, advantages, returns):
    from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.critic import MegatronCritic
    from megarl.workers.packing import TokenBudget

    groups = initialize_model_parallel(tp, pp, seed=0)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    batch.ref_log_probs = old_log_probs - 0.1
    batch.values, batch.returns = torch.zeros_like(returns), returns
    cuts = {"padded": PADDED_MICRO_BATCH} | {
        budget: TokenBudget(budget, "actor.max_tokens_per_micro_batch") for budget in BUDGETS
    }
    optim = OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False)
    losses = {
        "token-mean": PolicyLoss(ActorConfig(entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1)),
        "seq-mean-token-mean": PolicyLoss(
            ActorConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
        ),
    }
    out = {"log_probs": {}, "entropy": {}, "updates": {}, "values": {}}
    actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
    for name, cut in cuts.items():
        out["log_probs"][name], out["entropy"][name] = actor.compute_log_prob(batch, micro_batch_size=cut)
    for loss_name, loss_fn in losses.items():
        for name, cut in cuts.items():
            actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
            out["updates"][loss_name, name] = _update(actor, batch, loss_fn, cut)
    critic = MegatronCritic.from_hf(model_dir, groups, optim=optim, loss=CriticConfig(), model=FLOAT32_LOCAL)
    for name, cut in cuts.items():
        out["values"][name] = critic.compute_values(batch, micro_batch_size=cut).numpy()
    out["log_probs"] = {k: v.numpy() for k, v in out["log_probs"].items()}
    out["entropy"] = {k: v.numpy() for k, v in out["entropy"].items()}
    return out


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "tp1-pp2"])
def ranks(request, tiny_qwen2, hf_reference):
    tp, pp = request.param
    gen = torch.Generator().manual_seed(5)
    old_log_probs = hf_reference[0] + 0.05 * torch.randn(hf_reference[0].shape, generator=gen)
    advantages = torch.randn(old_log_probs.shape, generator=gen)
    returns = torch.randn(old_log_probs.shape, generator=gen)
    return run_distributed(_rank_main, tp * pp, str(tiny_qwen2), tp, pp, old_log_probs, advantages, returns)


def _max_diff(actual, expected, mask) -> float:
    return float(np.abs(np.where(mask, actual - expected, 0.0)).max())


def test_packed_log_probs_entropy_and_values_equal_the_padded_ones(ranks, hf_reference):
    mask = ragged_batch().response_mask.numpy()
    for rank in ranks:
        for key in ("log_probs", "entropy", "values"):
            padded = rank[key]["padded"]
            for budget in BUDGETS:
                diff = _max_diff(rank[key][budget], padded, mask)
                assert diff <= TOLERANCE, f"{key}, budget {budget}: max abs difference {diff:.2e} to padded"
        # And the padded path is the ground truth's (HF, each sample alone).
        assert _max_diff(rank["log_probs"]["padded"], hf_reference[0].numpy(), mask) <= 1e-4


def test_packed_updates_have_the_padded_losses_metrics_and_gradients(ranks):
    for rank in ranks:
        for loss_name in ("token-mean", "seq-mean-token-mean"):
            padded_metrics, padded_grads = rank["updates"][loss_name, "padded"]
            assert padded_metrics["grad_norm"] > 0
            for budget in BUDGETS:
                metrics, grads = rank["updates"][loss_name, budget]
                for key in ("loss", "pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "grad_norm", "tokens"):
                    assert metrics[key] == pytest.approx(padded_metrics[key], rel=TOLERANCE, abs=TOLERANCE), (
                        f"{loss_name}, budget {budget}: {key}"
                    )
                for name, grad in padded_grads.items():
                    diff = float(np.abs(grads[name] - grad).max())
                    assert diff <= TOLERANCE, f"{loss_name}, budget {budget}: gradient {name} differs by {diff:.2e}"
