"""Rollout engines: generate responses (token ids, log-probs, finish reasons) and take new weights.

`base` holds the contract (`RolloutEngine`, `SamplingConfig`, `RolloutOutput`); `vllm_engine` and
`hf_engine` implement it, taking weights through the receiving halves that `megarl.bridge` exports
(rings, shard receive, sync group, bucket format); `worker_extension` runs inside vLLM's workers. Importing this package does not import vLLM (see `factory`).
"""

from megarl.workers.rollout.base import (
    RolloutEngine,
    RolloutOutput,
    RolloutPausedError,
    SamplingConfig,
)
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.factory import make_rollout_engine

__all__ = [
    "EngineArgs",
    "RolloutEngine",
    "RolloutOutput",
    "RolloutPausedError",
    "SamplingConfig",
    "make_rollout_engine",
]
