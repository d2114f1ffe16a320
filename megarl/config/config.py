"""The whole config: one field per section, each a frozen dataclass (defaults live there and nowhere else)."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megarl.config.roles import ActorConfig, CriticConfig, RefConfig
from megarl.config.rollout import RolloutConfig
from megarl.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    RewardConfig,
    TrainerConfig,
)


@dataclass(frozen=True)
class Config:
    """A megarl job. Every component reads only its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint and how it is built."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (GAE only)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (KL terms only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engines and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation and reward KL."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and batch size."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop length, validation, logging, device."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Roles onto devices."""


def to_dict(config) -> dict[str, Any]:
    """The config (or one section) as plain YAML-ready data: sections become dicts, tuples become lists."""
    plain: dict[str, Any] = _plain(dataclasses.asdict(config))
    return plain


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value
