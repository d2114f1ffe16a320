"""Run megatron-core 0.16.1 on CPU (gloo) when no CUDA device exists.

megatron-core assumes CUDA in a handful of places. Each redirection below names the megatron code it
addresses; together they are what `GPTModel` (local spec), the pipeline schedules, Megatron DDP, the
fp32 and mixed-precision (bf16 parameters, fp32 main parameters) optimizers, distributed or not, grad
clipping, activation recompute and sequence parallelism need on CPU. `install()` does nothing
when CUDA is available, so the GPU path is untouched megatron-core.

Mechanism: instead of a global `TorchFunctionMode` (a Python call on every torch op, forward pass
included), the listed megatron modules get their own view of the `torch` module, identical except for
factory functions that map `device='cuda'` to CPU and a `torch.cuda` whose device, synchronize and RNG
calls act on the CPU. Nothing outside those modules sees a difference.
"""

import contextlib
import copy
import functools
import sys
import types
from importlib import import_module

import torch

from megarl.parallel.device import uses_cuda

# Modules that create tensors on `torch.cuda.current_device()` or `device='cuda'`, call
# `torch.cuda.synchronize()`, or use the CUDA RNG. Each gets the CPU view of `torch`.
_REDIRECTED_MODULES = {
    # GlobalMemoryBuffer.get_tensor allocates on the current CUDA device.
    "megatron.core.utils": "GlobalMemoryBuffer",
    # CudaRNGStatesTracker and model_parallel_cuda_manual_seed use the CUDA generator; attention
    # forks the tracker even with dropout 0. On CPU the tracked stream is the CPU generator.
    "megatron.core.tensor_parallel.random": "RNG tracker, checkpoint (recompute) RNG save/restore",
    # _ParamAndGradBuffer allocates param/grad buffers on the current CUDA device.
    "megatron.core.distributed.param_and_grad_buffer": "DDP param/grad buffers",
    "megatron.core.distributed.distributed_data_parallel": "DDP synchronize on offload",
    # FP32Optimizer._scale, found_inf, dummy overflow buffers: literal device='cuda'.
    "megatron.core.optimizer.optimizer": "optimizer scalars",
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer buffers",
    "megatron.core.optimizer.clip_grads": "grad-norm and overflow scalars",
    "megatron.core.optimizer.grad_scaler": "loss-scale scalars",
    # total_num_tokens = torch.zeros([], device="cuda") in the forward-backward schedules.
    "megatron.core.pipeline_parallel.schedules": "token-count scalars",
    # Shape tensors on the current device and torch.cuda.synchronize() around p2p ops.
    "megatron.core.pipeline_parallel.p2p_communication": "p2p shape buffers, synchronize",
    # All-gather / reduce-scatter buffers (sequence parallel) on the current device.
    "megatron.core.tensor_parallel.layers": "sequence-parallel gather buffers",
    "megatron.core.tensor_parallel.mappings": "gather/scatter buffers",
    "megatron.core.transformer.attention": "inference KV buffers",
    # Causal masks built with device="cuda" (local-spec attention with attn_mask_type causal).
    "megatron.core.transformer.utils": "causal masks",
    "megatron.core.transformer.dot_product_attention": "mask buffers",
    "megatron.core.transformer.transformer_layer": "offload buffers",
    # RoPE moves inv_freq to the current device on first use.
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE frequencies",
    "megatron.core.models.gpt.gpt_model": "MTP / inference buffers",
    "megatron.core.tensor_parallel.data": "broadcast_data buffers",
    "megatron.core.tensor_parallel.utils": "split/gather buffers",
    "megatron.core.transformer.module": "Float16Module buffers",
    "megatron.core.parallel_state": "barriers and synchronize",
    # Distributed checkpointing (torch_dist format): synchronize before writes, verification and
    # exchange buffers on the current device.
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "synchronize",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize before preload",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "verification scalars",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "synchronize",
    "megatron.core.dist_checkpointing.strategies.async_utils": "liveness scalars, synchronize",
    "megatron.core.dist_checkpointing.exchange_utils": "exchange buffers",
    # HybridDeviceOptimizer (optimizer CPU offload): copies on side streams, waits on their events,
    # pinned host buffers.
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer": "copy streams and events, pinned buffers",
    # MoEAlltoAllTokenDispatcher copies its split sizes to the host on a side stream and waits on its event.
    "megatron.core.transformer.moe.token_dispatcher": "the alltoall dispatcher's device-to-host stream",
    # The router moves its weight to the current device on first use; aux-loss scalars on it.
    "megatron.core.transformer.moe.router": "router weight, aux-loss scalars",
    "megatron.core.transformer.moe.experts": "expert buffers",
    # The per-layer MoE metric tracker's values are created with device="cuda".
    "megatron.core.transformer.moe.moe_utils": "MoE metric tracker values",
}
_HYBRID_OPTIMIZER = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
)
_CPU = torch.device("cpu")
_installed = False


def install() -> None:
    """Apply every redirection once per process; a no-op when CUDA is available."""
    global _installed
    if _installed or uses_cuda():
        return
    cpu_torch = _cpu_view_of_torch()
    for name in _REDIRECTED_MODULES:
        import_module(name).torch = cpu_torch
    _redirect_cuda_rng_state_helpers()
    _report_cuda_tensor_types_to_megatron()
    _mark_torch_norms_sequence_parallel()
    _host_memory_as_the_device_of_the_hybrid_optimizer()
    _no_transformer_engine_is_no_minimum_version()
    _router_gemm_without_transformer_engine()
    _dispatcher_split_sizes_as_host_arrays()
    _uneven_all_gather_in_mappings()
    _installed = True


def is_active() -> bool:
    """True once `install()` has redirected megatron-core to the CPU."""
    return _installed


def _on_cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return _CPU
    return device


def _factory_on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        # Pinned memory needs an accelerator's allocator; without one host memory is all there is.
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


def _cpu_view_of_cuda() -> types.ModuleType:
    cuda = types.ModuleType("torch.cuda")
    cuda.__dict__.update(torch.cuda.__dict__)
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # The tracked "CUDA" RNG streams are kept on the CPU generator.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = torch.manual_seed
    # One host "stream": work is done when the call returns, so waits and events have nothing to wait for.
    cuda.Stream = _HostStream
    cuda.current_stream = lambda device=None: _HOST_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    return cuda


def _cpu_view_of_torch() -> types.ModuleType:
    view = types.ModuleType("torch")
    view.__dict__.update(torch.__dict__)
    for name in _FACTORIES:
        setattr(view, name, _factory_on_cpu(getattr(torch, name)))
    view.cuda = _cpu_view_of_cuda()
    return view


def _redirect_cuda_rng_state_helpers() -> None:
    """tensor_parallel.random._get/_set_cuda_rng_state index torch.cuda.default_generators."""
    random = import_module("megatron.core.tensor_parallel.random")

    def get_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random._get_cuda_rng_state = get_state
    random._set_cuda_rng_state = set_state


def _report_cuda_tensor_types_to_megatron() -> None:
    """optimizer.py, distrib_optimizer.py and clip_grads.py accept only `Tensor.type()` strings of
    CUDA tensors ('torch.cuda.FloatTensor'; for bf16 parameters 'torch.cuda.BFloat16Tensor', which is
    how Float16OptimizerWithFloat16Params and DistributedOptimizer pick the parameters that get fp32
    main copies) and call `.cuda()` on state tensors. For callers inside
    megatron-core only, CPU tensors report their CUDA type name and `.cuda()` keeps them in place."""
    original_type = torch.Tensor.type
    original_cuda = torch.Tensor.cuda

    def called_from_megatron() -> bool:
        return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.")

    def type_(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and called_from_megatron():
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    def cuda(self, *args, **kwargs):
        if called_from_megatron():
            return self
        return original_cuda(self, *args, **kwargs)

    torch.Tensor.type = type_
    torch.Tensor.cuda = cuda


def _mark_torch_norms_sequence_parallel() -> None:
    """The local spec's norm, megatron's `WrappedTorchNorm` (megatron/core/transformer/torch_norm.py, also
    `transformer_block.LayerNormImpl` without TE or apex), asserts `not config.sequence_parallel`: a plain
    torch norm does not mark its parameters `sequence_parallel`, the attribute by which
    `finalize_model_grads._allreduce_non_tensor_model_parallel_grads` sums their gradients over the TP
    ranks, each of which saw a slice of the sequence. The GPU norms (`TENorm`, `FusedLayerNorm`) set it
    themselves (`setattr(param, "sequence_parallel", config.sequence_parallel)`); on CPU, where the local
    spec is the only one, its norms get the same marking. (q/k norms get it too: their gradients are
    summed over TP anyway, by name, with or without it.)"""
    torch_norm = import_module("megatron.core.transformer.torch_norm")
    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *args, **kwargs):
        unsplit = copy.copy(config)  # a shallow copy: TransformerConfig's checks do not run again
        unsplit.sequence_parallel = False
        norm = build(cls, unsplit, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


class _HostEvent:
    """`torch.cuda.Event` of a host "stream": recorded work is already done."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """`torch.cuda.Stream` on the host: operations run when called, in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_memory_as_the_device_of_the_hybrid_optimizer() -> None:
    """megatron's `HybridDeviceOptimizer` (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py)
    splits its parameters by `is_cuda`: device parameters up to `offload_fraction` of their elements get
    host copies (`.cpu().pin_memory()`, in fp32 `.detach().clone().float()`) that the CPU optimizer steps
    and that are copied back after the step; the rest, and fp32 copies of them, stay with the device
    optimizer. A parameter already in host memory belongs to neither (its grad and copy-back lookups,
    `cpu_copys_map_gpu_param[param]`, fail). On CPU host memory is the device: inside that module a CPU
    tensor reports `is_cuda` unless it is a host copy the module made (`.cpu()`; `.pin_memory()` returns the
    tensor itself, there being no pinned allocator without an accelerator) or a copy of one (`detach`,
    `clone`, `float`), so the split and the copies run as on a GPU, host to host.

    Those tensor methods are swapped in only while a HybridDeviceOptimizer method runs (construction,
    step, dummy step, state loading): nothing else in the process (a colocated vLLM engine compiling its
    model, say) ever sees them."""
    hybrid = import_module(_HYBRID_OPTIMIZER).HybridDeviceOptimizer
    methods = _tensor_methods_of_a_host_device()
    depth = [0]

    def with_methods(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            saved = {name: torch.Tensor.__dict__.get(name) for name in methods}
            if depth[0] == 0:
                for name, replacement in methods.items():
                    setattr(torch.Tensor, name, replacement)
            depth[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    for name, original in saved.items():
                        if original is None:
                            delattr(torch.Tensor, name)
                        else:
                            setattr(torch.Tensor, name, original)

        return wrapper

    for name in ("__init__", "step", "dummy_step", "load_state_dict"):
        setattr(hybrid, name, with_methods(getattr(hybrid, name)))


def _tensor_methods_of_a_host_device() -> dict:
    """The `torch.Tensor` attributes `_host_memory_as_the_device_of_the_hybrid_optimizer` swaps in."""
    is_cuda, pin_memory, cpu = torch.Tensor.is_cuda, torch.Tensor.pin_memory, torch.Tensor.cpu

    def is_host_copy(tensor) -> bool:
        return getattr(tensor, "_megarl_host_copy", False)

    def called_from_hybrid_optimizer() -> bool:
        # Frames: this function, the patched method, its caller (torch's own optimizers see plain tensors).
        return sys._getframe(2).f_globals.get("__name__", "") == _HYBRID_OPTIMIZER

    def is_cuda_(self) -> bool:
        if is_cuda.__get__(self):
            return True
        return self.device.type == "cpu" and not is_host_copy(self) and called_from_hybrid_optimizer()

    def pin_memory_(self, *args, **kwargs):
        return self if called_from_hybrid_optimizer() else pin_memory(self, *args, **kwargs)

    def cpu_(self, *args, **kwargs):
        copy_ = cpu(self, *args, **kwargs)
        if called_from_hybrid_optimizer():
            copy_._megarl_host_copy = True
        return copy_

    def inherits_host(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            if is_host_copy(self):
                result._megarl_host_copy = True
            return result

        return wrapper

    # The fp32 copy of a host copy (`param.detach().clone().float()`) is a host copy too.
    inheriting = {name: inherits_host(getattr(torch.Tensor, name)) for name in ("detach", "clone", "float")}
    return dict(is_cuda=property(is_cuda_), pin_memory=pin_memory_, cpu=cpu_, **inheriting)


def _no_transformer_engine_is_no_minimum_version() -> None:
    """`OptimizerConfig.__post_init__` (megatron/core/optimizer/optimizer_config.py) asks
    `is_te_min_version("2.1.0")` for the precision-aware optimizer, the path optimizer CPU offload runs
    through; without Transformer Engine (CUDA-only) `get_te_version()` is None and the comparison raises
    TypeError. No Transformer Engine is none of any version."""
    import_module("megatron.core.optimizer.optimizer_config").is_te_min_version = lambda version, check_equality=True: (
        False
    )


def _router_gemm_without_transformer_engine() -> None:
    """`RouterGatingLinearFunction` (megatron/core/transformer/moe/moe_utils.py, the fp32 router of
    `moe_router_dtype`) tests `te_general_gemm is not None`, but the module's `except ImportError`
    (no Transformer Engine) never defines the name, so the test raises NameError. None is what the test
    means: the plain `torch.mm` in the router dtype."""
    moe_utils = import_module("megatron.core.transformer.moe.moe_utils")
    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None


def _dispatcher_split_sizes_as_host_arrays() -> None:
    """`MoEAlltoAllTokenDispatcher` hands its split sizes to `all_to_all_single` after
    `maybe_move_tensor_to_cpu(..., as_numpy=True)` (megatron/core/transformer/moe/moe_utils.py), which
    makes the numpy array only for a CUDA tensor: on the CPU the sizes stay a torch tensor, which
    the collective's binding refuses. On the CPU the move is nothing, and `as_numpy` still means numpy."""
    dispatcher = import_module("megatron.core.transformer.moe.token_dispatcher")

    def on_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    dispatcher.maybe_move_tensor_to_cpu = on_host


def _uneven_all_gather_in_mappings() -> None:
    """With expert TP > 1 and sequence parallelism the alltoall dispatcher gathers each expert-TP rank's
    tokens, whose counts differ, by `_gather_along_first_dim(..., output_split_sizes)`
    (megatron/core/tensor_parallel/mappings.py: `torch.distributed.all_gather` into the output's unequal
    splits; also the backward of the combine's reduce-scatter). NCCL takes unequal tensors
    (`ProcessGroupNCCL::allgather` broadcasts each rank's, coalesced); gloo refuses them ("invalid tensor
    size"). In that module, on the CPU, unequal tensors are gathered flat, padded to the largest, and each
    rank's cut back to its size: the contract kept, `tensor_list[i]` gets rank i's `tensor`."""
    mappings = import_module("megatron.core.tensor_parallel.mappings")
    distributed = types.ModuleType("torch.distributed")
    distributed.__dict__.update(torch.distributed.__dict__)
    distributed.all_gather = all_gather_uneven
    view = types.ModuleType("torch")
    view.__dict__.update(mappings.torch.__dict__)
    view.distributed = distributed
    mappings.torch = view


def all_gather_uneven(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """`torch.distributed.all_gather` (synchronous) for tensors of any sizes: `tensor_list[i]` receives rank
    i's `tensor`, every rank passing the same sizes. Equal sizes are one plain all-gather."""
    if len({t.shape for t in tensor_list}) == 1:
        torch.distributed.all_gather(tensor_list, tensor, group=group)
        return
    longest = max(t.numel() for t in tensor_list)
    padded = tensor.new_zeros(longest)
    padded[: tensor.numel()] = tensor.reshape(-1)
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    torch.distributed.all_gather(gathered, padded, group=group)
    for out, flat in zip(tensor_list, gathered, strict=True):
        out.copy_(flat[: out.numel()].view(out.shape))
