"""Methods mixed into every vLLM worker (`LLM(worker_extension_cls=WORKER_EXTENSION)`): the receiving
side of the weight sync.

vLLM makes the worker class inherit from this one, so `self` is the vLLM worker (`self.rank`,
`self.device`, `self.reload_weights`). The engine calls these methods by name through
`LLM.collective_rpc`, which runs them in every worker: in-process for TP 1, in the worker processes
of the multiprocess executor for TP > 1 (where only names and picklable arguments can travel,
hence a class and not closures).
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.workers.rollout.sync_group import create_weight_sync_group, receive_buckets
from megarl.workers.rollout.weight_sync_protocol import BucketMetadata

WORKER_EXTENSION = "megarl.workers.rollout.worker_extension.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Joins the trainer's weight-sync group and loads the buckets it broadcasts."""

    def init_weight_sync_group(
        self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float
    ) -> None:
        """Join as rank `rank_offset + self.rank` (the trainer is rank 0, so `rank_offset` is 1)."""
        self._megarl_sync_group = create_weight_sync_group(
            host, port, rank_offset + self.rank, world_size, timeout_s
        )

    def receive_weights(self, bucket_metadatas: Sequence[BucketMetadata]) -> None:
        """Receive the buckets of one sync and load them in one `reload_weights` pass.

        One pass for the whole sync matters: vLLM's reload processes a fused layer (qkv_proj,
        gate_up_proj) once all its parts have arrived within the pass, so q/k/v or gate/up may lie in
        different buckets; split over two passes, the parts missing from a pass would be garbage.
        """
        group = getattr(self, "_megarl_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_sync_group: join the sync group first")
        weights = receive_buckets(group, bucket_metadatas, self.device)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
