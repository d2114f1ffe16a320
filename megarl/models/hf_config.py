"""Read a HuggingFace `config.json` into the dimensions and features megarl's Megatron models support.

Pure: no torch, no megatron. The architecture registered for the config's `model_type`
(`megarl.models.arch`) reads it with this module's readers. Every unsupported value is a `ValueError` that names the config.json key,
its value and what megarl supports, raised before any model or process group exists.

    dims = read_model_dims("/ckpt/Qwen2.5-0.5B")      # dir, config.json path, dict or PretrainedConfig
    dims.num_kv_heads, dims.head_dim, dims.qkv_bias
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.models.arch import architecture, supported_model_types

# megatron-core's llama3 RoPE scaling takes only the factor; the other three are fixed in
# RotaryEmbedding._apply_scaling. Llama 3.1/3.2/3.3 configs use exactly these values.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling that megatron-core implements."""

    kind: str
    """"llama3" (megatron `rope_scaling=True`) or "linear" (megatron `seq_len_interpolation_factor`)."""
    factor: float
    """The HF `factor`."""


@dataclass(frozen=True)
class ModelDims:
    """Shapes and features of a decoder-only HF checkpoint (Llama / Qwen2 / Qwen3 dense, Qwen3-MoE)."""

    model_type: str
    """HF `model_type`, one registered in `megarl.models.arch` (the architecture that read it)."""
    vocab_size: int
    """HF vocabulary rows (`vocab_size`), before Megatron pads it."""
    hidden_size: int
    """Residual stream width."""
    ffn_hidden_size: int
    """MLP intermediate size (`intermediate_size`); gate and up each have this many rows."""
    num_layers: int
    """Transformer layers (`num_hidden_layers`)."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads = Megatron `num_query_groups` (GQA groups)."""
    head_dim: int
    """Per-head width = Megatron `kv_channels`; Qwen3 may have head_dim * heads != hidden_size."""
    qkv_bias: bool
    """q/k/v projections have biases (Qwen2), o_proj and the MLP never do."""
    qk_layernorm: bool
    """Per-head RMSNorm of q and k before RoPE (Qwen3 `q_norm` / `k_norm`)."""
    tie_word_embeddings: bool
    """The LM head is the input embedding (no `lm_head.weight` in the checkpoint)."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base."""
    rope_scaling: RopeScaling | None
    """RoPE scaling, None when the config has none (or "default")."""
    max_position_embeddings: int
    """Longest sequence the model was configured for."""
    initializer_range: float
    """Std of the normal init (used for parameters that a checkpoint does not provide)."""
    attention_dropout: float
    """Attention-probability dropout (0 for all released Llama/Qwen models)."""
    num_experts: int = 0
    """Routed experts per MoE layer (`num_experts`); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k); 0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    """One expert's intermediate size (`moe_intermediate_size`); 0 for a dense model."""
    norm_topk_prob: bool = False
    """The top-k routing weights are renormalised to sum to 1 (Qwen3-MoE `norm_topk_prob`)."""
    router_aux_loss_coef: float = 0.0
    """Load-balancing auxiliary loss coefficient (`router_aux_loss_coef`); 0 for a dense model."""

    @property
    def heads_per_group(self) -> int:
        """Query heads per KV group."""
        return self.num_attention_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        """Rows of q_proj (= columns of o_proj)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj and of v_proj."""
        return self.num_kv_heads * self.head_dim


def load_hf_config(source: str | Path | Mapping[str, Any] | Any) -> dict[str, Any]:
    """config.json as a dict from a checkpoint dir, a config.json path, a dict or a PretrainedConfig."""
    if isinstance(source, Mapping):
        return dict(source)
    if hasattr(source, "to_dict"):
        return dict(source.to_dict())
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    elif path.is_file() and path.suffix != ".json":  # a .safetensors or a data file where the directory belongs
        raise ValueError(f"{path} is a file, not a checkpoint directory: pass the directory that holds config.json")
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path} (expected a checkpoint dir holding config.json)")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: not valid UTF-8 JSON ({error}): restore the model's original config.json") from None
    if not isinstance(content, dict):
        raise ValueError(
            f"{path}: a JSON {type(content).__name__} where an object of settings belongs: "
            "restore the model's original config.json"
        )
    return content


def read_model_dims(source: str | Path | Mapping[str, Any] | Any) -> ModelDims:
    """Validate an HF config for megarl and return its `ModelDims` (ValueError naming the key if not):
    the registered architecture of its `model_type` (`megarl.models.arch`) reads it."""
    cfg = load_hf_config(source)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError(
            "config.json: required key 'model_type' is missing (megarl builds "
            f"{list(supported_model_types())}): restore the model's original config.json"
        )
    if model_type not in supported_model_types():
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; megarl builds {list(supported_model_types())}"
        )
    dims: ModelDims = architecture(model_type).read_dims(cfg)  # Any there: arch cannot import this module back
    return dims


def check_parallel_layout(
    dims: ModelDims,
    *,
    tp_size: int,
    pp_size: int,
    vpp_size: int = 1,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> None:
    """Reject a (TP, PP, VPP, EP, expert TP) layout the model cannot be cut into, before any process
    group exists; `etp_size` None is TP (megatron's default)."""
    etp_size = tp_size if etp_size is None else etp_size
    problems = []
    if ep_size > 1 and not dims.num_experts:
        problems.append(
            f"expert parallel size {ep_size} for a dense model (model_type={dims.model_type!r} has no "
            "experts): set expert_model_parallel_size to 1"
        )
    elif dims.num_experts % ep_size:
        problems.append(
            f"expert parallel size {ep_size} does not divide num_experts={dims.num_experts}: "
            "use an EP size that divides it"
        )
    if dims.num_kv_heads % tp_size:
        problems.append(
            f"tensor parallel size {tp_size} does not divide num_key_value_heads={dims.num_kv_heads} "
            "(Megatron gives each TP rank whole KV groups): use a TP size that divides it"
        )
    if dims.num_attention_heads % tp_size:
        problems.append(
            f"tensor parallel size {tp_size} does not divide num_attention_heads={dims.num_attention_heads}"
        )
    if dims.ffn_hidden_size % tp_size:
        problems.append(f"tensor parallel size {tp_size} does not divide intermediate_size={dims.ffn_hidden_size}")
    if dims.moe_ffn_hidden_size % etp_size:
        problems.append(
            f"expert tensor parallel size {etp_size} does not divide moe_intermediate_size={dims.moe_ffn_hidden_size}"
        )
    if etp_size != tp_size and not dims.num_experts:
        problems.append(
            f"expert tensor parallel size {etp_size} for a dense model (model_type={dims.model_type!r} "
            "has no experts): leave expert_tensor_parallel_size unset"
        )
    if dims.num_layers % pp_size:
        problems.append(
            f"pipeline parallel size {pp_size} does not divide num_hidden_layers={dims.num_layers}: "
            "use a PP size that divides it"
        )
    elif dims.num_layers % (pp_size * vpp_size):
        problems.append(
            f"pipeline parallel size {pp_size} × virtual pipeline size {vpp_size} does not divide "
            f"num_hidden_layers={dims.num_layers}: use sizes whose product divides it"
        )
    if problems:
        raise ValueError("; ".join(problems))


_REQUIRED = object()
"""`default` of a key that config.json must hold."""


def _value(cfg: Mapping[str, Any], key: str, default: Any, name: str) -> Any:
    """cfg[key] (null counts as absent), or `default`; ValueError naming `name` when required and absent."""
    value = cfg.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise ValueError(f"config.json: required key {name!r} is missing: restore the model's original config.json")
    return default


def read_positive_int(cfg: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """cfg[key] as a positive int (`default` when absent; required without one), else ValueError naming it."""
    value = _value(cfg, key, default, key)
    # bool is an int to Python, never to a model's shape.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"config.json: {key}={value!r} must be a positive integer: restore the model's original config.json"
        )
    return value


def read_number(cfg: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, name: str | None = None) -> float:
    """cfg[key] as a finite float (`default` when absent; required without one), else ValueError naming
    `name` (default: key)."""
    return _finite(_value(cfg, key, default, name or key), name or key)


def _finite(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(
            f"config.json: {name}={value!r} must be a finite number: restore the model's original config.json"
        )
    return float(value)


def read_rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either layout: transformers >= 5 writes `rope_parameters`
    ({rope_type, rope_theta, factor, ...}); older configs have `rope_theta` and `rope_scaling`."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, Mapping):
        raise ValueError(
            f'config.json: {key}={params!r} must be an object such as {{"rope_type": "linear", "factor": 2.0}}, or null'
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: RoPE base is missing (neither rope_theta nor rope_parameters.rope_theta)")
    theta = _finite(theta, "rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ValueError(
            f"config.json: {key} rope_type={kind!r} is not supported; megarl supports 'default', 'linear' and 'llama3'"
        )
    factor = read_number(params, "factor", name=f"{key}.factor")
    if kind == "llama3":
        fixed = {k: read_number(params, k, name=f"{key}.{k}") for k in _MEGATRON_LLAMA3_ROPE}
        if fixed != _MEGATRON_LLAMA3_ROPE:
            raise ValueError(
                f"config.json: {key} llama3 with {fixed} is not supported; megatron-core implements only "
                f"{_MEGATRON_LLAMA3_ROPE} (any factor)"
            )
    return theta, RopeScaling(kind, factor)
