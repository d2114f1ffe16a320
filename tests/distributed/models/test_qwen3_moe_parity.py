"""Qwen3-MoE through real megatron-core ranks: logits equal transformers' Qwen3MoeForCausalLM and
HF → Megatron → HF is bit-exact (tiny model: 8 experts, top-2, renormalised)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

BATCH, SEQ = 2, 12
TOLERANCE = 1e-4


def _tokens() -> torch.Tensor:
    """[B, T] ids over the whole real vocabulary (0..99), the same in every process."""
    return torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE with sharp norms and a router whose logits are far apart, so that a mix-up of
    experts, gate/up or the renormalisation moves the logits well past the tolerance."""
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("moe") / "qwen3_moe",
        "qwen3_moe",
        seed=3,
        initializer_range=0.1,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.3 * torch.randn(t.shape, generator=gen)
        elif name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(t.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def _load_forward_export(hf_dir: str, out_dir: str, tp: int, ep: int) -> torch.Tensor:
    """Per rank: build, load the HF weights (its experts only), forward (TP-gathered logits), export."""
    import torch.distributed as dist

    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights, load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, 1, seed=0, ep=ep)
    with torch.no_grad():
        model = build_gpt_model(hf_dir, groups).eval()
        load_hf_weights(model, hf_dir, groups)
        tokens = _tokens()
        local_experts = {n.split(".")[6] for n, _ in model.named_parameters() if ".local_experts." in n}
        assert len(local_experts) == 8 // ep, "each EP rank holds only its experts"
        logits = model(tokens, torch.arange(SEQ).expand_as(tokens), attention_mask=None)
        export_hf_weights(model, out_dir, groups, hf_assets_dir=hf_dir)
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[f"tp{tp}-ep{ep}" for tp, ep in LAYOUTS])
def test_logits_match_hf_and_round_trip_is_bit_exact(moe_model, tmp_path, tp, ep):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf_logits = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()(_tokens()).logits
    out_dir = tmp_path / "export"
    per_rank = run_distributed(_load_forward_export, tp * ep, str(moe_model), str(out_dir), tp, ep, timeout_s=300)

    vocab = hf_logits.shape[-1]
    for rank, logits in enumerate(per_rank):  # every EP rank ran the same tokens through all experts
        diff = (logits[..., :vocab] - hf_logits).abs().max().item()
        assert diff <= TOLERANCE, f"TP={tp} EP={ep} rank {rank}: max |megatron - HF| logits = {diff}"
    exported, original = load_file(out_dir / "model.safetensors"), load_file(moe_model / "model.safetensors")
    assert exported.keys() == original.keys(), "exported tensor names differ"
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), f"TP={tp} EP={ep}: {name} changed in the round trip"
