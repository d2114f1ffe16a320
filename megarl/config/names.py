"""Names that config values must match, taken from the registries that implement them (single source).

The algorithm registries live in megarl.algorithms (pure torch functions); they are imported only
when a config is validated, so reading a config stays free of torch.
"""

CRITIC_ESTIMATORS = ("gae",)
"""Advantage estimators that need a value model (critic.enable: true); all others refuse one."""

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo")
"""Estimators whose baseline comes from the other samples of the same prompt (need rollout.n >= 2)."""

BUILTIN_REWARDS = ("gsm8k", "math", "qa_em", "code")
"""Rule rewards shipped in megarl.rewards, selected by bare name in reward.function."""


def advantage_estimators() -> tuple[str, ...]:
    from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS

    return tuple(ADVANTAGE_ESTIMATORS)


def policy_losses() -> tuple[str, ...]:
    from megarl.algorithms.policy_loss import POLICY_LOSSES

    return tuple(POLICY_LOSSES)


def loss_agg_modes() -> tuple[str, ...]:
    from megarl.algorithms.losses import LOSS_AGG_MODES

    return tuple(LOSS_AGG_MODES)


def kl_estimators() -> tuple[str, ...]:
    from megarl.algorithms.kl import KL_ESTIMATORS

    return tuple(KL_ESTIMATORS)
