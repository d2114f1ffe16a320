"""Model FLOPs of a decoder: what MFU divides by the time taken. Each architecture counts its own
(`megarl.models.arch`, `forward_flops_per_token`); the dense family's (`megarl.models.arch.dense`)
is the count below.

Only matrix multiplications count, each `[m, k] @ [k, n]` as 2·m·k·n FLOPs, the convention of the PaLM
paper (Chowdhery et al. 2022, appendix B: "6N + 12·L·H·Q·T" per token) and of Megatron-LM's
`num_floating_point_operations` (Narayanan et al. 2021, arXiv 2104.04473, appendix). Per token of a
sequence of S tokens, per layer, forward:

    q, k, v projections   2·h·(q_size + 2·kv_size)          q_size = heads·head_dim, kv_size = kv_heads·head_dim
    scores q·kᵀ           2·q_size·S                         every head against all S keys (no causal halving,
    probabilities · v     2·q_size·S                         as PaLM and Megatron count it)
    output projection     2·q_size·h
    gated MLP (SwiGLU)    2·3·h·ffn                          gate, up and down
and once per token the LM head, 2·h·vocab (the embedding lookup is a gather: no FLOPs).

Training is 3× the forward: the backward computes, for every matmul, the gradient of its input and of
its weight, each as costly as the forward product. Left out, like PaLM and Megatron do: RMSNorm,
RoPE, softmax, SiLU, residual adds and the loss (O(h) per token each, under 1% here), biases, and the
recomputation of activation checkpointing (that would be hardware FLOPs, not model FLOPs).

    dims = read_model_dims(model_dir)
    training_flops(dims, sequence_length=112)     # one sample, forward + backward
"""

from __future__ import annotations

from megarl.models.arch import architecture
from megarl.models.hf_config import ModelDims


def forward_flops_per_token(dims: ModelDims, sequence_length: int) -> int:
    """Matmul FLOPs of one token's forward pass in a sequence of `sequence_length` tokens."""
    return architecture(dims.model_type).forward_flops_per_token(dims, sequence_length)


def training_flops(dims: ModelDims, sequence_length: int) -> int:
    """Matmul FLOPs of one forward and backward pass over a sample of `sequence_length` tokens."""
    return 3 * sequence_length * forward_flops_per_token(dims, sequence_length)
