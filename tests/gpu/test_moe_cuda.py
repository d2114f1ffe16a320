"""The actor on a tiny Qwen3-MoE (8 experts, top-2) on CUDA in bf16: on one GPU with the Transformer
Engine spec its experts are grouped-GEMM experts (`TEGroupedMLP`, one GEMM for all local experts) and it
trains; on two GPUs the experts are split over EP 2 and the alltoall dispatcher's exchange runs over NCCL.
CPU twins: tests/distributed/workers/test_moe_actor.py (EP over gloo, SequentialMLP experts) and
tests/unit/models/test_qwen3_moe.py (the grouped-GEMM names and spec options)."""

import importlib.util
import math

import pytest
import torch

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.batch import PolicyBatch

UPDATES = 3


def _batch() -> PolicyBatch:
    """4 samples: prompts of 6, 3, 5 and 4 tokens (left-padded to 6), 5 response tokens each."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 60, (4, 6), generator=generator)
    prompt_mask = torch.arange(6)[None, :] >= (6 - torch.tensor([6, 3, 5, 4]))[:, None]
    responses = torch.randint(4, 60, (4, 5), generator=generator)
    return PolicyBatch(prompts, prompt_mask, responses, torch.ones_like(responses, dtype=torch.bool))


def _rank(model_dir: str, ep: int) -> dict:
    from megarl.config.roles import ActorConfig, MoeConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, 1, seed=0, ep=ep, etp=1)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, weight_decay=0.0),
        model=ModelConfig(dtype="bfloat16", transformer_impl="auto"),
        moe=MoeConfig(aux_loss_coeff=1e-2),
    )
    model = actor.engine.model
    batch = _batch()
    share = len(batch) // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    local.old_log_probs, _ = actor.compute_log_prob(local, micro_batch_size=share)
    local.advantages = torch.ones_like(local.old_log_probs)
    loss = PolicyLoss(ActorConfig(clip_ratio_low=0.9, clip_ratio_high=10.0))
    updates = [
        actor.update_policy(local, loss, mini_batch_size=share, micro_batch_size=share // 2) for _ in range(UPDATES)
    ]
    after, _ = actor.compute_log_prob(local, micro_batch_size=share)
    mask = local.response_mask
    return dict(
        experts={type(module).__name__ for name, module in model.named_modules() if name.endswith("mlp.experts")},
        devices={p.device.type for p in model.parameters()},
        gain=(((after - local.old_log_probs) * mask).sum() / mask.sum()).item(),
        losses=[update["loss"] for update in updates],
        tokens_per_expert=[update["moe_layer_0_tokens_per_expert"] for update in updates],
    )


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", initializer_range=0.1)


def test_grouped_gemm_experts_train_on_one_gpu(tiny_qwen3_moe, memory_phase):
    with memory_phase("moe_actor"):
        [out] = run_distributed(_rank, 1, str(tiny_qwen3_moe), 1, timeout_s=600)
    te = importlib.util.find_spec("transformer_engine") is not None
    assert out["experts"] == {"TEGroupedMLP" if te else "SequentialMLP"}, out
    assert out["devices"] == {"cuda"}
    assert all(math.isfinite(loss) for loss in out["losses"]) and out["losses"][-1] < out["losses"][0], out
    assert out["gain"] > 0, "the positively advantaged responses became more likely"


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="expert parallelism over NCCL needs two GPUs"
)
def test_expert_parallel_over_nccl_trains_and_routes_every_token(tiny_qwen3_moe, memory_phase):
    with memory_phase("moe_actor_ep2"):
        ranks = run_distributed(_rank, 2, str(tiny_qwen3_moe), 2, timeout_s=600)
    first = ranks[0]
    assert first["losses"][-1] < first["losses"][0], first
    assert first["gain"] > 0
    assert all(rank["tokens_per_expert"] == first["tokens_per_expert"] for rank in ranks)
    assert all(count > 0 for count in first["tokens_per_expert"])
