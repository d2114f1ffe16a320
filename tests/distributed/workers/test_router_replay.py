"""Rollout routing replay on a tiny Qwen3-MoE (8 experts, top-2) through real megatron-core ranks.

The routing a rollout would return is made two ways, outside Megatron: transformers' own routers on each
sample's tokens (the "natural" routing of the same weights), and a random expert assignment. Replaying
the natural routing must give the log-probs of an unreplayed pass (so replay puts each token's experts at
the right token and layer: the sequence-parallel slice, the pipeline stage's layers, the packed rows), and
the routers' own choice must agree with it everywhere; replaying the random assignment must route every
token exactly there (`ExpertRouting.agreement` == 1), change the log-probs, give the same log-probs in
padded and packed micro-batches, and make the update's forward reproduce the old log-probs (a PPO
ratio of exactly 1 in its first step: the update replays too).

Layouts (2 ranks each): TP2 with sequence parallelism × EP2 (each EP rank 4 experts), and PP2.

End to end (one rank): the HF rollout engine's returned routing reaches the batch, and replaying it narrows
the actor's log-prob gap to the engine.
"""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from worker_batches import BATCH_SIZE, PROMPT_LEN, RESPONSE_LEN, ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.bridge import InProcessTensors
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

EXPERTS, TOP_K, LAYERS = 8, 2, 2


def _rank_main(model_dir: str, natural: torch.Tensor, forced: torch.Tensor, tp: int, pp: int, ep: int) -> dict:
    from megarl.config.roles import ActorConfig, MoeConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss, compute_log_probs
    from megarl.workers.packing import TokenBudget

    groups = initialize_model_parallel(tp, pp, seed=0, ep=ep, etp=1)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
        moe=MoeConfig(router_replay=True),
        sequence_parallel=tp > 1,
        model=FLOAT32_LOCAL,
    )
    batch = ragged_batch()  # DP 1 in both layouts: every rank holds the whole batch
    batch.rollout_log_probs = torch.zeros(batch.responses.shape)
    plain, _ = actor.compute_log_prob(batch, micro_batch_size=4)

    replayed_natural, _ = actor.compute_log_prob(dataclasses.replace(batch, routed_experts=natural), micro_batch_size=4)
    natural_metrics = actor.routing_metrics

    forced_batch = dataclasses.replace(batch, routed_experts=forced)
    routing = actor.routing(replay=True)
    args = (actor.engine.chunks, forced_batch)
    padded, _ = compute_log_probs(*args, 4, actor.vocab_size, groups, routing=routing)
    packed, _ = compute_log_probs(
        *args,
        TokenBudget(PROMPT_LEN + RESPONSE_LEN, "test"),
        actor.vocab_size,
        groups,
        routing=actor.routing(replay=True),
    )
    old, _ = actor.compute_log_prob(forced_batch, micro_batch_size=4)
    forced_batch.old_log_probs = old
    forced_batch.advantages = torch.ones_like(old)
    update = actor.update_policy(
        forced_batch, PolicyLoss(ActorConfig()), mini_batch_size=BATCH_SIZE, micro_batch_size=4
    )
    return dict(
        plain=plain,
        replayed_natural=replayed_natural,
        natural_metrics=natural_metrics,
        forced_agreement=routing.agreement(),
        padded=padded,
        packed=packed,
        old=old,
        update=update,
    )


@pytest.fixture(scope="module")
def sharp_moe(tmp_path_factory):
    """A tiny Qwen3-MoE whose router logits lie far apart (random unit-scale gate weights), so that float
    rounding between layouts or frameworks flips no expert choice."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("r3") / "qwen3_moe", "qwen3_moe", seed=5, initializer_range=0.1)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(tensor.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def natural_routing(model_dir) -> torch.Tensor:
    """`[B, P + R, L, k]` transformers' routing of each sample's real prompt tokens and its whole response row
    (padding after the response is causally invisible to the tokens before it), -1 on the prompt padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = ragged_batch()
    out = torch.full((BATCH_SIZE, PROMPT_LEN + RESPONSE_LEN, LAYERS, TOP_K), -1, dtype=torch.int16)
    for i in range(BATCH_SIZE):
        tokens = torch.cat([batch.prompts[i][batch.prompt_mask[i]], batch.responses[i]])
        chosen = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda module, inputs, outputs: chosen.append(outputs[2]))
            for layer in model.model.layers
        ]
        with torch.no_grad():
            model(tokens[None])
        for hook in hooks:
            hook.remove()
        out[i, PROMPT_LEN + RESPONSE_LEN - len(tokens) :] = torch.stack(chosen, dim=1).to(torch.int16)
    return out


def random_routing() -> torch.Tensor:
    """`[B, P + R, L, k]` distinct random experts per token and layer, -1 on the prompt padding."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(BATCH_SIZE, PROMPT_LEN + RESPONSE_LEN, LAYERS, EXPERTS, generator=gen)
    forced = scores.topk(TOP_K, dim=-1).indices.to(torch.int16)
    forced[:, :PROMPT_LEN][~ragged_batch().prompt_mask] = -1
    return forced


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (1, 2, 1)], ids=["tp2-sp-ep2", "pp2"])
def test_replay_routes_through_the_given_experts(sharp_moe, tp, pp, ep):
    natural, forced = natural_routing(sharp_moe), random_routing()
    ranks = run_distributed(_rank_main, 2, str(sharp_moe), natural, forced, tp, pp, ep, timeout_s=600)
    mask = ragged_batch().response_mask
    for rank in ranks:
        assert rank["natural_metrics"]["routing_agreement"] == 1.0, "the routers choose what transformers chose"
        torch.testing.assert_close(rank["replayed_natural"][mask], rank["plain"][mask], atol=1e-5, rtol=0)
        assert rank["forced_agreement"] == 1.0, "every token went to exactly its given experts"
        assert (rank["padded"] - rank["plain"])[mask].abs().max() > 0.1, "other experts, other log-probs"
        torch.testing.assert_close(rank["packed"][mask], rank["padded"][mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(rank["old"][mask], rank["padded"][mask], atol=0, rtol=0)
        update = rank["update"]
        assert abs(update["approx_kl"]) < 1e-6 and update["clip_frac"] == 0, "the update replayed as the old pass did"
        assert update["routing_agreement"] < 0.5, "the routers' own choice rarely matches a random assignment"
        assert update["logprob_gap_replay"] != update["logprob_gap_no_replay"]


def _measure_main(model_dir: str, batch) -> dict:
    from megarl.config.roles import MoeConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, compute_log_probs
    from megarl.workers.reference import MegatronReference

    groups = initialize_model_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
        moe=MoeConfig(router_replay=True),
        model=FLOAT32_LOCAL,
    )
    old, _ = actor.compute_log_prob(batch, micro_batch_size=8)
    routing = actor.routing(replay=True)
    compute_log_probs(actor.engine.chunks, batch, 8, actor.vocab_size, groups, routing=routing)
    reference = MegatronReference.from_hf(model_dir, groups, router_replay=True, model=FLOAT32_LOCAL)
    return dict(
        metrics=actor.routing_metrics,
        replayed_agreement=routing.agreement(),
        old=old,
        ref=reference.compute_ref_log_prob(batch, micro_batch_size=8),
    )


def test_an_engines_routing_reaches_the_batch_and_replay_narrows_the_gap(tmp_path):
    """The HF rollout engine generates with the router weights of a step before (the actor's plus noise, as
    off-policy engines have): its routing arrives in the batch for every token it fed, the actor's own routing
    disagrees with it on many tokens, replay follows it exactly and narrows the log-prob gap to the engine;
    the reference replays as the actor does."""
    from megarl.data import Prompt
    from megarl.rollout.samples import flatten_rollouts
    from megarl.trainer.rollout_batch import policy_batch
    from megarl.workers.rollout import SamplingConfig, make_rollout_engine
    from megarl.workers.rollout.engine_args import EngineArgs

    actor_dir = make_tiny_model(tmp_path / "actor", "qwen3_moe", seed=0, initializer_range=0.1)
    engine_dir = make_tiny_model(tmp_path / "engine", "qwen3_moe", seed=0, initializer_range=0.1)
    tensors = load_file(engine_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, weight in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = weight + 0.3 * weight.std() * torch.randn(weight.shape, generator=gen)
    save_file(tensors, engine_dir / "model.safetensors", metadata={"format": "pt"})
    engine = make_rollout_engine("hf", EngineArgs(engine_dir, dtype="float32", return_routed_experts=True))
    prompts = [Prompt(f"p{i}", tuple(range(3 + i, 8 + 2 * i)), "", {}, "t") for i in range(4)]
    outputs = engine.generate([p.token_ids for p in prompts], SamplingConfig(n=4, max_new_tokens=12, seed=3))
    engine.shutdown()
    samples = flatten_rollouts(prompts, outputs, "g")
    batch = policy_batch(samples, response_length=12)
    fed = (batch.routed_experts >= 0).all(dim=-1).all(dim=-1)
    assert fed.sum() == sum(len(p.token_ids) + len(r) - 1 for p, r in zip(samples.prompts, samples.response_ids))

    (result,) = run_distributed(_measure_main, 1, str(actor_dir), batch, timeout_s=600)
    metrics = result["metrics"]
    assert metrics["routing_agreement"] < 0.9, "the stale router picked other experts for many tokens"
    assert result["replayed_agreement"] == 1.0
    assert metrics["logprob_gap_replay"] < 0.6 * metrics["logprob_gap_no_replay"]
    mask = batch.response_mask
    torch.testing.assert_close(result["ref"][mask], result["old"][mask], atol=0, rtol=0)


def _recompute_main(model_dir: str, forced: torch.Tensor, pp: int, method: str | None) -> dict:
    from megarl.config.roles import ActorConfig, MoeConfig, OptimizerConfig, RecomputeConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.router_replay import stage_routers

    groups = initialize_model_parallel(1, pp, seed=0)
    recompute = RecomputeConfig(granularity="full", method=method, num_layers=1) if method else RecomputeConfig()
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-2, weight_decay=0.0, use_distributed_optimizer=False),
        moe=MoeConfig(aux_loss_coeff=0.0, router_replay=True),
        recompute=recompute,
        model=FLOAT32_LOCAL,
    )
    batch = ragged_batch()
    batch.rollout_log_probs = torch.zeros(batch.responses.shape)
    batch = dataclasses.replace(batch, routed_experts=forced)
    batch.old_log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=2)
    batch.advantages = torch.linspace(-1, 1, BATCH_SIZE)[:, None].expand_as(batch.old_log_probs).clone()
    update = actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=BATCH_SIZE, micro_batch_size=2)
    after, _ = actor.compute_log_prob(batch, micro_batch_size=2)
    routers = [router for chunk in actor.engine.chunks for router in stage_routers(chunk)]
    return dict(update=update, after=after, left=[len(router.router_replay.replay_backward_list) for router in routers])


@pytest.mark.parametrize("pp,method", [(2, "uniform"), (1, "block")], ids=["pp2-every-layer", "pp1-first-layer"])
def test_a_full_recompute_replays_the_routing_of_each_micro_batchs_forward(sharp_moe, pp, method):
    """With layers recomputed in the backward, the update through a random routing equals the update without
    recompute: each recomputed router took its own micro-batch's experts again, though at PP 2 the 1F1B
    schedule runs the next micro-batch's forward before this one's backward (the targets wait in megatron's
    queue); and no target stays queued after the update, also for the layer "block" recompute leaves alone.
    The load-balancing loss is off: megatron-core's block recompute runs the layers it leaves alone without the
    padding mask, so with it the "block" update differs (by 7e-6 in the grad norm, replay or not; validate
    refuses that layout on a mixture of experts)."""
    forced = random_routing()
    plain = run_distributed(_recompute_main, pp, str(sharp_moe), forced, pp, None, timeout_s=600)
    recomputed = run_distributed(_recompute_main, pp, str(sharp_moe), forced, pp, method, timeout_s=600)
    mask = ragged_batch().response_mask
    for one, other in zip(plain, recomputed, strict=True):
        assert other["update"]["grad_norm"] == pytest.approx(one["update"]["grad_norm"], rel=1e-6)
        assert other["update"]["loss"] == pytest.approx(one["update"]["loss"], rel=1e-6)
        torch.testing.assert_close(other["after"][mask], one["after"][mask], atol=1e-6, rtol=0)
        assert other["left"] == [0] * len(other["left"]) and other["left"], (
            "a router's replay queue outlived the update"
        )


def routing_under(model_dir, tensors: dict, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), L, k]` transformers' routing of `tokens` in one forward, with `tensors` loaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda module, inputs, outputs: chosen.append(outputs[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1).to(torch.int16)


def test_a_partial_rollouts_routing_is_each_segments_own(sharp_moe):
    """Partial rollouts through the HF engine with a weight load between two segments that changes the routers:
    each token's routing is the one the weights of the segment that fed it first chose (a forward of the whole
    sequence under those weights), not the later segment's prefill of it under the new weights."""
    from megarl.data import Prompt
    from megarl.rollout.partial import partial_single_turn
    from megarl.workers.rollout import SamplingConfig, make_rollout_engine
    from megarl.workers.rollout.engine_args import EngineArgs

    engine = make_rollout_engine("hf", EngineArgs(sharp_moe, dtype="float32", return_routed_experts=True))
    first = load_file(sharp_moe / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    second = {
        name: torch.randn(tensor.shape, generator=gen) if name.endswith("mlp.gate.weight") else tensor
        for name, tensor in first.items()
    }
    loads = iter([None, second])

    class Engines:  # the one engine as `generate_contexts` reaches a WorkerGroup
        world_size = 1

        def call_each(self, method, args):
            return [getattr(engine, method)(*args[0])]

    def between_segments() -> int:
        tensors = next(loads, None)
        if tensors is not None:
            engine.receive(InProcessTensors(tensors.items())).result()
        return engine.weight_version

    prompts = [Prompt(f"p{i}", tuple(range(3 + i, 9 + 2 * i)), "", {}, "t") for i in range(3)]
    samples = partial_single_turn(
        Engines(), 4, between_segments, prompts, SamplingConfig(n=1, max_new_tokens=9, seed=3), "g"
    )
    engine.shutdown()
    flipped = 0
    for prompt, ids, versions, routed in zip(
        samples.prompts, samples.response_ids, samples.token_versions, samples.routed_experts, strict=True
    ):
        tokens, p = [*prompt.token_ids, *ids], len(prompt.token_ids)
        under = {
            v: routing_under(sharp_moe, tensors, tokens)[:-1]
            for v, tensors in zip(sorted(set(versions)), (first, second))
        }
        feeder = torch.tensor([versions[max(q - p + 1, 0)] for q in range(len(tokens) - 1)])
        for version, expected in under.items():
            mine = feeder == version
            assert torch.equal(routed[mine].sort(-1).values, expected[mine].sort(-1).values), f"version {version}"
        if len(under) == 2:
            flipped += (under[min(under)] != under[max(under)])[feeder == min(under)].any(-1).sum().item()
    assert flipped > 0, "the second weights route some earlier token otherwise: the test tells the rules apart"
