"""Pure torch RL algorithm functions: advantages, policy/value/entropy/KL losses, loss aggregation,
off-policy corrections (`rollout_correction`), DAPO's dynamic sampling and overlong shaping.

Nothing here imports torch.distributed, Ray, Megatron or vLLM: the functions see one (micro-)batch
of `[B, T]` tensors, and whatever spans micro-batches or ranks comes in as an argument
(`global_normalizer`, see `megarl.algorithms.losses`).
"""

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megarl.algorithms.dapo import DynamicSampler, dynamic_sampling_mask, overlong_penalty
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
)
from megarl.algorithms.losses import LOSS_AGG_MODES, agg_loss, agg_loss_normalizer, masked_mean
from megarl.algorithms.policy_loss import POLICY_LOSSES, PolicyLossOutput, compute_policy_loss
from megarl.algorithms.value_loss import compute_entropy_loss, compute_value_loss, entropy_from_logits

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "DynamicSampler",
    "FixedKLController",
    "PolicyLossOutput",
    "agg_loss",
    "agg_loss_normalizer",
    "apply_kl_penalty",
    "compute_advantages",
    "compute_entropy_loss",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_value_loss",
    "dynamic_sampling_mask",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "overlong_penalty",
]
