"""On the Transformer Engine spec, micro-batches reach the model in megatron-core's THD layout (one
row of back-to-back samples, `PackedSeqParams`, no mask), and compute what the local spec's padded
micro-batches compute: log-probs and entropy for several cuts, with prompts left-padded to
different widths, and the update's gradients. One world of two pipeline stages (TP 1 × PP 2): the
stages exchange one shape, so THD rows are padded to it (`megarl.workers.thd`, "Padding").

Transformer Engine is CUDA-only: its core attention is stood in for by
`te_thd_stand_in.ThdDotProductAttention`, which implements `TEDotProductAttention.forward`'s THD
contract (megatron/core/extensions/transformer_engine.py, `TEDotProductAttention.forward`: `causal`
→ `padding_causal` for thd; TE's `DotProductAttention.forward` in transformer_engine/pytorch/
attention/dot_product_attention/dot_product_attention.py: causal attention inside each
`cu_seqlens` sequence) in plain torch, and refuses anything else; and so is TE's fused THD RoPE, by
`te_thd_stand_in.fused_rope_thd` (transformer_engine/pytorch/attention/rope.py,
`apply_rotary_pos_emb(..., tensor_format="thd", fused=True)`: positions restart at each
`cu_seqlens` sequence), which megatron calls because megarl sets `apply_rope_fusion` on the TE spec
(`megarl.models.architectures.rope_fusion`). The rest is real: megarl's spec choice, mask type and
rope fusion, its THD layout and `run_model`, megatron's GPTModel and SelfAttention (the batch
dimension squeezed for thd, RoPE per sequence: megatron/core/models/common/embeddings/rope_utils.py,
`apply_rotary_pos_emb`, fused or `_apply_rotary_pos_emb_thd`). The GPU twin with the real TE:
tests/gpu/test_thd_cuda.py.
"""

import numpy as np
import pytest
import torch
from worker_batches import left_padded, ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

CUTS = (4, 11, 24, 96)
"""4 samples per micro-batch, or token budgets: the longest sample alone (11), a few samples, all (the
batch has 54 tokens)."""
TOLERANCE = 1e-5


def _rank_main(model_dir):
    from megatron.core.transformer.attention import SelfAttention
    from te_thd_stand_in import ROPE_CALLS, use_stand_in_transformer_engine

    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.megatron_train import micro_batches_of
    from megarl.workers.packing import TokenBudget

    use_stand_in_transformer_engine()
    groups = initialize_model_parallel(1, 2, seed=0)
    optim = OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False)
    local = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
    te = MegatronActor.from_hf(
        model_dir, groups, optim=optim, model=ModelConfig(dtype="float32", transformer_impl="transformer_engine")
    )
    batch = ragged_batch()
    out = {"impl": te.engine.model.config.transformer_impl}
    out["padded"] = [t.numpy() for t in local.compute_log_prob(batch, micro_batch_size=len(batch))]
    budgets = {cut: TokenBudget(cut, "actor.max_tokens_per_micro_batch") for cut in CUTS if cut != 4}
    attentions = [m for m in te.engine.model.modules() if isinstance(m, SelfAttention)]
    out["rope_fusion"] = [a.config.apply_rope_fusion for a in attentions]
    out["rope_micro_batches"] = []
    ROPE_CALLS.clear()
    for width in (0, 3):
        wider = left_padded(batch, width)
        for cut in CUTS:
            log_probs, entropy = te.compute_log_prob(wider, micro_batch_size=budgets.get(cut, cut))
            out["thd", width, cut] = [log_probs.numpy(), entropy.numpy()]
            micro_batches = micro_batches_of(wider, budgets.get(cut, cut), groups, te.engine.model.config)
            # The fused RoPE runs once per micro-batch for q and for k in each layer of this stage.
            out["rope_micro_batches"] += [mb.cu_seqlens.tolist() for mb in micro_batches] * (2 * len(attentions))
    out["rope_calls"] = list(ROPE_CALLS)
    # The same model with the flag off runs megatron's unfused THD RoPE (and never the fused one).
    for attention in attentions:
        attention.config.apply_rope_fusion = False
    out["rope_unfused"] = [t.numpy() for t in te.compute_log_prob(left_padded(batch, 3), micro_batch_size=budgets[24])]
    for attention in attentions:
        attention.config.apply_rope_fusion = True
    out["rope_calls_unfused"] = len(ROPE_CALLS) - len(out["rope_calls"])
    # Pipeline stages exchange one shape: the row is padded to the budget, as one more sequence.
    [whole] = micro_batches_of(batch, budgets[96], groups, te.engine.model.config)
    out["offsets"] = whole.cu_seqlens.tolist()
    batch.old_log_probs = torch.from_numpy(out["padded"][0]) + 0.05
    batch.advantages = torch.linspace(-1, 1, batch.response_length).expand(len(batch), -1).clone()
    loss = PolicyLoss(ActorConfig(entropy_coeff=0.01))
    for name, actor, cut in (("padded", local, len(batch)), ("thd", te, budgets[24])):
        metrics = actor.update_policy(batch, loss, mini_batch_size=len(batch), micro_batch_size=cut)
        grads = {n: p.main_grad.detach().clone().numpy() for n, p in actor.named_parameters_for_sync()}
        out["update", name] = metrics, grads
    return out


@pytest.fixture(scope="module")
def ranks(tiny_qwen2):
    return run_distributed(_rank_main, 2, str(tiny_qwen2))


def _max_diff(actual, expected) -> float:
    mask = ragged_batch().response_mask.numpy()
    return float(np.abs(np.where(mask, actual - expected, 0.0)).max())


def test_thd_log_probs_and_entropy_equal_the_padded_ones(ranks):
    for rank in ranks:
        assert rank["impl"] == "transformer_engine"
        for width in (0, 3):
            for cut in CUTS:
                for name, thd, padded in zip(("log_probs", "entropy"), rank["thd", width, cut], rank["padded"]):
                    diff = _max_diff(thd, padded)
                    assert diff <= TOLERANCE, f"{name}, {width} more columns of left padding, cut {cut}: {diff:.2e}"


def test_rope_fusion_runs_the_fused_kernel_per_micro_batch_and_equals_the_unfused_rope(ranks):
    """megarl's TE config turns `apply_rope_fusion` on, so megatron hands TE's fused THD RoPE (the
    stand-in) each micro-batch's `cu_seqlens` for every cut, twice per layer (q and k); with the
    flag off, megatron's unfused per-sequence RoPE gives the same log-probs and entropy on packed
    micro-batches of several samples (token budget 24)."""
    for rank in ranks:
        assert rank["rope_fusion"] and all(rank["rope_fusion"])
        assert sorted(rank["rope_calls"]) == sorted(rank["rope_micro_batches"])
        assert max(len(offsets) for offsets in rank["rope_calls"]) > 4  # several samples per row
        assert rank["rope_calls_unfused"] == 0
        for name, fused, unfused in zip(("log_probs", "entropy"), rank["thd", 3, 24], rank["rope_unfused"]):
            diff = _max_diff(fused, unfused)
            assert diff <= TOLERANCE, f"{name}: fused RoPE differs from the unfused by {diff:.2e}"


def test_pipeline_stages_get_the_row_padded_to_the_budget_as_a_sequence_of_its_own(ranks):
    for rank in ranks:
        assert rank["offsets"][-2:] == [54, 96]  # the ragged batch's 54 tokens, then 42 of padding


def test_a_thd_update_has_the_padded_metrics_and_gradients(ranks):
    for rank in ranks:
        padded_metrics, padded_grads = rank["update", "padded"]
        metrics, grads = rank["update", "thd"]
        assert padded_metrics["grad_norm"] > 0
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
            assert metrics[key] == pytest.approx(padded_metrics[key], rel=TOLERANCE, abs=TOLERANCE), key
        for name, grad in padded_grads.items():
            diff = float(np.abs(grads[name] - grad).max())
            assert diff <= TOLERANCE, f"gradient {name} differs by {diff:.2e}"
