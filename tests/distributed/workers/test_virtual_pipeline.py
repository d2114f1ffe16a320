"""The virtual (interleaved) pipeline schedule (`*.parallel.virtual_pipeline_model_parallel_size`) at PP 2 ×
VPP 2 on gloo (fp32) computes what PP 2 without it does: each rank holds two chunks of a 4-layer model (rank 0
layers 0 and 2, rank 1 layers 1 and 3, megatron's round-robin); the HF weights load into them and export back
bit-exact; the actor's log-probs and entropy (padded micro-batches, and a packed cut of an odd count) and one
update's losses and updated weights equal VPP off; the reference's log-probs and the critic's values and
update too. A checkpoint saved at VPP 2
resumes exactly (the next update of the resumed actor is bit-identical to the original's), and its weights load
at VPP off, bit-exact.

The model ties its embeddings: the first chunk of rank 0 and the last chunk of rank 1 share the word
embedding, so the update also proves megatron's embedding-group all-reduce across virtual stages."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

PP = 2
TOLERANCE = 1e-5
PADDED_MICRO_BATCH = 2
BUDGET = 24
"""A token budget that cuts `ragged_batch()` into 3 packed micro-batches: an odd count, not a multiple of PP."""


def _rank_main(model_dir, out_dir, vpp, advantages):
    from megarl.config.roles import ActorConfig, CriticConfig, OptimizerConfig
    from megarl.models.checkpoint import export_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.checkpoint import load_checkpoint, save_checkpoint
    from megarl.workers.checkpoint_files import step_dir_name
    from megarl.workers.critic import MegatronCritic
    from megarl.workers.megatron_train import micro_batches_of
    from megarl.workers.packing import TokenBudget
    from megarl.workers.reference import MegatronReference

    groups = initialize_model_parallel(1, PP, seed=0, vpp=vpp)
    batch = ragged_batch()
    batch.advantages = advantages
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        model=FLOAT32_LOCAL,
    )
    chunks = [chunk.module for chunk in actor.engine.chunks]
    out = dict(
        layers=sorted(
            {
                int(name.split(".")[2])
                for name, _ in actor.named_parameters_for_sync()
                if name.startswith("decoder.layers.")
            }
        ),
        chunks=len(chunks),
    )
    export_hf_weights(chunks, f"{out_dir}/vpp{vpp}", groups, hf_assets_dir=model_dir)
    packed = TokenBudget(BUDGET, "actor.max_tokens_per_micro_batch")
    out["packed_micro_batches"] = len(micro_batches_of(batch, packed, groups, chunks[0].config))
    for name, cut in (("padded", PADDED_MICRO_BATCH), ("packed", packed)):
        log_probs, entropy = actor.compute_log_prob(batch, micro_batch_size=cut)
        out[name] = dict(log_probs=log_probs.numpy(), entropy=entropy.numpy())
    reference = MegatronReference.from_hf(model_dir, groups, model=FLOAT32_LOCAL)
    out["ref_log_probs"] = reference.compute_ref_log_prob(batch, micro_batch_size=PADDED_MICRO_BATCH).numpy()
    critic = MegatronCritic.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        loss=CriticConfig(),
        model=FLOAT32_LOCAL,
    )
    if groups.is_last_stage:  # the value head's random draw depends on what was built before it: set it
        head = critic.engine.chunks[-1].module.output_layer.weight
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)))
    values = critic.compute_values(batch, micro_batch_size=PADDED_MICRO_BATCH)
    batch.values, batch.returns = values, values + advantages
    out["values"] = values.numpy()
    out["critic_metrics"] = critic.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=PADDED_MICRO_BATCH)
    batch.old_log_probs = torch.from_numpy(out["padded"]["log_probs"]) - 0.05
    loss_fn = PolicyLoss(ActorConfig(entropy_coeff=0.01, clip_ratio_low=0.1, clip_ratio_high=0.1))
    out["metrics"] = actor.update_policy(
        batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=PADDED_MICRO_BATCH
    )
    out["params"] = _params(actor)

    def states(of):
        return dict(
            models={"actor": of.engine.chunks},
            optimizers={"actor": of.engine.optimizer},
            schedulers={"actor": of.engine.scheduler},
        )

    fresh = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=0.5, eps=1.0, weight_decay=0.0, use_distributed_optimizer=False),
        model=FLOAT32_LOCAL,
    )
    if vpp == 1:  # the VPP 2 run's checkpoint (saved first), weights only
        load_checkpoint(f"{out_dir}/ckpt_vpp2/{step_dir_name(1)}", groups, weights_only=True, **states(fresh))
        out["converted"] = _params(fresh)
        return out
    step_dir = save_checkpoint(f"{out_dir}/ckpt_vpp2", 1, groups, extra={}, **states(actor))
    load_checkpoint(step_dir, groups, **states(fresh))
    for each in (actor, fresh):
        each.update_policy(batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=PADDED_MICRO_BATCH)
    out["next_update"] = _params(actor)
    out["resumed_next_update"] = _params(fresh)
    return out


def _params(actor) -> dict[str, np.ndarray]:
    return {name: p.detach().clone().numpy() for name, p in actor.named_parameters_for_sync()}


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    """4 layers (one per virtual stage at PP 2 × VPP 2), tied embeddings, a wide init (sharp attention)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("vpp") / "qwen2",
        "qwen2",
        num_hidden_layers=4,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )


@pytest.fixture(scope="module")
def runs(tiny_tied, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("vpp_export")
    advantages = torch.randn(ragged_batch().response_mask.shape, generator=torch.Generator().manual_seed(5))
    return {
        vpp: run_distributed(_rank_main, PP, str(tiny_tied), str(out_dir), vpp, advantages) for vpp in (2, 1)
    }, out_dir


def _max_diff(actual, expected, mask=None) -> float:
    diff = np.abs(actual - expected)
    return float((np.where(mask, diff, 0.0) if mask is not None else diff).max())


def test_chunks_hold_megatrons_round_robin_layers(runs):
    results, _ = runs
    assert [rank["chunks"] for rank in results[2]] == [2, 2]
    assert [rank["layers"] for rank in results[2]] == [[0, 2], [1, 3]]
    assert [rank["layers"] for rank in results[1]] == [[0, 1], [2, 3]]


def test_hf_weights_load_and_export_bit_exact(runs, tiny_tied):
    _, out_dir = runs
    source = load_file(tiny_tied / "model.safetensors")
    exported = {}
    for path in (out_dir / "vpp2").glob("*.safetensors"):
        exported.update(load_file(path))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_forward_passes_equal_vpp_off(runs):
    results, _ = runs
    mask = ragged_batch().response_mask.numpy()
    assert results[2][0]["packed_micro_batches"] % PP, "the packed cut must be an odd count of micro-batches"
    for off, on in zip(results[1], results[2]):
        for name in ("padded", "packed"):
            for key in ("log_probs", "entropy"):
                diff = _max_diff(on[name][key], off[name][key], mask)
                assert diff <= TOLERANCE, f"{name} {key}: VPP differs from VPP off by {diff:.2e}"
        assert _max_diff(on["ref_log_probs"], off["ref_log_probs"], mask) <= TOLERANCE
        assert _max_diff(on["values"], off["values"], mask) <= TOLERANCE


def test_update_equals_vpp_off(runs):
    results, _ = runs
    for off, on in zip(results[1], results[2]):
        assert off["metrics"]["grad_norm"] > 0
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens"):
            assert on["metrics"][key] == pytest.approx(off["metrics"][key], rel=TOLERANCE, abs=TOLERANCE), key
        for key in ("loss", "grad_norm"):
            assert on["critic_metrics"][key] == pytest.approx(
                off["critic_metrics"][key], rel=TOLERANCE, abs=TOLERANCE
            ), f"critic {key}"
    params = {vpp: {name: value for rank in results[vpp] for name, value in rank["params"].items()} for vpp in (1, 2)}
    assert sorted(params[2]) == sorted(params[1])
    for name, value in params[1].items():
        diff = _max_diff(params[2][name], value)
        assert diff <= TOLERANCE, f"{name}: VPP differs from VPP off by {diff:.2e} after one update"


def test_checkpoint_resumes_exactly_and_loads_at_vpp_off(runs):
    results, _ = runs
    for rank in results[2]:
        assert rank["next_update"].keys() == rank["params"].keys()
        assert any(not np.array_equal(rank["next_update"][name], value) for name, value in rank["params"].items())
        for name, value in rank["next_update"].items():
            assert np.array_equal(rank["resumed_next_update"][name], value), name
    saved = {name: value for rank in results[2] for name, value in rank["params"].items()}
    converted = {name: value for rank in results[1] for name, value in rank["converted"].items()}
    assert sorted(converted) == sorted(saved)
    for name, value in saved.items():
        assert np.array_equal(converted[name], value), name
