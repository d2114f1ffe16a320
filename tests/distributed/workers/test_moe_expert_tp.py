"""Expert tensor parallelism with sequence parallelism trains on gloo: the actor on a tiny Qwen3-MoE at TP 2 +
SP × EP 2 × expert TP 2 (4 ranks, every expert cut in two) computes what TP 1 × EP 2 (2 ranks) computes: the
log-probs, one update's losses and gradient norm, and the log-probs after it.

At expert TP 2 the alltoall dispatcher gathers each expert-TP rank's tokens, whose counts differ, with an
all-gather of unequal sizes, which gloo cannot do itself (`megarl.parallel.cpu_runtime.all_gather_uneven`).
Both layouts have two DP ranks, each taking the same half of the batch. The router's load-balancing and z
losses are on: TP 2 + SP pads each row to a multiple of 2, and those columns stay out of them as all padding
does (`MicroBatch.padding_mask`); before they did, the padding column (token 0, a zero embedding row in the
tiny model) entered the aux loss and its RMSNorm sent a gradient of norm ~8,000 back into the embedding.
"""

import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

TOLERANCE = 1e-5
MOE_INTERMEDIATE = 128  # make_tiny_model's qwen3_moe


def _rank_main(model_dir: str, tp: int, etp: int, advantages: torch.Tensor) -> dict:
    from megarl.config.roles import ActorConfig, MoeConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(tp, 1, seed=0, ep=2, etp=etp)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        # Adam's eps 1 (as test_sequence_parallel): rounding noise in a near-zero gradient is not scaled up to a full step.
        optim=OptimizerConfig(lr=0.5, eps=1.0, use_distributed_optimizer=True, weight_decay=0.0),
        moe=MoeConfig(aux_loss_coeff=0.01),
        sequence_parallel=tp > 1,
        model=FLOAT32_LOCAL,
    )
    fc2 = next(
        p for n, p in actor.engine.model.module.named_parameters() if n.endswith("local_experts.0.linear_fc2.weight")
    )
    batch = ragged_batch()
    batch.advantages = advantages
    share = len(batch) // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    before, _ = actor.compute_log_prob(local, micro_batch_size=share)
    local.old_log_probs = before
    loss = PolicyLoss(ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.2))
    metrics = actor.update_policy(local, loss, mini_batch_size=share, micro_batch_size=share // 2)
    after, _ = actor.compute_log_prob(local, micro_batch_size=share)
    return dict(
        dp_rank=groups.dp_rank,
        expert_width=fc2.shape[1],
        before=before,
        after=after,
        metrics=metrics,
        mask=local.response_mask,
    )


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", initializer_range=0.1)


def test_expert_tp_with_sequence_parallel_equals_tp1(tiny_qwen3_moe):
    advantages = torch.randn(ragged_batch().response_mask.shape, generator=torch.Generator().manual_seed(7))
    reference = {r["dp_rank"]: r for r in run_distributed(_rank_main, 2, str(tiny_qwen3_moe), 1, 1, advantages)}
    split = run_distributed(_rank_main, 4, str(tiny_qwen3_moe), 2, 2, advantages)
    assert {r["expert_width"] for r in split} == {MOE_INTERMEDIATE // 2}, "every expert is cut over 2 expert-TP ranks"
    assert {r["expert_width"] for r in reference.values()} == {MOE_INTERMEDIATE}
    for rank, ours in enumerate(split):
        theirs, mask = reference[ours["dp_rank"]], ours["mask"]
        assert theirs["metrics"]["grad_norm"] > 0
        for key in ("loss", "pg_loss", "grad_norm"):
            assert ours["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=TOLERANCE, abs=TOLERANCE), key
        for key in ("before", "after"):
            diff = ((ours[key] - theirs[key]).abs() * mask).max().item()
            assert diff <= TOLERANCE, f"rank {rank} log-probs {key} the update: expert TP 2 differs by {diff:.2e}"
        moved = ((ours["after"] - ours["before"]).abs() * mask).max().item()
        assert moved > 100 * TOLERANCE, "the update moved the log-probs"
