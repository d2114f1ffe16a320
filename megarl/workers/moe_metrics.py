"""Per-update metrics of a mixture-of-experts model's routers: how evenly each layer spreads its tokens
over its experts, and megatron-core's router losses.

    load = RouterLoad(model, groups)          # hooks every router of this rank's stage
    ... training forwards and backwards (one update) ...
    metrics = load.take(micro_batches=12)    # the same dict on every rank; counts start again

Keys (the trainer logs them as `actor/moe/...`, `megarl.trainer.metrics`):
- `moe_layer_{i}_tokens_per_expert`: token copies routed to an expert of layer i (global), mean over its
  experts (tokens × top-k ÷ experts), summed over the update's micro-batches and DP ranks;
- `moe_layer_{i}_load_min` / `_load_max`: the least / most loaded expert's tokens ÷ that mean (1 is
  perfect balance; `load_max` × mean is what the busiest EP rank's expert computes);
- `moe_layer_{i}_load_cv`: standard deviation ÷ mean of the experts' token counts;
- `moe_aux_loss`, `moe_z_loss`: the load-balancing loss and the router z-loss before their
  coefficients (megatron's tracker, summed over TP for the former), mean over layers and over all DP
  ranks' micro-batches; present when their coefficient is set.

Counted tokens are every token a training forward routes (grad enabled: not the log-prob passes),
padding included for padded micro-batches (megarl does not pass megatron a padding mask); packed
micro-batches have none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megarl.parallel.distributed import ProcessGroups
from megarl.workers.megatron_train import compute_device

ROUTER_LOSSES = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}
"""megatron's tracker names -> the metric keys."""


class RouterLoad:
    """Tokens per expert of every router of a model stage, counted in training forwards."""

    def __init__(self, chunks: Sequence[torch.nn.Module], groups: ProcessGroups):
        """`chunks`: this rank's stage, one module per virtual stage (any wrapper); its routers'
        `layer_number` is global (1-based)."""
        self.groups = groups
        self.config = chunks[0].config
        routers = [module for chunk in chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        experts = self.config.num_moe_experts or 0
        self.counts = torch.zeros(self.config.num_layers, experts, dtype=torch.float64, device=compute_device())
        """`[L, E]` token copies routed to each expert of each (global) layer since the last `take`."""
        for router in routers:
            router.register_forward_hook(self._count)
        self.active = bool(routers)

    def _count(self, router: TopKRouter, inputs, outputs) -> None:
        if router.training and torch.is_grad_enabled():  # an update's forward (or its recompute), not a log-prob pass
            _, routing_map = outputs  # [tokens, E] bool
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(self.counts)

    def take(self, micro_batches: int) -> dict[str, float]:
        """The metrics of everything counted since the last call (module docstring), the same on every
        rank (collective over TP, PP and DP); {} for a model without experts. `micro_batches`: this
        rank's micro-batches in that time."""
        if not self.active:
            return {}
        metrics = self._router_losses(micro_batches)
        counts = self._all_ranks(self.counts)
        self.counts.zero_()
        for layer, row in enumerate(counts):
            mean = row.mean()
            if mean > 0:
                metrics |= {
                    f"moe_layer_{layer}_tokens_per_expert": mean.item(),
                    f"moe_layer_{layer}_load_min": (row.min() / mean).item(),
                    f"moe_layer_{layer}_load_max": (row.max() / mean).item(),
                    f"moe_layer_{layer}_load_cv": (row.std(unbiased=False) / mean).item(),
                }
        return metrics

    def _all_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over the ranks that routed other tokens: DP (EP ranks included: EP is carved
        out of DP), PP (other layers), and TP under sequence parallelism (other parts of the sequence)."""
        total = counts.clone()
        groups = [self.groups.dp, self.groups.pp] + ([self.groups.tp] if self.config.sequence_parallel else [])
        for group in groups:
            if group.size() > 1:
                dist.all_reduce(total, group=group)
        return total

    def _router_losses(self, micro_batches: int) -> dict[str, float]:
        """megatron's tracked router losses per layer and micro-batch, reduced as megatron's
        `reduce_aux_losses_tracker_across_ranks` does (megatron/core/transformer/moe/moe_utils.py:
        summed over PP and the loss's own group, TP for the load-balancing loss, then averaged over
        DP), with sums (gloo has no AVG), the z-loss averaged over DP too and, under sequence
        parallelism, over the TP ranks' parts of the sequence."""
        tracker = get_moe_layer_wise_logging_tracker()
        metrics = {}
        for name in [name for name in ROUTER_LOSSES if name in tracker]:
            values = tracker[name]["values"].detach().to(torch.float64)
            # The z-loss of a sequence-parallel rank is the mean over its part of the sequence: average over TP.
            tp_parts = self.groups.tp if name == "z_loss" and self.config.sequence_parallel else None
            for group in (self.groups.pp, tracker[name].get("reduce_group"), tp_parts, self.groups.dp):
                if group is not None and group.size() > 1:
                    dist.all_reduce(values, group=group)
            parts = tp_parts.size() if tp_parts is not None else 1
            metrics[ROUTER_LOSSES[name]] = values.sum().item() / self.config.num_layers / parts
        if metrics:
            count = torch.tensor(float(micro_batches), dtype=torch.float64, device=self.counts.device)
            if self.groups.dp.size() > 1:
                dist.all_reduce(count, group=self.groups.dp)  # the DP ranks' micro-batches together
            metrics = {key: value / count.item() for key, value in metrics.items()}
        clear_aux_losses_tracker()
        return metrics


def clear_router_losses() -> None:
    """Forget what megatron's tracker summed so far (another model's update in this process, say)."""
    clear_aux_losses_tracker()
