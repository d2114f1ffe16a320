"""Rollout routing replay (R3, `actor.moe.router_replay`): a mixture-of-experts forward pass that routes every
token through the experts the rollout engine chose for it, and the measure of how often training's own
routing agrees with the rollout's.

The router of a layer picks, per token, the top-k experts of its logits. The engine and the trainer compute
those logits with different kernels (and, off-policy, different weights), so near ties flip and the two
send a token through different experts: the trainer's log-prob of a sampled token is then that of another
function than the one that sampled it (Megatron-LM#4168). Replay takes the engine's choice instead
(`PolicyBatch.routed_experts`) and keeps the router's own gate weights over those experts, so gradients
still reach the router.

megatron-core's `RouterReplay` (megatron/core/transformer/moe/router_replay.py), one per `TopKRouter`
when the model's `TransformerConfig.moe_enable_routing_replay` is set, does the swap inside
`topk_routing_with_score_function` (moe_utils.py): in `REPLAY_FORWARD` the top-k indices are the
replay's target `[tokens, k]` and the probabilities are the scores gathered at them; with no action the
router routes as usual. A router's tokens are its stage's hidden states `[s, b]` flattened sequence-major,
under sequence parallelism only this TP rank's slice of the sequence (megatron splits the first dimension
over the TP group in rank order: `_split_along_first_dim`, tensor_parallel/mappings.py). Expert
parallelism routes before the dispatch, so every EP rank replays its own tokens' global expert ids.

Targets are set right before each micro-batch's forward. Without full activation recompute the backward
does not run the routers again, and a micro-batch's targets are dropped after its forward. With it
(`actor.recompute.granularity: full`), the backward of each recomputed layer runs its router again, later
and, under pipeline parallelism, after the forwards of other micro-batches (1F1B): the targets then stay
queued in megatron's `replay_backward_list` (one per forward, in forward order) and the routers switch
to `REPLAY_BACKWARD`, which pops the oldest. Megatron's schedules run each micro-batch's backward in the
order of its forward on every model chunk, so the queue's head is always the micro-batch being
recomputed. A router that is not recomputed ("block" recompute of fewer layers than a stage holds) keeps
its queue to the end of the pass (`ExpertRouting.close`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor

from megarl.parallel.distributed import ProcessGroups
from megarl.workers.megatron_train import compute_device, run_model
from megarl.workers.micro_batches import MicroBatch

_ROUTERS: weakref.WeakKeyDictionary[torch.nn.Module, list[TopKRouter]] = weakref.WeakKeyDictionary()
"""Each model chunk's routers, found once (a walk over every module of a large model is not free)."""


def stage_routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The routers of a model chunk (any wrapper), one per mixture-of-experts layer it holds."""
    if model not in _ROUTERS:
        _ROUTERS[model] = [module for module in model.modules() if isinstance(module, TopKRouter)]
    return _ROUTERS[model]


def router_tokens(routed_experts: Tensor, router: TopKRouter, groups: ProcessGroups) -> Tensor:
    """`[tokens, k]` int64: the rows of `routed_experts` (`[r, T, L, k]`, a micro-batch's) for `router`'s
    layer, in the order the router sees its tokens (sequence-major; this TP rank's part of the sequence
    under sequence parallelism)."""
    layer = routed_experts[:, :, router.layer_number - 1].transpose(0, 1)  # [T, r, k]; layer_number is global, 1-based
    if router.config.sequence_parallel and groups.tp_size > 1:
        layer = layer.chunk(groups.tp_size, dim=0)[groups.tp_rank]
    return layer.reshape(-1, layer.shape[-1]).long()


class ExpertRouting:
    """How one pass routes its micro-batches: through their `routed_experts` (`replay`) or by the routers'
    own choice; either way it counts, over the tokens the rollout routed, how many (token, layer) pairs the
    routers sent to exactly the rollout's top-k set (`agreement`)."""

    def __init__(self, groups: ProcessGroups, *, replay: bool, sequence_parallel: bool):
        """`sequence_parallel`: the model's (its TP ranks then route different tokens)."""
        self.groups = groups
        self.replay = replay
        self.sequence_parallel = sequence_parallel
        self.counts = torch.zeros(2, dtype=torch.float64, device=compute_device())
        """[agreeing (token, layer) pairs, pairs with a rollout routing] of this rank's routers so far."""
        self.queued: set[TopKRouter] = set()
        """Routers whose targets wait for the backward's recompute (cleared by `close`)."""

    def forward(self, model: torch.nn.Module, micro_batch: MicroBatch) -> Tensor:
        """`run_model(model, micro_batch)`, routed as this pass says. A micro-batch without routed experts,
        or a dense model, runs as is."""
        routers = stage_routers(model)
        if micro_batch.routed_experts is None or not routers:
            return run_model(model, micro_batch)
        targets = [router_tokens(micro_batch.routed_experts, router, self.groups) for router in routers]
        hooks = [
            router.register_forward_hook(self._count_agreement(target))
            for router, target in zip(routers, targets, strict=True)
        ]
        recomputed = self.replay and recomputes_routers(model)
        if self.replay:
            for router, target in zip(routers, targets, strict=True):
                replay_through(router, target, queue=recomputed)
        if recomputed:
            self.queued.update(routers)
        try:
            output = run_model(model, micro_batch)
        finally:
            for hook in hooks:
                hook.remove()
            if not recomputed:
                clear(routers)
        if recomputed:
            for router in routers:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return output

    def close(self) -> None:
        """End the pass: drop the targets still queued for a recompute (call after the pass's schedule,
        whether it finished or raised)."""
        clear(self.queued)
        self.queued.clear()

    def _count_agreement(self, target: Tensor):
        def count(router: TopKRouter, inputs, outputs) -> None:
            _, routing_map = outputs  # [tokens, E] bool: the experts each token was sent to
            known = (target >= 0).all(dim=-1)
            # Top-k sets are equal iff every rollout expert is among the k chosen ones.
            chosen = routing_map[known].gather(1, target[known])
            self.counts += torch.stack([chosen.all(dim=-1).sum(), known.sum()]).to(self.counts)

        return count

    def agreement(self) -> float | None:
        """The fraction of (token, layer) pairs with a rollout routing whose routing agreed, over every
        rank (sums over TP under sequence parallelism: other tokens; PP: other layers; DP: other samples);
        None when no pair had one. Collective over the model's groups."""
        total = self.counts.clone()
        for group in (self.groups.dp, self.groups.pp, self.groups.tp if self.sequence_parallel else None):
            if group is not None and group.size() > 1:
                torch.distributed.all_reduce(total, group=group)
        return None if total[1] == 0 else (total[0] / total[1]).item()


def recomputes_routers(model: torch.nn.Module) -> bool:
    """The backward of `model`'s forward runs its routers again: full activation recompute while training
    (megatron's `TransformerBlock.forward` checkpoints its layers only then)."""
    return model.config.recompute_granularity == "full" and model.training and torch.is_grad_enabled()


def replay_through(router: TopKRouter, target: Tensor, *, queue: bool) -> None:
    """Make `router`'s next forward route its tokens to `target` (`[tokens, k]` global expert ids; rows of
    -1, padding, go to experts 0..k-1, which nothing reads). `queue`: keep the targets of earlier forwards
    queued for their backward's recompute (else they are dropped)."""
    if router.router_replay is None:
        raise ValueError(
            "routing replay on a model built without it: build the model with actor.moe.router_replay "
            "(TransformerConfig.moe_enable_routing_replay)"
        )
    unknown = (target < 0).any(dim=-1, keepdim=True)
    fallback = torch.arange(target.shape[-1], device=target.device).expand_as(target)
    if not queue:
        router.router_replay.clear_indices()
    router.router_replay.set_target_indices(torch.where(unknown, fallback, target))
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear(routers: Iterable[TopKRouter]) -> None:
    """Drop `routers`' replay targets (queued ones too) and action: they route by their own choice again."""
    for router in routers:
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
