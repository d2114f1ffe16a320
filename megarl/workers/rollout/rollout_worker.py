"""One rollout engine as a remotely driven worker: generation, the probe for sync verification, and
the receiving side of the weight sync split into start/finish calls, so a driver can run the
trainer's send between them. A plain class; `megarl.orchestration` hosts one per engine.

    worker.start_weight_sync(host, port, world_size, rank_offset, timeout_s)   # returns at once
    ...the trainer's sending ranks join the group (PolicyWorker.connect_weight_sync)...
    worker.finish_weight_sync()
    worker.start_receive(source); ...trainer sends...; worker.finish_receive()
        # source: CollectivePlan(plan) over the group; on the same node SharedRings({tp_rank: ring}) or,
        # per rank, RankRings(rings_by_rank) (`megarl.bridge.WeightSource`)
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import Tensor

from megarl.bridge import WeightSource
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.factory import make_rollout_engine


class RolloutWorker:
    """Hosts one `RolloutEngine` (its own TP group of vLLM workers when TP > 1)."""

    def __init__(self, backend: str, args: EngineArgs):
        self.engine = make_rollout_engine(backend, args)
        self._pending: Future | None = None

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        max_new_tokens: list[int] | None = None,
        seeds: list[int] | None = None,
    ) -> list[RolloutOutput]:
        return self.engine.generate(prompt_token_ids, sampling, max_new_tokens, seeds)

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[Tensor]:
        return self.engine.prompt_logprobs(token_ids)

    def loaded_checksums(self) -> list:
        """Per engine worker, the checksums of what its last sync loaded (`bridge.checksum.LoadedChecksums`)."""
        return self.engine.loaded_checksums()

    def weight_version(self) -> int:
        return self.engine.weight_version

    def start_weight_sync(self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float) -> None:
        """Begin joining the weight-sync group (completes when the trainer's rank 0 joins too)."""
        self._pending = self.engine.init_weight_sync(host, port, world_size, timeout_s, rank_offset=rank_offset)

    def finish_weight_sync(self, timeout_s: float) -> None:
        self._take_pending().result(timeout=timeout_s)

    def start_receive(self, source: WeightSource) -> None:
        """Pause generation and start loading one sync from `source` (`RolloutEngine.receive`); then
        `finish_receive`."""
        self.engine.pause()
        self._pending = self.engine.receive(source)

    def finish_receive(self, timeout_s: float) -> int:
        """Wait for the load (prefix cache flushed, version bumped), resume; the new weight version."""
        try:
            self._take_pending().result(timeout=timeout_s)
        finally:
            self.engine.resume()
        return self.engine.weight_version

    def sleep(self) -> dict[str, float]:
        """Free the engine's KV cache and weights (`RolloutEngine.sleep`); the engine's memory afterwards."""
        self.engine.sleep()
        return self.engine.memory_stats()

    def wake_up(self, tags: list[str] | None = None) -> dict[str, float]:
        """Bring back the memory `tags` name ("weights", "kv_cache"; None: all); the engine's memory afterwards."""
        self.engine.wake_up(tags)
        return self.engine.memory_stats()

    def memory_stats(self) -> dict[str, float]:
        """The engine's memory now (`RolloutEngine.memory_stats`)."""
        return self.engine.memory_stats()

    def checksum_loads(self, enabled: bool) -> None:
        """Whether the next syncs are checksummed as they load (`RolloutEngine.checksum_loads`)."""
        self.engine.checksum_loads(enabled)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _take_pending(self) -> Future:
        if self._pending is None:
            raise RuntimeError("RolloutWorker: no weight-sync operation was started")
        pending, self._pending = self._pending, None
        return pending
