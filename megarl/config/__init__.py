"""megarl's config: typed sections, YAML recipes with overrides, validation and the batch plan.

    config = load_config("configs/quickstart.yaml", ["actor.optim.lr=1e-5"])   # raises ConfigError
    problems = validate(config)                                                 # list[Problem]
    plan = plan_batches(config)                                                 # BatchPlan

Defaults live only in the dataclasses; a recipe states what differs. Nothing here rewrites a
setting: derived sizes live in the `BatchPlan`.
"""

from megarl.config.batch_plan import BatchPlan, RolePlan, UpdatePlan, plan_batches, uses_reference
from megarl.config.config import Config, to_dict
from megarl.config.loader import apply_overrides, build_config, load_config, parse_yaml
from megarl.config.model_facts import KNOWN_MODELS, ModelFacts, ModelFactsError, load_model_facts
from megarl.config.placement import cluster_problems, placement_problems, resolve_device
from megarl.config.plan_table import format_plan
from megarl.config.problems import ConfigError, Problem
from megarl.config.roles import (
    ActorConfig,
    CriticConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    RecomputeConfig,
    RefConfig,
)
from megarl.config.rollout import RolloutConfig, SyncConfig
from megarl.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    DynamicSamplingConfig,
    KLControlConfig,
    ModelConfig,
    OverlongConfig,
    PlacementConfig,
    RewardConfig,
    TrainerConfig,
)
from megarl.config.validate import checked_config, validate

__all__ = [
    "KNOWN_MODELS",
    "ActorConfig",
    "AlgorithmConfig",
    "BatchPlan",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "KLControlConfig",
    "ModelConfig",
    "ModelFacts",
    "ModelFactsError",
    "OffloadConfig",
    "OptimizerConfig",
    "OverlongConfig",
    "ParallelConfig",
    "PlacementConfig",
    "Problem",
    "RecomputeConfig",
    "RefConfig",
    "RewardConfig",
    "RolePlan",
    "RolloutConfig",
    "SyncConfig",
    "TrainerConfig",
    "UpdatePlan",
    "apply_overrides",
    "build_config",
    "checked_config",
    "cluster_problems",
    "format_plan",
    "load_config",
    "load_model_facts",
    "parse_yaml",
    "placement_problems",
    "plan_batches",
    "resolve_device",
    "to_dict",
    "uses_reference",
    "validate",
]
