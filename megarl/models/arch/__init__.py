"""The architecture registry: one module per HF `model_type` in this package, found on first use.

An architecture module defines `ARCHITECTURE`, an `Architecture` whose `model_type` is the HF
config.json's. Everything that differs between architectures lives there: how config.json becomes
`ModelDims`, the TransformerConfig fields and layer-spec options, the HF ⇄ Megatron tensor table, the HF
tensors a checkpoint holds, parameter and FLOP counts, and the tiny config of `init-tiny-model`.
The loader, exporter, weight-sync planner, memory estimate and tiny-model maker ask the registry
and hold no per-architecture branch; parallel settings (TP/PP/...) are never an architecture's:
the generic model builder (`megarl.models.architectures`) owns them. `docs/adding_a_model.md`
says how to add one.

    arch = architecture("qwen3")
    arch.layer_params(dims)          # [LayerParam("input_layernorm.weight", ("input_layernorm.weight",), "replicated"), ...]
    supported_model_types()          # ("llama", "qwen2", "qwen3")

An architecture module imports megatron and transformers only inside the methods that build with
them, so the config checks (`megarl validate`) do not load them.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

# How a Megatron parameter is laid out over TP ranks (`megarl.models.layout` slices and merges each kind).
REPLICATED = "replicated"
"""Full copy on every TP rank (norms)."""
ROW = "row"
"""Row-parallel linear: split along columns (dim 1)."""
QKV = "qkv"
"""Fused q/k/v, interleaved by KV group, groups split across TP ranks."""
GATE_UP = "gate_up"
"""Fused gate/up, each TP shard [gate_r; up_r]."""
VOCAB = "vocab"
"""Split along padded vocabulary rows."""


@dataclass(frozen=True)
class LayerParam:
    """One Megatron parameter of a decoder layer and the HF tensors it is made of."""

    megatron: str
    """Its name after `decoder.layers.{i}.`, local-spec naming (e.g. `self_attention.linear_qkv.weight`)."""
    hf: tuple[str, ...]
    """The HF tensors' names after `model.layers.{i}.`, in order (q, k, v for qkv; gate, up for gate_up)."""
    kind: str
    """Its TP layout: REPLICATED, ROW, QKV or GATE_UP."""


class Architecture:
    """What one HF `model_type` declares; megarl's generic code calls only these. `dims` is the
    `megarl.models.hf_config.ModelDims` that `read_dims` returned."""

    model_type: str
    """The HF config.json `model_type` it is registered under."""

    def read_dims(self, cfg: dict[str, Any]) -> Any:
        """config.json (a dict whose `model_type` is this one's) → `ModelDims`; a ValueError naming
        the key, its value and what is supported for anything the Megatron model would get wrong."""
        raise NotImplementedError

    def transformer_fields(self, dims) -> dict[str, Any]:
        """The architectural `TransformerConfig` fields (sizes, norm, activation, biases); never the
        parallel sizes, precision or `transformer_impl`, which the generic builder sets."""
        raise NotImplementedError

    def layer_spec_options(self, dims, transformer_impl: str) -> dict[str, Any]:
        """Keyword arguments of megatron-core's GPT layer-spec function for "local" (CPU,
        `get_gpt_layer_local_spec`) or "transformer_engine" (`get_gpt_layer_with_transformer_engine_spec`),
        which the generic builder calls."""
        raise NotImplementedError

    def layer_params(self, dims) -> tuple[LayerParam, ...]:
        """Every parameter of one decoder layer of the local-spec `GPTModel`, in model order (the
        weight sync sends them in this order)."""
        raise NotImplementedError

    def hf_layer_shapes(self, dims) -> dict[str, tuple[int, ...]]:
        """Every tensor of one HF decoder layer (names after `model.layers.{i}.`) with its shape,
        in the checkpoint's order; `layer_params` must cover exactly these."""
        raise NotImplementedError

    def layer_parameters(self, dims, tp: int) -> int:
        """Parameters of one decoder layer on one TP rank (the memory estimate's count)."""
        raise NotImplementedError

    def forward_flops_per_token(self, dims, sequence_length: int) -> int:
        """Matmul FLOPs of one token's forward pass in a sequence of `sequence_length` tokens."""
        raise NotImplementedError

    def tiny_config(self, fields: dict[str, Any]) -> Any:
        """The transformers `PretrainedConfig` of a tiny random model from `megarl.models.tiny`'s
        fields (sizes, token ids, `rope_parameters`); ValueError when the fields do not fit."""
        raise NotImplementedError


def architecture(model_type: str) -> Architecture:
    """The registered architecture of an HF `model_type`; ValueError naming it and the supported ones."""
    registry = _registry()
    if model_type not in registry:
        raise ValueError(f"model_type={model_type!r} is not supported; megarl builds {list(registry)}")
    return registry[model_type]


def supported_model_types() -> tuple[str, ...]:
    """Every registered `model_type`, sorted."""
    return tuple(_registry())


@functools.cache
def _registry() -> dict[str, Architecture]:
    """`model_type` → `ARCHITECTURE` of every module of this package that defines one."""
    found: dict[str, Architecture] = {}
    for module_info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        arch = getattr(module, "ARCHITECTURE", None)
        if arch is None:  # shared code of a family (e.g. `dense`)
            continue
        if arch.model_type in found:
            raise ValueError(f"{module.__name__}: model_type={arch.model_type!r} is registered twice")
        found[arch.model_type] = arch
    return dict(sorted(found.items()))
