"""Rollout engines: generate responses (token ids, log-probs, finish reasons) and take new weights.

`base` holds the contract (`RolloutEngine`, `SamplingConfig`, `RolloutOutput`); `vllm_engine` and
`hf_engine` implement it; `weight_sync_protocol` (bucket format) and `sync_group` (the trainer ⇄
worker process group) are shared with the weight-sync bridge's sending side; `worker_extension`
runs inside vLLM's workers. Importing this package does not import vLLM (see `factory`).
"""

from megarl.workers.rollout.base import (
    RolloutEngine,
    RolloutOutput,
    RolloutPausedError,
    SamplingConfig,
)
from megarl.workers.rollout.factory import make_rollout_engine
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata, TensorSlot, pack, unpack

__all__ = [
    "BucketMetadata",
    "RolloutEngine",
    "RolloutOutput",
    "RolloutPausedError",
    "SamplingConfig",
    "TensorSlot",
    "make_rollout_engine",
    "pack",
    "unpack",
]
