"""The actor on a tiny Qwen3-MoE (8 experts, top-2) with expert parallelism over gloo: PPO updates
with the distributed optimizer raise the log-probs of positively advantaged responses and lower the
loss, the routers' metrics count every routed token once, and a checkpoint taken after the first update
resumes exactly (the same second update, bit for bit).

Layouts (2 ranks each): TP1 × EP2 (two DP ranks, each an EP rank holding 4 experts) and TP2 with
sequence parallelism × EP2 × expert TP 1 (the dense layers cut in two, every expert whole on its rank).
"""

import pytest
import torch
from worker_batches import BATCH_SIZE, PROMPT_LEN, RESPONSE_LEN, ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

UPDATES = 3


def _rank_main(model_dir: str, ckpt_root: str, tp: int, sequence_parallel: bool) -> dict:
    from megarl.config.roles import ActorConfig, MoeConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint

    groups = initialize_model_parallel(tp, 1, seed=0, ep=2, etp=1)
    optim = OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, weight_decay=0.0)
    moe = MoeConfig(aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    loss = PolicyLoss(ActorConfig(clip_ratio_low=0.9, clip_ratio_high=10.0))

    def new_actor():
        return MegatronActor.from_hf(
            model_dir, groups, optim=optim, moe=moe, sequence_parallel=sequence_parallel, model=FLOAT32_LOCAL
        )

    batch = ragged_batch()
    share = len(batch) // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    actor = new_actor()
    assert len({n for n, _ in actor.named_parameters_for_sync() if ".local_experts." in n}) == 2 * 4 * 2, (
        "2 layers × 4 local experts × (fc1, fc2): each EP rank holds half of the experts"
    )
    local.old_log_probs, _ = actor.compute_log_prob(local, micro_batch_size=share)
    local.advantages = torch.ones_like(local.old_log_probs)

    def update(model):
        return model.update_policy(local, loss, mini_batch_size=share, micro_batch_size=share // 2)

    updates = [update(actor)]
    step_dir = save_checkpoint(
        ckpt_root,
        1,
        groups,
        models={"actor": [actor.engine.model]},
        optimizers={"actor": actor.engine.optimizer},
        schedulers={"actor": actor.engine.scheduler},
        extra={},
    )
    updates.append(update(actor))
    second = {name: param.detach().clone() for name, param in actor.named_parameters_for_sync()}
    updates += [update(actor) for _ in range(UPDATES - 2)]
    after, _ = actor.compute_log_prob(local, micro_batch_size=share)
    mask = local.response_mask
    gain = ((after - local.old_log_probs) * mask).sum() / mask.sum()

    resumed = new_actor()
    load_checkpoint(
        step_dir,
        groups,
        models={"actor": [resumed.engine.model]},
        optimizers={"actor": resumed.engine.optimizer},
        schedulers={"actor": resumed.engine.scheduler},
    )
    resumed_update = update(resumed)
    exact = all(torch.equal(param, second[name]) for name, param in resumed.named_parameters_for_sync())
    return dict(updates=updates, gain=gain.item(), resumed_update=resumed_update, resume_exact=exact)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    from megarl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", initializer_range=0.1)


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, True)], ids=["tp1-ep2", "tp2-sp-ep2-etp1"])
def test_moe_actor_learns_reports_its_routers_and_resumes_exactly(tiny_qwen3_moe, tmp_path, tp, sequence_parallel):
    ranks = run_distributed(
        _rank_main, 2, str(tiny_qwen3_moe), str(tmp_path / "ckpt"), tp, sequence_parallel, timeout_s=600
    )
    first = ranks[0]
    losses = [u["loss"] for u in first["updates"]]
    assert losses[0] > losses[1] > losses[2], f"the loss falls update by update: {losses}"
    assert first["gain"] > 0, "the positively advantaged responses became more likely"
    # Every token of the step (rows padded to a multiple of TP under sequence parallelism), top-2 of 8 experts.
    routed = BATCH_SIZE * -(-(PROMPT_LEN + RESPONSE_LEN) // tp) * tp * 2 / 8
    for update in first["updates"]:
        for layer in (0, 1):
            assert update[f"moe_layer_{layer}_tokens_per_expert"] == routed
            assert update[f"moe_layer_{layer}_load_min"] <= 1 <= update[f"moe_layer_{layer}_load_max"]
            assert update[f"moe_layer_{layer}_load_cv"] >= 0
        assert update["moe_aux_loss"] > 0 and update["moe_z_loss"] > 0
    assert all(rank["updates"] == first["updates"] for rank in ranks), "every rank reports the same metrics"
    assert first["resumed_update"] == first["updates"][1], "the resumed second update is the original one"
    assert all(rank["resume_exact"] for rank in ranks), "the resumed weights equal the original run's"
