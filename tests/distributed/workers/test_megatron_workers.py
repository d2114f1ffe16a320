"""Actor, critic and reference on megatron-core over gloo: HF parity of log-probs and entropy, one
PPO update (token-mean, and sequence-mean with KL loss and a sequence-level correction) identical across (TP, PP,
DP) layouts and micro-batch cuts, vocab-parallel gradients, tied embeddings across stages, NaN-step
skipping, the LR schedule, recompute, a frozen reference, and a critic that learns, clips and resumes exactly.

Spawns are the cost here (~10-40 s each on 2 cores), so each layout runs one world that does every
check it can and returns the numbers; the tests below only compare them.

Weight parity uses Adam with eps = 1 (the distributed optimizer only supports Adam): its first
update, lr * g / (|g| + eps), is then a smooth function of the gradient, so equal gradients mean
equal weights. With the usual eps = 1e-8 the update is ~ lr * sign(g), which turns float rounding
of near-zero gradient entries into visible weight differences: a test of Adam's conditioning, not
of the update.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from worker_batches import left_padded, ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.algorithms.rollout_correction import MISMATCH_METRICS
from megarl.parallel.spawn import run_distributed
from megarl.workers.actor import CORRECTION_METRICS

LR = 0.5
RTOL = 1e-5


def _to_parent(results: dict) -> dict:
    """Tensors as numpy arrays: a torch tensor sent through run_distributed's queue is shared by a
    file descriptor that dies with the rank process."""
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in results.items()}


def _from_ranks(ranks: list[dict]) -> list[dict]:
    return [{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in r.items()} for r in ranks]


def _rank_main(model_dir, out_dir, tp, pp, micro_batch_sizes, use_distributed_optimizer, old_log_probs, advantages):
    """One world's checks (see the module docstring); returns numbers from every rank."""
    from megarl.config.roles import ActorConfig, OptimizerConfig, RolloutCorrectionConfig
    from megarl.models.checkpoint import export_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.reference import MegatronReference

    groups = initialize_model_parallel(tp, pp, seed=0)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    share = len(batch) // groups.dp_size
    local = batch.select(slice(groups.dp_rank * share, (groups.dp_rank + 1) * share))
    loss_fn = PolicyLoss(ActorConfig(entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1))
    optim = OptimizerConfig(
        lr=LR, eps=1.0, clip_grad=1.0, use_distributed_optimizer=use_distributed_optimizer, weight_decay=0.0
    )
    out = dict(updates={})

    reference = MegatronReference.from_hf(model_dir, groups, model=FLOAT32_LOCAL)
    for micro_batch_size in micro_batch_sizes:
        actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
        out["log_probs"], out["entropy"] = actor.compute_log_prob(local, micro_batch_size=share // 2)
        out["updates"][micro_batch_size] = actor.update_policy(
            local, loss_fn, mini_batch_size=share, micro_batch_size=micro_batch_size
        )
        export_hf_weights(actor.engine.model, Path(out_dir) / f"mb{micro_batch_size}", groups, hf_assets_dir=model_dir)
    # Sequence-mean aggregation with a KL loss and a sequence-level masked IS correction: the sequence
    # count is the global normaliser now, and the step's count of the correction's sequence metrics.
    seq_loss_fn = PolicyLoss(
        ActorConfig(
            loss_agg_mode="seq-mean-token-mean",
            use_kl_loss=True,
            kl_loss_coef=0.1,
            rollout_correction=RolloutCorrectionConfig("sequence", "mask", low=0.5, high=2.0),
        ),
        report_mismatch=True,
    )
    local.ref_log_probs = local.old_log_probs - 0.1
    local.rollout_log_probs = local.old_log_probs + 0.1 * torch.arange(local.response_length)
    out["seq_mean_updates"] = {}
    for micro_batch_size in micro_batch_sizes:
        seq_actor = MegatronActor.from_hf(model_dir, groups, optim=optim, model=FLOAT32_LOCAL)
        out["seq_mean_updates"][micro_batch_size] = seq_actor.update_policy(
            local, seq_loss_fn, mini_batch_size=share, micro_batch_size=micro_batch_size
        )
    out["log_probs_after"], _ = actor.compute_log_prob(local, micro_batch_size=share)
    out["log_probs_after_left_padded"], _ = actor.compute_log_prob(left_padded(local, 16), micro_batch_size=share)
    out["ref_log_probs"] = reference.compute_ref_log_prob(local, micro_batch_size=share)

    before = {name: p.detach().clone() for name, p in actor.named_parameters_for_sync()}
    local.advantages = torch.full_like(local.advantages, float("nan"))
    out["nan_update"] = actor.update_policy(local, loss_fn, mini_batch_size=share, micro_batch_size=share)
    out["nan_skipped_total"] = actor.skipped_steps
    out["nan_weights_unchanged"] = all(torch.equal(before[n], p) for n, p in actor.named_parameters_for_sync())
    out["sync_names"] = sorted(before)
    out["vocab_parallel"] = [_vocab_parallel_grad_check(groups, vocab_size) for vocab_size in (100, 200)]
    rows = slice(groups.dp_rank * share, (groups.dp_rank + 1) * share)
    out["critic_values"], out["critic_update"], out["critic_resumed"] = _critic_step(
        model_dir, groups, local, rows, Path(out_dir) / "critic_checkpoints"
    )
    return _to_parent(out)


def _critic_step(model_dir, groups, local, rows, checkpoints: Path):
    """Values and one clipped-value update of a critic whose head is set to the same seeded weights
    on every layout (its fresh init depends on the layout's RNG use); then its resume: saved after that
    update (as a critic's group writes its part, `PolicyWorker.save_checkpoint`), a second update, the
    checkpoint loaded back, the second update again: (its metrics and the values after it, both once more;
    the values after an update follow the optimizer's and the scheduler's states, not the weights alone)."""
    from megarl.config.roles import CriticConfig, OptimizerConfig
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint
    from megarl.workers.critic import MegatronCritic

    critic = MegatronCritic.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=LR, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        loss=CriticConfig(cliprange_value=0.2),
        model=FLOAT32_LOCAL,
    )
    if groups.is_last_stage:
        head = critic.engine.model.module.output_layer.weight
        with torch.no_grad():
            head.copy_(0.05 * torch.randn(head.shape, generator=torch.Generator().manual_seed(7)))
    values = critic.compute_values(local, micro_batch_size=len(local) // 2)
    # Rollout-time values 0.3 off the predictions (beyond the 0.2 clip range) and targets spread
    # around them: the clipped term wins on some tokens, the unclipped one on others.
    offsets = torch.linspace(-0.5, 0.5, 40).reshape(8, 5)[rows]
    local.values = values + 0.3 * torch.tensor([1.0, -1.0]).repeat(20).reshape(8, 5)[rows]
    local.returns = values + offsets
    metrics = critic.update_critic(local, mini_batch_size=len(local), micro_batch_size=len(local) // 2)
    engine = critic.engine
    states = dict(
        models={"critic": engine.chunks},
        optimizers={"critic": engine.optimizer},
        schedulers={"critic": engine.scheduler},
    )
    saved = save_checkpoint(checkpoints, 1, groups, **states, extra={})
    runs = []
    for _ in range(2):
        update = critic.update_critic(local, mini_batch_size=len(local), micro_batch_size=len(local) // 2)
        runs.append((update, critic.compute_values(local, micro_batch_size=len(local) // 2)))
        load_checkpoint(saved, groups, **states)
    return values, metrics, runs


def _critic_and_schedule_main(model_dir, old_log_probs, advantages):
    """Critic learning + clipping, the actor's LR schedule and epochs, activation recompute."""
    from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig, RecomputeConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.critic import MegatronCritic

    groups = initialize_model_parallel(1, 1, seed=0)
    batch = ragged_batch()
    critic = MegatronCritic.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        loss=CriticConfig(cliprange_value=0.5),
        model=FLOAT32_LOCAL,
    )
    out = dict(critic_losses=[])
    values = critic.compute_values(batch, micro_batch_size=4)
    # Predictions 1 above the rollout values, target 4 further up: past the clip range, the clipped
    # term is the larger one on every token.
    batch.values, batch.returns = values - 1.0, values + 4.0
    out["clip_case"] = critic.update_critic(batch, mini_batch_size=8, micro_batch_size=4)
    for _ in range(5):  # a fixed toy target, values refreshed each step as in PPO
        batch.values = critic.compute_values(batch, micro_batch_size=4)
        batch.returns = torch.full_like(batch.values, 0.5)
        out["critic_losses"].append(critic.update_critic(batch, mini_batch_size=8, micro_batch_size=4)["loss"])

    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(
            lr=1e-3, lr_warmup_steps=2, lr_decay_style="linear", weight_decay=0.0, use_distributed_optimizer=False
        ),
        lr_decay_steps=4,
        model=FLOAT32_LOCAL,
    )
    loss_fn = PolicyLoss(ActorConfig())
    out["step_lrs"] = [
        actor.update_policy(batch, loss_fn, mini_batch_size=8, micro_batch_size=4)["lr"] for _ in range(4)
    ]
    # 2 epochs × 4 shuffled mini-batches = 8 more steps, all past the decay: lr = min_lr = 0.
    out["epochs"] = actor.update_policy(
        batch, loss_fn, mini_batch_size=2, micro_batch_size=1, ppo_epochs=2, shuffle_seed=3
    )

    # Full recompute of every layer gives the same update; the settings reach megatron's config.
    for name, recompute in (("plain", RecomputeConfig()), ("recompute", RecomputeConfig("full", "uniform", 1))):
        actor = MegatronActor.from_hf(
            model_dir,
            groups,
            optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
            recompute=recompute,
            model=FLOAT32_LOCAL,
        )
        out[name] = actor.update_policy(batch, loss_fn, mini_batch_size=8, micro_batch_size=4)
        out[f"{name}_granularity"] = actor.engine.model.config.recompute_granularity
    return out


def _vocab_parallel_grad_check(groups, vocab_size):
    """Gradients of vocab-parallel log-probs + entropy vs full-vocabulary autograd, on `groups.tp`.

    Padded to a multiple of 128 × TP: at TP 2, a real vocabulary of 100 leaves the second rank's
    slice all padding, one of 200 is split 128 + 72 over the ranks.
    """
    from megarl.models.layout import padded_vocab_size
    from megarl.workers.logprobs import vocab_parallel_log_probs

    gen = torch.Generator().manual_seed(5)
    padded = padded_vocab_size(vocab_size, 128, groups.tp_size)
    full = (3 * torch.randn(4, 3, padded, generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab_size, (4, 3), generator=gen)
    weights = torch.randn(2, 4, 3, generator=gen)

    local = full.detach().chunk(groups.tp_size, -1)[groups.tp_rank].clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(
        local, targets, vocab_size=vocab_size, tp_group=groups.tp, with_entropy=True
    )
    (weights[0] * log_probs + weights[1] * entropy).sum().backward()

    log_softmax = full[..., :vocab_size].log_softmax(-1)
    ref_log_probs = log_softmax.gather(-1, targets[..., None])[..., 0]
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (weights[0] * ref_log_probs + weights[1] * ref_entropy).sum().backward()
    ref_grad = full.grad.chunk(groups.tp_size, -1)[groups.tp_rank]
    return dict(
        log_probs_err=(log_probs - ref_log_probs).abs().max().item(),
        entropy_err=(entropy - ref_entropy).abs().max().item(),
        grad_err=(local.grad - ref_grad).abs().max().item(),
        grad_scale=ref_grad.abs().max().item(),
    )


def _tied_embeddings_main(model_dir, pp, old_log_probs, advantages):
    """One update of a model whose LM head is its input embedding: with PP, the two copies live on
    the first and last stage and megatron all-reduces their gradients."""
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, pp, seed=0)
    batch = ragged_batch()
    batch.old_log_probs, batch.advantages = old_log_probs, advantages
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=LR, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        model=FLOAT32_LOCAL,
    )
    metrics = actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=8, micro_batch_size=2)
    log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=8)
    return metrics, log_probs.numpy()


@pytest.fixture(scope="module")
def ppo_inputs(hf_reference):
    """old log-probs a little off the current policy (so ratios clip) and random advantages around
    1 (a loss far from 0, so a relative comparison of it is meaningful)."""
    gen = torch.Generator().manual_seed(1)
    hf_log_probs, _ = hf_reference
    old_log_probs = hf_log_probs + 0.2 * torch.randn(hf_log_probs.shape, generator=gen)
    return old_log_probs, 1.0 + torch.randn(hf_log_probs.shape, generator=gen)


@pytest.fixture(scope="module")
def layouts(tiny_qwen2, ppo_inputs, tmp_path_factory):
    """name -> (rank results, export dir): one process (micro-batches 1 × 8 and 8 × 1), TP 2 × PP 2
    (4 micro-batches of 2, 1F1B), DP 2 with the distributed optimizer (2 micro-batches per rank)."""
    runs = {"single": (1, 1, 1, [8, 1], False), "tp2pp2": (4, 2, 2, [2], False), "dp2": (2, 1, 1, [2], True)}
    results = {}
    for name, (world, tp, pp, micro_batch_sizes, dist_opt) in runs.items():
        out_dir = tmp_path_factory.mktemp(name)
        ranks = _from_ranks(
            run_distributed(
                _rank_main, world, str(tiny_qwen2), str(out_dir), tp, pp, micro_batch_sizes, dist_opt, *ppo_inputs
            )
        )
        results[name] = (ranks, out_dir)
    return results


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        rel = (actual[name] - expected[name]).norm() / expected[name].norm()
        assert rel <= RTOL, f"{name}: relative difference {rel:.2e}"


def _dp_rows(name, ranks, tensor_key):
    """The full-batch `[B, R]` tensor from the per-DP-rank pieces (DP ranks are consecutive in 'dp2')."""
    if name == "dp2":
        return torch.cat([ranks[0][tensor_key], ranks[1][tensor_key]])
    return ranks[0][tensor_key]


def test_log_probs_and_entropy_match_hf_on_every_layout_and_rank(layouts, hf_reference):
    hf_log_probs, hf_entropy = hf_reference
    mask = ragged_batch().response_mask
    for name, (ranks, _) in layouts.items():
        for key, expected in (("log_probs", hf_log_probs), ("entropy", hf_entropy)):
            actual = _dp_rows(name, ranks, key)
            torch.testing.assert_close(actual[mask], expected[mask], rtol=0, atol=1e-4, msg=f"{name} {key}")
        if name == "tp2pp2":  # every PP stage and TP rank returns the last stage's numbers
            for rank in ranks[1:]:
                assert torch.equal(rank["log_probs"], ranks[0]["log_probs"])


def test_left_padding_does_not_change_log_probs(layouts):
    """16 more columns of prompt left padding (0 -> 16 for the full-width prompts) leave every
    response log-prob as it was: padding is masked out and RoPE sees only relative positions."""
    mask = ragged_batch().response_mask
    for name, (ranks, _) in layouts.items():
        plain = _dp_rows(name, ranks, "log_probs_after")
        padded = _dp_rows(name, ranks, "log_probs_after_left_padded")
        torch.testing.assert_close(padded[mask], plain[mask], rtol=0, atol=1e-5, msg=name)


def test_update_is_the_same_for_any_micro_batch_cut_and_layout(layouts, tiny_qwen2):
    single_ranks, single_dir = layouts["single"]
    expected = single_ranks[0]["updates"][8]
    expected_weights = _weights(single_dir / "mb8")
    initial_weights = _weights(tiny_qwen2)
    assert any(not torch.equal(expected_weights[n], initial_weights[n]) for n in initial_weights)
    assert expected["steps"] == 1 and expected["skipped_steps"] == 0
    assert expected["grad_norm"] > 1.0, "clipping should be active in this update"
    assert 0 < expected["clip_frac"] < 1

    cases = [("single", 1, single_ranks[0]["updates"][1], single_dir / "mb1")]
    for name, micro_batch_size in (("tp2pp2", 2), ("dp2", 2)):
        ranks, out_dir = layouts[name]
        weights_dir = out_dir / f"mb{micro_batch_size}"
        cases += [(name, micro_batch_size, rank["updates"][micro_batch_size], weights_dir) for rank in ranks]
    for name, micro_batch_size, metrics, weights_dir in cases:
        for key in ("loss", "grad_norm", "pg_loss", "entropy", "clip_frac", "approx_kl", "tokens"):
            # abs: approx_kl is a mean of ±0.2 log-ratios near 0; log-probs of different layouts
            # differ by ~5e-7 (float rounding), which a relative test of a near-zero mean would amplify.
            expected_value = pytest.approx(expected[key], rel=RTOL, abs=1e-6)
            assert metrics[key] == expected_value, f"{name} mb{micro_batch_size} {key}"
        _assert_same_weights(_weights(weights_dir), expected_weights)


def test_sequence_mean_update_with_kl_and_a_correction_is_the_same_for_any_cut_and_layout(layouts):
    single = layouts["single"][0][0]["seq_mean_updates"]
    expected = single[8]
    assert expected["kl_loss"] > 0 and expected["skipped_steps"] == 0
    # By hand: the engines' log-probs sit 0.1 t above the actor's at response token t, so a response of
    # length L has the sequence ratio exp(-0.1 L (L - 1) / 2): the three of length 5 (exp(-1) < 0.5) are
    # masked, 15 of the 26 tokens; KL k1 = sum of 0.1 t over every token / 26 = 4.0 / 26.
    assert expected["correction_out_of_range_seqs"] == pytest.approx(3 / 8)
    assert expected["correction_out_of_range_tokens"] == pytest.approx(15 / 26)
    assert expected["kl_k1"] == pytest.approx(4.0 / 26)
    cases = [("single", single[1])] + [
        (name, rank["seq_mean_updates"][2]) for name in ("tp2pp2", "dp2") for rank in layouts[name][0]
    ]
    keys = ("loss", "grad_norm", "pg_loss", "kl_loss", "clip_frac", *MISMATCH_METRICS, *CORRECTION_METRICS)
    for name, metrics in cases:
        for key in keys:
            assert metrics[key] == pytest.approx(expected[key], rel=RTOL, abs=1e-6), f"{name} {key}"


def test_update_moves_the_policy_and_the_reference_stays_frozen(layouts):
    for name, (ranks, _) in layouts.items():
        for rank in ranks:
            # The reference (built from the same checkpoint, never updated) reproduces the actor's
            # initial log-probs after the actor's update...
            torch.testing.assert_close(rank["ref_log_probs"], rank["log_probs"], rtol=0, atol=1e-6)
            # ... which did change the actor.
            assert (rank["log_probs_after"] - rank["log_probs"]).abs().max() > 1e-3, name


def test_nan_loss_skips_the_step_and_keeps_the_weights(layouts):
    for name, (ranks, _) in layouts.items():
        for rank in ranks:
            assert rank["nan_update"]["skipped_steps"] == 1 and rank["nan_update"]["steps"] == 1, name
            assert rank["nan_skipped_total"] == 1, name
            assert rank["nan_weights_unchanged"], name


def test_critic_values_and_update_are_the_same_on_every_layout(layouts):
    expected_values = layouts["single"][0][0]["critic_values"]
    expected = layouts["single"][0][0]["critic_update"]
    assert 0 < expected["clip_frac"] < 1 and expected["grad_norm"] > 0
    for name, (ranks, _) in layouts.items():
        values = _dp_rows(name, ranks, "critic_values")
        torch.testing.assert_close(values, expected_values, rtol=0, atol=1e-5, msg=name)
        for rank in ranks:
            for key in ("loss", "grad_norm", "clip_frac", "vpred_mean"):
                assert rank["critic_update"][key] == pytest.approx(expected[key], rel=RTOL, abs=1e-6), f"{name} {key}"


def test_a_critic_resumed_from_its_checkpoint_repeats_the_next_update_exactly(layouts):
    """Its weights, optimizer and scheduler came back (once the e2e role-layout run's second job, which
    resumed a PP 2 critic of its own: the trainer's part of it is tests/unit/cluster/test_role_groups.py's)."""
    for name, (ranks, _) in layouts.items():
        for rank in ranks:
            (second, values), (again, values_again) = rank["critic_resumed"]
            assert second["loss"] != rank["critic_update"]["loss"], f"{name}: the second update trained on"
            assert again == second, name
            assert torch.equal(values_again, values), name


def test_sync_names_are_global_megatron_names(layouts):
    ranks, _ = layouts["tp2pp2"]
    first_stage, last_stage = ranks[0]["sync_names"], ranks[-1]["sync_names"]
    assert "embedding.word_embeddings.weight" in first_stage and "output_layer.weight" in last_stage
    assert any(n.startswith("decoder.layers.0.") for n in first_stage)
    assert any(n.startswith("decoder.layers.1.") for n in last_stage)
    assert not any(n.startswith("decoder.layers.0.") for n in last_stage)
    single_names = layouts["single"][0][0]["sync_names"]
    assert sorted(set(first_stage) | set(last_stage)) == single_names


def test_vocab_parallel_log_softmax_gradients_match_full_vocabulary(layouts):
    ranks, _ = layouts["tp2pp2"]  # TP 2: each rank holds half of the padded vocabulary
    for rank in ranks:
        for check in rank["vocab_parallel"]:
            assert check["log_probs_err"] < 1e-5 and check["entropy_err"] < 1e-5
            assert check["grad_err"] < 1e-5 * max(1.0, check["grad_scale"])


def test_tied_embeddings_train_the_same_with_pipeline_stages(tmp_path, ppo_inputs):
    from megarl.models.tiny import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "tied", "qwen2", tie_word_embeddings=True, initializer_range=0.2))
    [(single_metrics, single_log_probs)] = run_distributed(_tied_embeddings_main, 1, model_dir, 1, *ppo_inputs)
    for metrics, log_probs in run_distributed(_tied_embeddings_main, 2, model_dir, 2, *ppo_inputs):
        for key in ("loss", "grad_norm"):
            assert metrics[key] == pytest.approx(single_metrics[key], rel=RTOL), key
        mask = ragged_batch().response_mask.numpy()
        # After the update: the embedding and the head moved together on both stages.
        assert np.abs(log_probs - single_log_probs)[mask].max() < 1e-4


def test_critic_learns_and_clips_lr_schedule_and_recompute(tiny_qwen2, ppo_inputs):
    (out,) = run_distributed(_critic_and_schedule_main, 1, str(tiny_qwen2), *ppo_inputs)
    assert out["clip_case"]["clip_frac"] > 0.99
    losses = out["critic_losses"]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses

    # Warm-up over 2 steps from 0, then linear decay to 0 at step 4 (megatron: step k uses the
    # schedule's value at k).
    assert out["step_lrs"] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    assert out["epochs"]["steps"] == 8 and out["epochs"]["skipped_steps"] == 0
    assert out["epochs"]["lr"] == 0.0

    assert (out["plain_granularity"], out["recompute_granularity"]) == (None, "full")
    for key in ("loss", "grad_norm", "entropy"):
        assert out["recompute"][key] == pytest.approx(out["plain"][key], rel=1e-6)
