"""The Transformer Engine spec's THD micro-batches with the real TE on a GPU: log-probs and entropy
of the TE actor (one row of back-to-back samples, `PackedSeqParams`, TE's fused attention, and TE's
fused THD RoPE, which megarl turns on for this spec: `megarl.models.architectures.rope_fusion`)
equal the local spec's padded micro-batches, for several cuts and left-padding widths, and
megatron's unfused THD RoPE; the fused RoPE kernel gets each micro-batch's `cu_seqlens`; a THD
update trains. bf16 (TE's flash and cuDNN kernels take no fp32). Skipped without CUDA (conftest) or
without Transformer Engine. CPU twin, with stand-ins for TE's attention and RoPE and fp32 to 1e-5:
tests/distributed/workers/test_thd_micro_batches.py."""

import importlib.util
import math

import pytest
import torch

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

# Without CUDA the conftest's skip says so (scripts/gpu_check.sh reports it); on a GPU without TE, this one.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is None,
    reason="Transformer Engine is not installed",
)

CUTS = (4, 11, 96)
"""4 samples per micro-batch, or token budgets: the longest sample alone, all samples in one row."""
TOLERANCE = 0.05
"""bf16 kernels round differently; attending to another sample or to padding moves log-probs by ~1-10
(the CPU twin's mutation: 6.2)."""


def _batch(extra_left_padding: int):
    """8 samples: prompts of 1..6 real tokens, responses of 1..5 kept tokens, left padding of real
    token ids (attending to it would change the result)."""
    from megarl.workers.batch import PolicyBatch

    gen = torch.Generator().manual_seed(0)
    width = 6 + extra_left_padding
    prompts = torch.randint(4, 60, (8, width), generator=gen)
    responses = torch.randint(4, 60, (8, 5), generator=gen)
    prompt_mask = torch.arange(width)[None, :] >= (width - torch.tensor([6, 1, 3, 6, 2, 5, 4, 1]))[:, None]
    response_mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 2, 3, 5, 4, 1, 5])[:, None]
    return PolicyBatch(prompts, prompt_mask, responses, response_mask)


def _record_fused_rope_calls() -> list:
    """The `cu_seqlens` of every call megatron makes to TE's fused THD RoPE (the rope_utils module
    attribute `apply_rotary_pos_emb` calls, megatron/core/models/common/embeddings/rope_utils.py),
    which still runs."""
    from megatron.core.models.common.embeddings import rope_utils

    calls, te_kernel = [], rope_utils.fused_apply_rotary_pos_emb_thd

    def recorded(t, cu_seqlens, freqs, **kwargs):
        calls.append(cu_seqlens.tolist())
        return te_kernel(t, cu_seqlens, freqs, **kwargs)

    rope_utils.fused_apply_rotary_pos_emb_thd = recorded
    return calls


def _rope_checks(te, batch, groups) -> dict:
    """TE's fused THD RoPE against megatron's unfused one (the flag off on the same model), and the
    fused kernel's calls: one per micro-batch for q and for k in every layer."""
    from megatron.core.transformer.attention import SelfAttention

    from megarl.workers.megatron_train import micro_batches_of
    from megarl.workers.packing import TokenBudget

    budget = TokenBudget(24, "actor.max_tokens_per_micro_batch")
    attentions = [m for m in te.engine.model.modules() if isinstance(m, SelfAttention)]
    calls = _record_fused_rope_calls()
    fused = te.compute_log_prob(batch, micro_batch_size=budget)
    fused_calls = list(calls)
    for attention in attentions:
        attention.config.apply_rope_fusion = False
    unfused = te.compute_log_prob(batch, micro_batch_size=budget)
    for attention in attentions:
        attention.config.apply_rope_fusion = True
    expected = [
        mb.cu_seqlens.tolist()
        for mb in micro_batches_of(batch, budget, groups, te.engine.model.config)
        for _ in range(2 * len(attentions))
    ]
    return dict(
        rope_fusion=[a.config.apply_rope_fusion for a in attentions],
        rope_calls_match=sorted(fused_calls) == sorted(expected),
        rope_calls=len(fused_calls),
        rope_calls_unfused=len(calls) - len(fused_calls),
        rope_gaps=[(a - b)[batch.response_mask].abs().max().item() for a, b in zip(fused, unfused)],
    )


def _rank(model_dir: str) -> dict:
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.packing import TokenBudget

    groups = initialize_model_parallel(1, 1, seed=0)
    optim = OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False)
    local = MegatronActor.from_hf(
        model_dir, groups, optim=optim, model=ModelConfig(dtype="bfloat16", transformer_impl="local")
    )
    te = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=optim,
        model=ModelConfig(dtype="bfloat16", transformer_impl="transformer_engine"),
    )
    batch = _batch(0)
    padded = local.compute_log_prob(batch, micro_batch_size=len(batch))
    gaps = {}
    for width in (0, 16):
        for cut in CUTS:
            budget = cut if cut == 4 else TokenBudget(cut, "actor.max_tokens_per_micro_batch")
            thd = te.compute_log_prob(_batch(width), micro_batch_size=budget)
            gaps[width, cut] = [(a - b)[batch.response_mask].abs().max().item() for a, b in zip(thd, padded)]
    rope = _rope_checks(te, batch, groups)
    budget = TokenBudget(24, "actor.max_tokens_per_micro_batch")
    before, _ = te.compute_log_prob(batch, micro_batch_size=budget)
    batch.old_log_probs, batch.advantages = before, torch.ones(8, 5)
    metrics = te.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=8, micro_batch_size=budget)
    after, _ = te.compute_log_prob(batch, micro_batch_size=budget)
    mask = batch.response_mask
    return dict(
        impl=te.engine.model.config.transformer_impl,
        gaps=gaps,
        grad_norm=metrics["grad_norm"],
        gain=(after - before)[mask].mean().item(),
        **rope,
    )


def test_te_thd_micro_batches_compute_what_padded_local_ones_do(tmp_path, memory_phase):
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    with memory_phase("thd"):
        [out] = run_distributed(_rank, 1, str(model_dir), timeout_s=600)
    assert out["impl"] == "transformer_engine"
    assert out["rope_fusion"] and all(out["rope_fusion"])
    for (width, cut), (log_prob_gap, entropy_gap) in out["gaps"].items():
        assert log_prob_gap < TOLERANCE and entropy_gap < TOLERANCE, (width, cut, out["gaps"])
    assert out["rope_calls"] > 0 and out["rope_calls_match"] and out["rope_calls_unfused"] == 0, out
    assert max(out["rope_gaps"]) < TOLERANCE, out["rope_gaps"]  # fused against unfused THD RoPE
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert out["gain"] > 0  # positive advantages: the THD update made the sampled tokens likelier
