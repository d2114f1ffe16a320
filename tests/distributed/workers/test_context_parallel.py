"""Context parallelism (`*.parallel.context_parallel_size`) computes what it computes without: the actor's
log-probs and entropy, the critic's values, and one update's losses, gradient norm and updated parameters
of both, for micro-batches cut by samples and packed under a token budget, at CP 2 (2 ranks), against CP 1,
on gloo in fp32; and the actor's log-probs, entropy and update at TP 2 × CP 2 with sequence parallelism (4 ranks),
where each CP rank's share is split again over TP, and at CP 2 × PP 2 (4 ranks: the stages exchange each CP
rank's share of the row, megatron's schedule sizing it from the whole row's length). Only CP rank 0 exports
and fills the weight sync; a checkpoint saved at CP 2 records it and resumes exactly.

Context parallelism runs on the Transformer Engine spec (THD micro-batches), CUDA-only: its core attention
and fused THD RoPE are `te_thd_stand_in`'s, which follow TE's CP contract (whole-row `cu_seqlens`, each
rank's tokens the dual chunks `r` and `2·CP - 1 - r` of every sequence; the stand-in's docstring cites the
upstream code) and refuse anything else. Everything else is real: megarl's split and gather
(`megarl.workers.context_parallel`), megatron's grid, GPTModel, RoPE call, schedule (which scales the loss by
CP) and DDP over DP × CP. The ragged batch's samples are 2 to 11 tokens long: most are not multiples of
2·CP, so the runs also prove megarl's per-sequence padding. The GPU twin with the real TE:
tests/gpu/test_context_parallel_cuda.py.
"""

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch

from megarl.parallel.spawn import run_distributed

SAMPLES_PER_MICRO_BATCH = 4
BUDGET = 24
TOLERANCE = 1e-5


def _snapshot(model) -> dict[str, np.ndarray]:
    return {name: p.detach().clone().numpy() for name, p in model.named_parameters()}


def _record_gathered_widths() -> list[int]:
    """The last dimension of every tensor gathered over CP in this process (`ContextShard.gather`, which still runs)."""
    from megarl.workers.context_shard import ContextShard

    widths, gather = [], ContextShard.gather

    def recorded(self, local):
        widths.append(local.shape[-1])
        return gather(self, local)

    ContextShard.gather = recorded
    return widths


def _resume(actor, model_dir, root, groups, batch, loss_fn, cut) -> dict:
    """The manifest's layout of a checkpoint saved at CP 2, and the next update of the saved actor and of a fresh one
    that loaded the checkpoint (an exact resume: the same losses and parameters)."""
    from megarl.config.roles import OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.workers.actor import MegatronActor
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint
    from megarl.workers.checkpoint_files import read_manifest

    def states(of):
        return dict(
            models={"actor": of.engine.chunks},
            optimizers={"actor": of.engine.optimizer},
            schedulers={"actor": of.engine.scheduler},
        )

    step_dir = save_checkpoint(f"{root}-checkpoints", 1, groups, extra={}, **states(actor))
    fresh = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        model=ModelConfig(dtype="float32", transformer_impl="transformer_engine"),
    )
    load_checkpoint(step_dir, groups, **states(fresh))
    losses = [
        each.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=cut) for each in (actor, fresh)
    ]
    return dict(
        layout=read_manifest(step_dir).layout,
        losses=[metrics["loss"] for metrics in losses],
        params=[_snapshot(each.engine.model.module) for each in (actor, fresh)],
    )


def _rank_main(model_dir, export_dir, tp, cp, pp, old_log_probs, advantages, returns):
    from te_thd_stand_in import use_stand_in_transformer_engine

    from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.models.checkpoint import export_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.critic import MegatronCritic
    from megarl.workers.megatron_train import micro_batches_of
    from megarl.workers.packing import TokenBudget

    use_stand_in_transformer_engine()
    gathered = _record_gathered_widths()
    groups = initialize_model_parallel(tp, pp, seed=0, cp=cp)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    batch.values, batch.returns = torch.zeros_like(returns), returns
    te = ModelConfig(dtype="float32", transformer_impl="transformer_engine")
    optim = OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False)
    sp = tp > 1
    loss_fn = PolicyLoss(ActorConfig(entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1))
    cuts = {"samples": SAMPLES_PER_MICRO_BATCH, "packed": TokenBudget(BUDGET, "actor.max_tokens_per_micro_batch")}
    out = {
        "grid": (groups.cp_size, groups.cp_rank, groups.dp_size),
        "last_stage": groups.is_last_stage,
        "sync_replica": groups.weight_replicas().dp_rank,
    }
    for name, cut in cuts.items():
        actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=te, sequence_parallel=sp)
        torch.manual_seed(1)  # the value head is freshly drawn: the same draw at every CP
        critic = MegatronCritic.from_hf(
            model_dir, groups, optim=optim, loss=CriticConfig(), model=te, sequence_parallel=sp
        )
        config = actor.engine.model.config
        micro_batches = micro_batches_of(batch, cut, groups, config)
        log_probs, entropy = actor.compute_log_prob(batch, micro_batch_size=cut)
        values = critic.compute_values(batch, micro_batch_size=cut)
        metrics = actor.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=cut)
        critic_metrics = critic.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=cut)
        out[name] = dict(
            context_parallel_size=config.context_parallel_size,
            local_widths=[mb.input_ids.shape[1] for mb in micro_batches],
            row_widths=[mb.sequence_length for mb in micro_batches],
            sequences=[mb.cu_seqlens.diff().tolist() for mb in micro_batches],
            log_probs=log_probs.numpy(),
            entropy=entropy.numpy(),
            values=values.numpy(),
            metrics=metrics,
            critic_metrics=critic_metrics,
            params=_snapshot(actor.engine.model.module),
            critic_params=_snapshot(critic.engine.model.module),
        )
    out["gathered_widths"] = sorted(set(gathered))
    if cp > 1 and tp == 1 and pp == 1:
        out["resume"] = _resume(actor, model_dir, export_dir, groups, batch, loss_fn, cuts["packed"])
    exported = export_hf_weights([actor.engine.model.module], export_dir, groups, hf_assets_dir=model_dir)
    out["exported"] = exported is not None
    return out


@pytest.fixture(scope="module")
def inputs(hf_reference):
    gen = torch.Generator().manual_seed(5)
    old_log_probs = hf_reference[0] + 0.05 * torch.randn(hf_reference[0].shape, generator=gen)
    return (
        old_log_probs,
        torch.randn(old_log_probs.shape, generator=gen),
        torch.randn(old_log_probs.shape, generator=gen),
    )


@pytest.fixture(scope="module")
def without_cp(tiny_qwen2, inputs, tmp_path_factory):
    (rank,) = run_distributed(_rank_main, 1, str(tiny_qwen2), str(tmp_path_factory.mktemp("cp1")), 1, 1, 1, *inputs)
    return rank


def _max_diff(actual, expected, mask=None) -> float:
    diff = np.abs(actual - expected)
    return float((np.where(mask, diff, 0.0) if mask is not None else diff).max())


@pytest.mark.parametrize(("tp", "cp", "pp"), [(1, 2, 1), (2, 2, 1), (1, 2, 2)], ids=["cp2", "tp2-sp-cp2", "cp2-pp2"])
def test_context_parallel_equals_it_off(tiny_qwen2, inputs, without_cp, tmp_path, tp, cp, pp):
    mask = ragged_batch().response_mask.numpy()
    ranks = run_distributed(_rank_main, tp * cp * pp, str(tiny_qwen2), str(tmp_path / "hf"), tp, cp, pp, *inputs)
    assert sorted(rank["grid"] for rank in ranks) == sorted((cp, r, 1) for r in range(cp) for _ in range(tp * pp))
    # CP ranks hold the same weights: only CP rank 0 (the weight sync's replica 0) sends and exports them.
    assert [rank["sync_replica"] for rank in ranks] == [rank["grid"][1] for rank in ranks]
    assert [rank["exported"] for rank in ranks] == [rank["grid"][1] == 0 for rank in ranks]
    assert (tmp_path / "hf" / ("model.safetensors" if pp == 1 else "model.safetensors.index.json")).is_file()
    # Per-token scalars cross the CP group on the last stage (log-prob and entropy, a value), never a row of logits.
    widths = [rank["gathered_widths"] for rank in ranks]
    assert widths == [[1, 2] if rank["last_stage"] else [] for rank in ranks], widths
    for rank in ranks if "resume" in ranks[0] else ():  # CP 2 alone: a checkpoint records CP and resumes exactly
        resume = rank["resume"]
        assert resume["layout"]["cp"] == cp and resume["layout"]["dp"] == 1, resume["layout"]
        assert resume["losses"][0] == resume["losses"][1]
        for name, value in resume["params"][0].items():
            assert np.array_equal(resume["params"][1][name], value), name
    multiple = 2 * cp * tp  # 2·CP chunks, each CP rank's share split over TP by sequence parallelism
    for rank in ranks:
        for name in ("samples", "packed"):
            on, off = rank[name], without_cp[name]
            assert on["context_parallel_size"] == cp and off["context_parallel_size"] == 1
            assert on["local_widths"] == [width // cp for width in on["row_widths"]]
            assert all(width % multiple == 0 for width in on["row_widths"]), on["row_widths"]
            assert all(length % (2 * cp) == 0 for lengths in on["sequences"] for length in lengths), name
            assert any(length % (2 * cp) for lengths in off["sequences"] for length in lengths), "no padding exercised"
            for key in ("log_probs", "entropy"):
                diff = _max_diff(on[key], off[key], mask)
                assert diff <= TOLERANCE, f"{name} {key}: CP {cp} differs from CP 1 by {diff:.2e}"
            assert off["metrics"]["grad_norm"] > 0
            for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
                assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=TOLERANCE, abs=TOLERANCE), key
            # The critic's value head is drawn at construction, differently at TP 2 than at TP 1 (megatron's CPU
            # initialisation consumes the RNG per layout), and TP shards and pipeline stages hold other parameters
            # than the whole model: the critic and the parameters are compared at TP 1 × PP 1.
            if tp == 1 and pp == 1:
                diff = _max_diff(on["values"], off["values"], mask)
                assert diff <= TOLERANCE, f"{name} values: CP {cp} differs from CP 1 by {diff:.2e}"
                assert off["critic_metrics"]["grad_norm"] > 0
                for key in ("loss", "grad_norm", "vpred_mean"):
                    assert on["critic_metrics"][key] == pytest.approx(
                        off["critic_metrics"][key], rel=TOLERANCE, abs=TOLERANCE
                    ), f"critic {key}"
                for group in ("params", "critic_params"):
                    for param, value in off[group].items():
                        diff = _max_diff(on[group][param], value)
                        assert diff <= TOLERANCE, f"{name} {group} {param}: CP differs from CP 1 by {diff:.2e}"
