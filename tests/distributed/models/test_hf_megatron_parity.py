"""HF → Megatron (TP, PP) → HF: logits equal transformers', the exported checkpoint is bit-exact.

One spawned world per (TP, PP) layout checks all three architectures (spawns are the cost here).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.parallel.spawn import run_distributed

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
BATCH, SEQ = 2, 12
TOLERANCE = 1e-4


def _tokens() -> torch.Tensor:
    """[B, T] ids over the whole real vocabulary (0..99), the same in every process."""
    return torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))


def _pipeline_forward(model, groups, tokens: torch.Tensor):
    """Forward through megatron's pipeline schedule; the last stage's output gathered over TP on
    TP rank 0 ([B, T, V_padded] or [B, T, TP] for a value head), None on other ranks."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def forward_step(data_iterator, stage):
        output = stage(next(data_iterator), positions, attention_mask=None)
        return output, lambda output_tensor, non_loss_data=False: output_tensor

    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[model],
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
        collect_non_loss_data=True,
    )
    if not groups.is_last_stage:
        return None
    parts = [torch.empty_like(store[0]) for _ in range(groups.tp_size)]
    dist.all_gather(parts, store[0].contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1) if groups.tp_rank == 0 else None


def _check_layout(model_dirs: dict, out_root: str, tp: int, pp: int) -> dict:
    """Per rank: for each arch load HF weights, run the forward, export; plus a critic on qwen2."""
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import export_hf_weights, load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, seed=0)
    results = {}
    with torch.no_grad():
        for arch, hf_dir in model_dirs.items():
            model = build_gpt_model(hf_dir, groups).eval()
            load_hf_weights(model, hf_dir, groups)
            logits = _pipeline_forward(model, groups, _tokens())
            export_hf_weights(model, Path(out_root) / arch, groups, hf_assets_dir=hf_dir)
            results[arch] = logits
        critic = build_gpt_model(model_dirs["qwen2"], groups, value_head=True).eval()
        load_hf_weights(critic, model_dirs["qwen2"], groups)
        results["critic"] = _pipeline_forward(critic, groups, _tokens())
    return results


def _hf_logits(model_dir) -> torch.Tensor:
    # Imported here, not at module level: every spawned rank imports this module to find its function.
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(_tokens()).logits


@pytest.fixture(scope="module")
def hf_logits(tiny_models) -> dict:
    return {arch: _hf_logits(d) for arch, d in tiny_models.items()}


def _load_all(model_dir: Path) -> dict:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{tp}-pp{pp}" for tp, pp in LAYOUTS])
def test_logits_match_hf_and_export_is_bit_exact(tiny_models, hf_logits, tmp_path, tp, pp):
    per_rank = run_distributed(
        _check_layout, tp * pp, {a: str(d) for a, d in tiny_models.items()}, str(tmp_path), tp, pp, timeout_s=240
    )
    reporting = [r for r in per_rank if r["llama"] is not None]
    assert len(reporting) == 1, "exactly one rank (last stage, TP rank 0) returns the gathered logits"
    results = reporting[0]

    for arch, hf_dir in tiny_models.items():
        vocab = hf_logits[arch].shape[-1]
        logits = results[arch]
        assert logits.shape[-1] >= vocab and logits.shape[-1] % (128 * tp) == 0, "vocab padded to 128 * TP"
        diff = (logits[..., :vocab] - hf_logits[arch]).abs().max().item()
        assert diff <= TOLERANCE, f"{arch} TP={tp} PP={pp}: max |megatron - HF| logits = {diff}"

        exported, original = _load_all(tmp_path / arch), _load_all(hf_dir)
        assert exported.keys() == original.keys(), f"{arch}: exported tensor names differ"
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), f"{arch} TP={tp} PP={pp}: {name} changed in the round trip"
        assert (tmp_path / arch / "tokenizer.json").is_file() and (tmp_path / arch / "config.json").is_file()
        if pp > 1:  # one file per stage plus an index: transformers must load it as is
            assert (tmp_path / arch / "model.safetensors.index.json").is_file()
            assert torch.equal(_hf_logits(tmp_path / arch), hf_logits[arch])
        assert not list(tmp_path.glob(".*tmp-*")), "temp export dirs were left behind"

    values = results["critic"]
    assert values.shape == (BATCH, SEQ, tp), "one scalar per token on each TP rank"
    assert torch.equal(values[..., :1].expand_as(values), values), "value head differs across TP ranks"
