"""An exactly on-policy update (one mini-batch, one epoch) takes its old log-probs from its own forward:
the same loss, gradients and updated weights (fp32, bit for bit) as with a separate old-log-prob pass,
without that pass.

One TP-2 world (vocab-parallel log-probs), the loss with every term that reads the old log-probs
(PPO clip, truncated IS against the rollout's log-probs, the mismatch metrics) plus an entropy bonus, two micro-batches.
"""

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed


def _update(actor, batch, loss_fn):
    """The update's metrics, then this rank's gradients and updated weights (Megatron keeps the grads
    in `main_grad` until the next step zeroes them)."""
    metrics = actor.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=len(batch) // 2)
    params = dict(actor.named_parameters_for_sync())
    grads = {name: p.main_grad.detach().clone().numpy() for name, p in params.items()}
    weights = {name: p.detach().clone().numpy() for name, p in params.items()}
    return metrics, grads, weights


def _rank_main(model_dir, advantages, rollout_log_probs):
    import megarl.workers.actor as actor_module
    from megarl.config.roles import ActorConfig, OptimizerConfig, RolloutCorrectionConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(2, 1, seed=0)
    batch = ragged_batch()
    batch.advantages, batch.rollout_log_probs = advantages, rollout_log_probs
    loss_fn = PolicyLoss(
        ActorConfig(rollout_correction=RolloutCorrectionConfig(level="token", high=1.5), entropy_coeff=0.01),
        report_mismatch=True,
    )
    optim = OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False)
    out = {}

    separate = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
    with_pass = batch.select(slice(None))
    with_pass.old_log_probs, _ = separate.compute_log_prob(batch, micro_batch_size=len(batch) // 2)
    out["separate"] = _update(separate, with_pass, loss_fn)

    def no_separate_pass(*args, **kwargs):
        raise AssertionError("the on-policy update ran a separate old-log-prob pass")

    actor_module.compute_log_probs = no_separate_pass
    on_policy = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
    out["on_policy"] = _update(on_policy, batch, loss_fn)
    # Two mini-batches reuse the batch under moved weights: the update refuses to guess old log-probs.
    try:
        on_policy.update_policy(batch, loss_fn, mini_batch_size=len(batch) // 2, micro_batch_size=len(batch) // 2)
    except ValueError as error:
        out["reuse_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_qwen2):
    gen = torch.Generator().manual_seed(3)
    shape = ragged_batch().responses.shape
    advantages = torch.randn(shape, generator=gen)
    rollout_log_probs = -2.0 - torch.rand(
        shape, generator=gen
    )  # far enough from the policy's that the correction caps some
    return run_distributed(_rank_main, 2, str(tiny_qwen2), advantages, rollout_log_probs)


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        diff = np.abs(actual[name] - expected[name]).max()
        assert diff == 0, f"{what} {name}: max abs difference {diff:.2e}"


def test_on_policy_update_equals_the_update_after_a_separate_pass(ranks):
    for rank in ranks:
        separate_metrics, separate_grads, separate_weights = rank["separate"]
        metrics, grads, weights = rank["on_policy"]
        # Bit-equal, not just close: both take the old log-probs from the same forward kernels on the
        # same micro-batches, so the ratio is exactly 1 on either path.
        assert metrics == separate_metrics
        assert metrics["grad_norm"] > 0  # the step did move the weights
        _assert_equal(grads, separate_grads, "gradient")
        _assert_equal(weights, separate_weights, "weight")
        # The ratio is exactly 1: no KL to the old policy and nothing clipped.
        assert metrics["approx_kl"] == 0 and metrics["clip_frac"] == 0 and metrics["clip_frac_lower"] == 0


def test_reusing_the_batch_needs_old_log_probs(ranks):
    for rank in ranks:
        assert "needs PolicyBatch.old_log_probs for 2 mini-batch(es) × 1 epoch(s)" in rank["reuse_error"]
