"""Qwen2 / Qwen2.5: the dense decoder with biases on q, k and v (and only there)."""

from megarl.models.arch.dense import DenseDecoder


def _tiny_fields(fields: dict) -> dict:
    """Qwen2 derives head_dim from hidden_size / num_attention_heads; it has no such field."""
    head_dim = fields.pop("head_dim")
    if head_dim * fields["num_attention_heads"] != fields["hidden_size"]:
        raise ValueError(
            f"make_tiny_model: qwen2 needs hidden_size == num_attention_heads * head_dim, got "
            f"{fields['hidden_size']} != {fields['num_attention_heads']} * {head_dim}"
        )
    return fields


ARCHITECTURE = DenseDecoder(
    "qwen2", qkv_bias=True, qk_layernorm=False, hf_config_class="Qwen2Config", tiny_fields=_tiny_fields
)
