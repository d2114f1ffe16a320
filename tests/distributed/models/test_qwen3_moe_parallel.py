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


def _load_forward_export(hf_dir: str, out_dir: str, tp: int, pp: int, ep: int, etp: int) -> torch.Tensor | None:
    """Per rank: build, load the HF weights (its experts only), forward (last stage: TP-gathered
    logits; PP > 1 runs the stages in turn over point-to-point sends), export."""
    import torch.distributed as dist

    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights, load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, seed=0, ep=ep, etp=etp)
    with torch.no_grad():
        model = build_gpt_model(hf_dir, groups).eval()
        load_hf_weights(model, hf_dir, groups)
        experts = {n.split(".")[6]: p for n, p in model.named_parameters() if ".local_experts." in n}
        assert len(experts) == 8 // ep, "each EP rank holds only its experts"
        fc2 = next(p for n, p in model.named_parameters() if n.endswith("local_experts.0.linear_fc2.weight"))
        assert fc2.shape[1] == 128 // etp, "each expert is cut over the expert-TP ranks"
        tokens = _tokens()
        hidden = torch.empty(SEQ, BATCH, 128)
        if not groups.is_first_stage:
            dist.recv(hidden, src=dist.get_global_rank(groups.pp, groups.pp_rank - 1), group=groups.pp)
            model.set_input_tensor(hidden)
        output = model(tokens, torch.arange(SEQ).expand_as(tokens), attention_mask=None)
        if not groups.is_last_stage:
            dist.send(output.contiguous(), dst=dist.get_global_rank(groups.pp, groups.pp_rank + 1), group=groups.pp)
        export_hf_weights(model, out_dir, groups, hf_assets_dir=hf_dir)
    if not groups.is_last_stage:
        return None
    parts = [torch.empty_like(output) for _ in range(tp)]
    dist.all_gather(parts, output.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


# (TP, PP, EP, expert TP); world = TP × PP × EP. TP2 EP2 ETP1: experts whole on each rank while the
# dense layers are cut in two, and two expert-DP replicas (the second returns from the export at once).
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 1, 2, 1), (2, 1, 2, 2), (2, 1, 2, 1), (2, 2, 2, 2)]


@pytest.mark.parametrize("tp,pp,ep,etp", LAYOUTS, ids=[f"tp{tp}-pp{pp}-ep{ep}-etp{etp}" for tp, pp, ep, etp in LAYOUTS])
def test_logits_match_hf_and_round_trip_is_bit_exact(moe_model, tmp_path, tp, pp, ep, etp):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf_logits = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()(_tokens()).logits
    out_dir = tmp_path / "export"
    per_rank = run_distributed(
        _load_forward_export, tp * pp * ep, str(moe_model), str(out_dir), tp, pp, ep, etp, timeout_s=600
    )

    vocab = hf_logits.shape[-1]
    last_stage = [logits for logits in per_rank if logits is not None]
    assert len(last_stage) == tp * ep
    for rank, logits in enumerate(last_stage):  # every EP rank ran the same tokens through all experts
        diff = (logits[..., :vocab] - hf_logits).abs().max().item()
        assert diff <= TOLERANCE, f"{_name(tp, pp, ep, etp)} rank {rank}: max |megatron - HF| logits = {diff}"
    exported, original = _read_export(out_dir), load_file(moe_model / "model.safetensors")
    assert exported.keys() == original.keys(), "exported tensor names differ"
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), f"{_name(tp, pp, ep, etp)}: {name} changed in the round trip"


def _name(tp: int, pp: int, ep: int, etp: int) -> str:
    return f"TP={tp} PP={pp} EP={ep} ETP={etp}"


def _read_export(out_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported checkpoint (one file, or one per PP stage)."""
    tensors = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors
