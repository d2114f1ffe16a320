"""Megatron sequence parallelism (`*.parallel.sequence_parallel`) computes what it computes without: the
actor's log-probs and entropy, the reference's log-probs, the critic's values, and one update's losses,
gradients and updated parameters, for padded and packed micro-batches, at TP 2 on gloo (fp32); and the
actor's log-probs and update at TP 2 × PP 2 (the stages exchange `[T / TP, b, h]` activations).

The ragged batch's rows are 6 + 5 = 11 tokens wide and packed rows of a 24-token budget are ragged too:
odd widths that megatron's sequence split refuses ("First dimension of the tensor should be divisible
by tensor parallel size"), so the SP runs also prove the padding to a multiple of TP
(`megarl.workers.micro_batches.pad_sequence`).
"""

import numpy as np
import pytest
import torch
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.parallel.spawn import run_distributed

PADDED_MICRO_BATCH = 4
BUDGET = 24
TOLERANCE = 1e-5
TP = 2


def _snapshot(model) -> dict[str, np.ndarray]:
    return {name: p.detach().clone().numpy() for name, p in model.named_parameters()}


def _rank_main(model_dir, old_log_probs, advantages, returns):
    from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.critic import MegatronCritic
    from megarl.workers.megatron_train import micro_batches_of
    from megarl.workers.packing import TokenBudget
    from megarl.workers.reference import MegatronReference

    groups = initialize_model_parallel(TP, 1, seed=0)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    batch.ref_log_probs = old_log_probs - 0.1
    batch.values, batch.returns = torch.zeros_like(returns), returns
    cuts = {"padded": PADDED_MICRO_BATCH, "packed": TokenBudget(BUDGET, "actor.max_tokens_per_micro_batch")}
    optim = OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False)
    loss_fn = PolicyLoss(
        ActorConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, clip_ratio_low=0.1, clip_ratio_high=0.1)
    )
    out = {}
    for sp in (False, True):
        actor = MegatronActor.from_hf(model_dir, groups, optim=optim, sequence_parallel=sp, model=FLOAT32_LOCAL)
        torch.manual_seed(1)  # the value head is freshly drawn: the same draw for SP on and off
        critic = MegatronCritic.from_hf(
            model_dir, groups, optim=optim, loss=CriticConfig(), sequence_parallel=sp, model=FLOAT32_LOCAL
        )
        reference = MegatronReference.from_hf(model_dir, groups, sequence_parallel=sp, model=FLOAT32_LOCAL)
        config = actor.engine.model.config
        for name, cut in cuts.items():
            widths = [mb.input_ids.shape[1] for mb in micro_batches_of(batch, cut, groups, config)]
            log_probs, entropy = actor.compute_log_prob(batch, micro_batch_size=cut)
            out[sp, name] = dict(
                sequence_parallel=(
                    config.sequence_parallel,
                    critic.engine.model.config.sequence_parallel,
                    reference.chunks[0].config.sequence_parallel,
                ),
                widths=widths,
                log_probs=log_probs.numpy(),
                entropy=entropy.numpy(),
                ref_log_probs=reference.compute_ref_log_prob(batch, micro_batch_size=cut).numpy(),
                values=critic.compute_values(batch, micro_batch_size=cut).numpy(),
            )
        for name, cut in cuts.items():
            actor = MegatronActor.from_hf(model_dir, groups, optim=optim, sequence_parallel=sp, model=FLOAT32_LOCAL)
            torch.manual_seed(1)
            critic = MegatronCritic.from_hf(
                model_dir, groups, optim=optim, loss=CriticConfig(), sequence_parallel=sp, model=FLOAT32_LOCAL
            )
            metrics = actor.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=cut)
            grads = {n: p.main_grad.detach().clone().numpy() for n, p in actor.engine.model.module.named_parameters()}
            critic_metrics = critic.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=cut)
            out[sp, name].update(
                metrics=metrics,
                grads=grads,
                params=_snapshot(actor.engine.model.module),
                critic_metrics=critic_metrics,
                critic_params=_snapshot(critic.engine.model.module),
            )
    return out


@pytest.fixture(scope="module")
def ranks(tiny_qwen2, hf_reference):
    gen = torch.Generator().manual_seed(5)
    old_log_probs = hf_reference[0] + 0.05 * torch.randn(hf_reference[0].shape, generator=gen)
    advantages = torch.randn(old_log_probs.shape, generator=gen)
    returns = torch.randn(old_log_probs.shape, generator=gen)
    return run_distributed(_rank_main, TP, str(tiny_qwen2), old_log_probs, advantages, returns)


def _max_diff(actual, expected, mask=None) -> float:
    diff = np.abs(actual - expected)
    return float((np.where(mask, diff, 0.0) if mask is not None else diff).max())


def test_sequence_parallel_is_on_and_pads_rows_to_a_multiple_of_tp(ranks):
    for rank in ranks:
        for name in ("padded", "packed"):
            assert rank[False, name]["sequence_parallel"] == (False, False, False)
            assert rank[True, name]["sequence_parallel"] == (True, True, True)
            off, on = rank[False, name]["widths"], rank[True, name]["widths"]
            assert any(width % TP for width in off), f"{name}: no odd width, the padding is not exercised"
            assert on == [-(-width // TP) * TP for width in off], name


def test_forward_passes_equal_sequence_parallel_off(ranks):
    mask = ragged_batch().response_mask.numpy()
    for rank in ranks:
        for name in ("padded", "packed"):
            for key in ("log_probs", "entropy", "ref_log_probs", "values"):
                diff = _max_diff(rank[True, name][key], rank[False, name][key], mask)
                assert diff <= TOLERANCE, f"{name} {key}: SP differs from SP off by {diff:.2e}"


def test_updates_equal_sequence_parallel_off(ranks):
    for rank in ranks:
        for name in ("padded", "packed"):
            off, on = rank[False, name], rank[True, name]
            assert off["metrics"]["grad_norm"] > 0
            for key in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "tokens"):
                assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=TOLERANCE, abs=TOLERANCE), key
            for key in ("loss", "grad_norm"):
                assert on["critic_metrics"][key] == pytest.approx(
                    off["critic_metrics"][key], rel=TOLERANCE, abs=TOLERANCE
                ), f"critic {key}"
            for group in ("grads", "params", "critic_params"):
                for param, value in off[group].items():
                    diff = _max_diff(on[group][param], value)
                    assert diff <= TOLERANCE, f"{name} {group} {param}: SP differs from SP off by {diff:.2e}"


def _pipeline_rank_main(model_dir, advantages):
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.packing import TokenBudget

    groups = initialize_model_parallel(TP, 2, seed=0)
    batch = ragged_batch()
    batch.advantages = advantages
    cuts = {"padded": PADDED_MICRO_BATCH, "packed": TokenBudget(BUDGET, "actor.max_tokens_per_micro_batch")}
    out = {}
    for sp in (False, True):
        for name, cut in cuts.items():
            actor = MegatronActor.from_hf(
                model_dir,
                groups,
                optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
                sequence_parallel=sp,
                model=FLOAT32_LOCAL,
            )
            log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=cut)
            # Exactly on-policy (one mini-batch, one epoch): the update takes its old log-probs from its own forward.
            metrics = actor.update_policy(
                batch, PolicyLoss(ActorConfig()), mini_batch_size=len(batch), micro_batch_size=cut
            )
            out[sp, name] = dict(
                log_probs=log_probs.numpy(), grad_norm=metrics["grad_norm"], params=_snapshot(actor.engine.model.module)
            )
    return out


def test_pipeline_stages_with_sequence_parallel_equal_it_off(tiny_qwen2):
    advantages = torch.randn(ragged_batch().response_mask.shape, generator=torch.Generator().manual_seed(6))
    mask = ragged_batch().response_mask.numpy()
    for rank in run_distributed(_pipeline_rank_main, TP * 2, str(tiny_qwen2), advantages):
        for name in ("padded", "packed"):
            off, on = rank[False, name], rank[True, name]
            diff = _max_diff(on["log_probs"], off["log_probs"], mask)
            assert diff <= TOLERANCE, f"{name} log-probs: SP differs from SP off by {diff:.2e}"
            assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=TOLERANCE) and off["grad_norm"] > 0
            for param, value in off["params"].items():
                diff = _max_diff(on["params"][param], value)
                assert diff <= TOLERANCE, f"{name} parameter {param}: SP differs from SP off by {diff:.2e}"
