"""Read a HuggingFace `config.json` into the dimensions and features megarl's Megatron models support.

Pure: no torch, no megatron. Every unsupported value is a `ValueError` that names the config.json key,
its value and what megarl supports, raised before any model or process group exists.

    dims = read_model_dims("/ckpt/Qwen2.5-0.5B")      # dir, config.json path, dict or PretrainedConfig
    dims.num_kv_heads, dims.head_dim, dims.qkv_bias
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

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
    """Shapes and features of a dense decoder-only HF checkpoint (Llama / Qwen2 / Qwen3 family)."""

    model_type: str
    """HF `model_type`: "llama", "qwen2" or "qwen3"."""
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
        return source.to_dict()
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
        raise ValueError(f"{path}: a JSON {type(content).__name__} where an object of settings belongs: "
                         "restore the model's original config.json")
    return content


QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})
"""Model types whose q/k/v projections carry biases (an architecture fact, not a config.json key)."""
QK_LAYERNORM_MODEL_TYPES = frozenset({"qwen3"})
"""Model types with a per-head RMSNorm on q and k."""


def read_model_dims(source: str | Path | Mapping[str, Any] | Any) -> ModelDims:
    """Validate an HF config for megarl and return its `ModelDims` (ValueError naming the key if not)."""
    cfg = load_hf_config(source)
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ValueError("config.json: required key 'model_type' is missing (megarl builds "
                         f"{list(SUPPORTED_MODEL_TYPES)}): restore the model's original config.json")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; megarl builds {list(SUPPORTED_MODEL_TYPES)}"
        )
    _reject_unsupported_features(cfg)
    num_heads = _positive_int(cfg, "num_attention_heads")
    hidden = _positive_int(cfg, "hidden_size")
    # Older Llama configs omit num_key_value_heads (= MHA); Qwen2 has no head_dim key (= hidden / heads).
    num_kv_heads = _positive_int(cfg, "num_key_value_heads", default=num_heads)
    head_dim = _positive_int(cfg, "head_dim", default=hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    rope_theta, rope_scaling = _rope(cfg)
    return ModelDims(
        model_type=model_type,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        ffn_hidden_size=_positive_int(cfg, "intermediate_size"),
        num_layers=_positive_int(cfg, "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        qkv_bias=model_type in QKV_BIAS_MODEL_TYPES,
        qk_layernorm=model_type in QK_LAYERNORM_MODEL_TYPES,
        # Llama, Qwen2 and Qwen3 config classes all default to untied embeddings.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=_number(cfg, "rms_norm_eps"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings"),
        initializer_range=_number(cfg, "initializer_range", default=0.02),
        attention_dropout=_number(cfg, "attention_dropout", default=0.0),
    )


def check_parallel_layout(dims: ModelDims, *, tp_size: int, pp_size: int) -> None:
    """Reject a (TP, PP) layout the model cannot be cut into, before any process group exists."""
    problems = []
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
    if dims.num_layers % pp_size:
        problems.append(
            f"pipeline parallel size {pp_size} does not divide num_hidden_layers={dims.num_layers}: "
            "use a PP size that divides it"
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


def _positive_int(cfg: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> int:
    value = _value(cfg, key, default, key)
    # bool is an int to Python, never to a model's shape.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key}={value!r} must be a positive integer: restore the model's original "
                         "config.json")
    return value


def _number(cfg: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, name: str | None = None) -> float:
    return _finite(_value(cfg, key, default, name or key), name or key)


def _finite(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"config.json: {name}={value!r} must be a finite number: restore the model's original "
                         "config.json")
    return float(value)


def _reject_unsupported_features(cfg: Mapping[str, Any]) -> None:
    """Features the Megatron model would silently get wrong; each names its key."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (megarl supports 'silu', i.e. SwiGLU)")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (sliding-window attention is not supported; set it to false)")
    layer_types = cfg.get("layer_types") or []
    if not isinstance(layer_types, list):
        problems.append(f"layer_types={layer_types!r} (expected a list of 'full_attention')")
        layer_types = []
    non_full = sorted({str(t) for t in layer_types if t != "full_attention"})
    if non_full:
        problems.append(f"layer_types contains {non_full} (only 'full_attention' layers are supported)")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            problems.append(f"{key}={cfg[key]} (mixture-of-experts models are not supported yet)")
    if cfg.get("attention_bias"):
        # Llama/Qwen3 attention_bias puts a bias on o_proj too; Megatron's add_qkv_bias covers q/k/v only.
        problems.append(
            f"attention_bias=true for model_type={cfg['model_type']!r} (biases on q/k/v/o are not supported; "
            "only Qwen2's built-in q/k/v biases are)"
        )
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases are not supported)")
    rope_params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    for key, holder in (("partial_rotary_factor", cfg), ("rope_parameters.partial_rotary_factor", rope_params)):
        if holder.get("partial_rotary_factor", 1.0) != 1.0:
            # Megatron would rotate only part of each head; HF's Llama/Qwen attention rotates whole heads.
            problems.append(f"{key}={holder['partial_rotary_factor']} (RoPE over part of a head is not supported; "
                            "Llama and Qwen rotate whole heads)")
    if problems:
        raise ValueError("config.json: unsupported " + "; ".join(problems))


def _rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either layout: transformers >= 5 writes `rope_parameters`
    ({rope_type, rope_theta, factor, ...}); older configs have `rope_theta` and `rope_scaling`."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config.json: {key}={params!r} must be an object such as "
                         '{"rope_type": "linear", "factor": 2.0}, or null')
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
    factor = _number(params, "factor", name=f"{key}.factor")
    if kind == "llama3":
        fixed = {k: _number(params, k, name=f"{key}.{k}") for k in _MEGATRON_LLAMA3_ROPE}
        if fixed != _MEGATRON_LLAMA3_ROPE:
            raise ValueError(
                f"config.json: {key} llama3 with {fixed} is not supported; megatron-core implements only "
                f"{_MEGATRON_LLAMA3_ROPE} (any factor)"
            )
    return theta, RopeScaling(kind, factor)
