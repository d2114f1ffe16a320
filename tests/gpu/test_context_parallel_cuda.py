"""Context parallelism with the real Transformer Engine: at CP 2 over NCCL (two GPUs), TE's THD ring attention
(`cp_comm_type` p2p, `AttnFuncWithCPAndKVP2P`) and fused THD RoPE with `cp_size`/`cp_rank` give the actor the
log-probs and entropy of CP 1, for micro-batches cut by samples and packed under a token budget; one update's
gradient norm equals CP 1's, and the update makes the sampled tokens likelier. bf16 (TE's THD kernels take no
fp32). Skipped without CUDA (conftest), without Transformer Engine, or with fewer than two GPUs (NCCL refuses
two ranks on one device). CPU twin, with stand-ins for TE's CP attention and RoPE, in fp32 to 1e-5:
tests/distributed/workers/test_context_parallel.py."""

import importlib.util
import math

import pytest
import torch

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is None,
        reason="Transformer Engine is not installed",
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="context parallelism over NCCL needs two GPUs",
    ),
]

TOLERANCE = 0.05
"""bf16 kernels round differently (and the ring merges partial softmaxes in another order); a token attending
to the wrong chunk or position moves log-probs by ~1-10."""


def _batch():
    """8 samples of 2 to 11 tokens (most not a multiple of 2·CP: megarl pads each), prompts left-padded with
    real token ids."""
    from megarl.workers.batch import PolicyBatch

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 60, (8, 6), generator=gen)
    responses = torch.randint(4, 60, (8, 5), generator=gen)
    prompt_mask = torch.arange(6)[None, :] >= (6 - torch.tensor([6, 1, 3, 6, 2, 5, 4, 1]))[:, None]
    response_mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 2, 3, 5, 4, 1, 5])[:, None]
    return PolicyBatch(prompts, prompt_mask, responses, response_mask)


def _rank(model_dir: str, cp: int) -> dict:
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.packing import TokenBudget

    groups = initialize_model_parallel(1, 1, seed=0, cp=cp)
    settings = ModelConfig(dtype="bfloat16", transformer_impl="transformer_engine")
    out = {"cp": groups.cp_size}
    for name, cut in (("samples", 4), ("packed", TokenBudget(24, "actor.max_tokens_per_micro_batch"))):
        actor = MegatronActor.from_hf(
            model_dir,
            groups,
            optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
            model=settings,
        )
        batch = _batch()
        before, entropy = actor.compute_log_prob(batch, micro_batch_size=cut)
        batch.old_log_probs, batch.advantages = before, torch.ones(batch.response_mask.shape)
        metrics = actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=8, micro_batch_size=cut)
        after, _ = actor.compute_log_prob(batch, micro_batch_size=cut)
        out[name] = dict(
            log_probs=before,
            entropy=entropy,
            grad_norm=metrics["grad_norm"],
            gain=(after - before)[batch.response_mask].mean().item(),
        )
    return out


def test_te_context_parallel_equals_cp1(tmp_path, memory_phase):
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    with memory_phase("cp1"):
        [off] = run_distributed(_rank, 1, str(model_dir), 1, timeout_s=600)
    with memory_phase("cp2"):
        ranks = run_distributed(_rank, 2, str(model_dir), 2, timeout_s=600)
    mask = _batch().response_mask
    for on in ranks:
        assert on["cp"] == 2 and off["cp"] == 1
        for name in ("samples", "packed"):
            for key in ("log_probs", "entropy"):
                gap = (on[name][key] - off[name][key])[mask].abs().max().item()
                assert gap < TOLERANCE, (name, key, gap)
            assert math.isfinite(on[name]["grad_norm"]) and on[name]["grad_norm"] > 0
            assert on[name]["grad_norm"] == pytest.approx(off[name]["grad_norm"], rel=0.05)
            assert on[name]["gain"] > 0  # positive advantages: the update made the sampled tokens likelier
