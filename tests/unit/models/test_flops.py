"""megarl.models.flops: the model-FLOP formula MFU divides by, against a hand count and against torch's
own FLOP counter on a real forward + backward of an HF model."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from megarl.models.flops import forward_flops_per_token, training_flops
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model


def test_the_formula_equals_a_hand_count_of_the_matmuls_of_a_small_qwen2(tmp_path):
    """hidden 128, 2 layers, 4 heads × 32 (q 128), 2 KV heads (k, v 64 each), ffn 256, vocab 100, S = 10:
    per layer per token q/k/v 2·128·(128+64+64) = 65 536, o 2·128·128 = 32 768, scores and weighted sum
    2·2·128·10 = 5 120, MLP 2·3·128·256 = 196 608 (sum 300 032); two layers 600 064, LM head 2·128·100 =
    25 600: 625 664 per token forward; ×10 tokens ×3 (forward + backward) = 18 769 920."""
    dims = read_model_dims(make_tiny_model(tmp_path / "m", "qwen2"))
    assert (dims.hidden_size, dims.num_layers, dims.q_size, dims.kv_size, dims.ffn_hidden_size, dims.vocab_size) == (
        128,
        2,
        128,
        64,
        256,
        100,
    )
    assert forward_flops_per_token(dims, 10) == 625_664
    assert training_flops(dims, 10) == 18_769_920


def test_the_formula_equals_torchs_flop_counter_on_a_forward_and_backward_of_the_hf_model(tmp_path):
    """`FlopCounterMode` counts what the ops really multiply (mm, addmm, bmm) in the forward and the
    backward, independently of the formula. Both count matmuls only (norms, RoPE, softmax, SiLU and the
    loss are elementwise: neither counts them), so they agree exactly, to the FLOP. Eager attention,
    because the counter has no formula for CPU's fused SDPA kernel (with it the counter misses exactly
    the 4·q_size·S² per layer of the attention products, and nothing else differs). Qwen3 (q/k norms,
    head_dim·heads != hidden) and GQA check that the formula reads the right widths."""
    for arch, shape in (
        ("qwen2", {}),
        (
            "qwen3",
            dict(hidden_size=96, head_dim=32, num_attention_heads=4, num_key_value_heads=1, intermediate_size=160),
        ),
    ):
        model_dir = make_tiny_model(tmp_path / arch, arch, **shape)
        dims = read_model_dims(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        batch, length = 3, 17
        ids = torch.randint(0, dims.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        assert counter.get_total_flops() == batch * training_flops(dims, length), arch


def test_a_mixture_of_experts_counts_the_flops_of_the_experts_each_token_goes_through(tmp_path):
    """Qwen3-MoE (8 experts, top-2): the formula counts the router and the top-k experts of each token
    (active parameters, what MFU divides by), not all experts, and equals torch's FLOP counter on HF's
    eager experts, which run each expert on its routed tokens only (transformers' default grouped_mm
    experts are invisible to the counter)."""
    model_dir = make_tiny_model(tmp_path / "moe", "qwen3_moe")
    dims = read_model_dims(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", experts_implementation="eager")
    batch, length = 3, 17
    ids = torch.randint(0, dims.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert counter.get_total_flops() == batch * training_flops(dims, length)
