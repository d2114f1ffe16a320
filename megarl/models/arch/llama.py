"""Llama (2, 3, 3.1, 3.2, 3.3): the dense decoder without q/k/v biases or q/k norms."""

from megarl.models.arch.dense import DenseDecoder


def _tiny_fields(fields: dict) -> dict:
    # LlamaConfig's attention_bias / mlp_bias put biases on o_proj and the MLP, which megarl rejects.
    return {**fields, "attention_bias": False, "mlp_bias": False}


ARCHITECTURE = DenseDecoder(
    "llama", qkv_bias=False, qk_layernorm=False, hf_config_class="LlamaConfig", tiny_fields=_tiny_fields
)
