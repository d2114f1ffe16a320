"""Metric names and their meanings.

Every number the trainer logs has a name in `DOCUMENTED_METRICS` (the e2e test checks the metrics
file against it). Names follow verl's where verl has one (`actor/pg_clipfrac`, `critic/vf_loss`,
`response_length/clip_ratio`, ...), so dashboards and habits carry over.

How per-rank / per-micro-batch values combine into one per step is `megarl.cluster.metric_reduce`.
"""

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from torch import Tensor

from megarl.cluster.memory_metrics import MEMORY_PHASES, MEMORY_ROLES, MEMORY_STATS
from megarl.cluster.timing import PHASES
from megarl.rollout.samples import ENDINGS, TOOL_ERRORS, Trajectory

DOCUMENTED_METRICS: dict[str, str] = {
    "step": "training step (1 = after the first update; 0 = before training, e.g. a first validation)",
    # rollout
    "reward/mean": "mean sequence reward of the step's samples (after penalties such as DAPO's overlong)",
    "reward/std": "population standard deviation of the sequence rewards",
    "reward/max": "highest sequence reward",
    "reward/min": "lowest sequence reward",
    "reward/errors": "samples whose reward function raised (scored 0)",
    "reward/timeouts": "samples whose reward function timed out (scored 0)",
    "reward/failed_samples": "samples scored 0 because of an error or a timeout",
    "response_length/mean": "mean response length in tokens",
    "response_length/max": "longest response in tokens",
    "response_length/min": "shortest response in tokens",
    "response_length/clip_ratio": "fraction of responses cut at the maximum response length",
    "prompt_length/mean": "mean prompt length in tokens",
    "rollout/policy_version_lag/mean": (
        "weight versions the actor is ahead of the engines that generated the step's "
        "samples, mean over the samples (0 in sync; 1 in one_step_off after the "
        "first step; at most trainer.max_staleness in async: trainer.rollout_mode)"
    ),
    "rollout/policy_version_lag/max": "the largest weight-version lag of the step's samples",
    "rollout/token_version_lag/mean": (
        "rollout.partial_rollout: weight versions the actor is ahead of the "
        "weights that sampled each token the model wrote (tool observations left out), mean over them"
    ),
    "rollout/partial_samples": (
        "rollout.partial_rollout: samples whose tokens came from more than one weight "
        "version (a weight update landed while they were generated)"
    ),
    "rollout/carried_groups": (
        "rollout.over_sampling: groups still generating (or finished beyond the batch) when the step's batch "
        "was full, carried into the next step's generation"
    ),
    "rollout/restarted_groups": (
        "rollout.over_sampling: carried groups that would have been more than trainer.max_staleness versions "
        "stale when trained, started over from their prompt"
    ),
    "rollout/stale_dropped_samples": (
        "trainer.rollout_mode async: samples of a batch found more than "
        "trainer.max_staleness versions stale when its step came, dropped and generated "
        "again with the current weights (0 when the bound held at generation)"
    ),
    # actor
    "actor/loss": "actor objective of the update: policy loss - entropy bonus + KL loss (mean over optimizer steps)",
    "actor/pg_loss": "policy-gradient loss (mean over optimizer steps)",
    "actor/kl": "token-mean KL estimate between the current policy and the reference (the actor's KL loss term)",
    "actor/reward_kl_penalty": "token-mean KL(old policy ‖ reference) of the KL penalty in the reward "
    "(algorithm.use_kl_in_reward)",
    "actor/overlong_filtered": "fraction of samples cut at the length limit and left out of the actor's loss "
    "(algorithm.overlong.filter_truncated)",
    "actor/reward_kl_penalty_coeff": "coefficient of the KL penalty in the reward (changes under adaptive KL control)",
    "actor/ppo_kl": "token-mean approximate KL between the rollout-time (old) and the current policy",
    "actor/entropy": "token-mean entropy of the current policy on the responses",
    "actor/pg_clipfrac": "fraction of response tokens where the clipped policy objective was taken",
    "actor/pg_clipfrac_lower": "fraction of tokens with negative advantage capped by the dual clip",
    "actor/grad_norm": "actor gradient norm before clipping (mean over optimizer steps)",
    "actor/lr": "actor learning rate after the update",
    "actor/tokens": "response tokens per actor optimizer step (all DP ranks)",
    "actor/optimizer_steps": "actor optimizer steps attempted in this training step",
    "actor/skipped_steps": "actor optimizer steps skipped for a non-finite loss or gradient",
    "actor/moe/aux_loss": "mixture of experts: the load-balancing loss before its coefficient (1 = balanced; "
    "top-k for a router that sends every token to the same experts), mean over layers and "
    "micro-batches (actor.moe.aux_loss_coeff > 0)",
    "actor/moe/z_loss": "mixture of experts: the router z-loss before its coefficient (mean squared log-sum-exp "
    "of the router logits), mean over layers and micro-batches (actor.moe.z_loss_coeff set)",
    "actor/moe/routing_agreement": "mixture of experts, with routed experts from the engines (actor.moe.router_replay):"
    " the fraction of (token, layer) pairs the rollout routed whose top-k expert set the actor's routers choose "
    "themselves (without replay) in the old-log-prob pass",
    "actor/moe/logprob_gap_no_replay": "token-mean |log π_rollout - log π_actor| on the response tokens, the actor's "
    "routers choosing their own experts (the gap replay removes; actor.moe.router_replay)",
    "actor/moe/logprob_gap_replay": "token-mean |log π_rollout - log π_actor| on the response tokens with the "
    "rollout's routing replayed: the old log-probs the update and the mismatch/* metrics use (actor.moe.router_replay)",
    # engines vs actor on the sampled response tokens, ρ = π_actor / π_rollout (the actor's old log-probs; means
    # over optimizer steps): `megarl.algorithms.rollout_correction.mismatch_metrics`
    "mismatch/kl_k3": "token-mean k3 estimate (ρ - 1 - log ρ) of KL(rollout engines ‖ actor) on the sampled tokens",
    "mismatch/kl_k1": "token-mean direct estimate (log π_rollout - log π_actor) of KL(rollout engines ‖ actor); "
    "unbiased but noisier than k3, may be below 0",
    "mismatch/chi2_token": "token-mean ρ² - 1: χ²(actor ‖ rollout engines) per token (the token weights' variance; "
    "an estimate, a batch may put it slightly below 0)",
    "mismatch/chi2_seq": "sequence-mean (Π_t ρ_t)² - 1: χ²(actor ‖ rollout engines) of whole responses (an estimate)",
    "mismatch/ppl_ratio": "sequence-mean rollout perplexity / actor perplexity of the responses (1: no mismatch)",
    # actor.rollout_correction (only with a level other than none)
    "correction/weight_mean": "token-mean importance weight on the actor's token losses (0 where masked)",
    "correction/out_of_range_tokens": "fraction of response tokens whose ratio left the range: masked (mode mask) "
    "or capped at high (mode truncate)",
    "correction/out_of_range_seqs": "fraction of responses with such a token (at level sequence/geometric: the "
    "whole response's ratio left the range)",
    # critic
    "critic/vf_loss": "clipped value loss (mean over optimizer steps)",
    "critic/vf_clipfrac": "fraction of tokens where the clipped value term was taken",
    "critic/vpred_mean": "token-mean value prediction",
    "critic/grad_norm": "critic gradient norm before clipping (mean over optimizer steps)",
    "critic/lr": "critic learning rate after the update",
    "critic/tokens": "response tokens per critic optimizer step (all DP ranks)",
    "critic/optimizer_steps": "critic optimizer steps attempted in this training step",
    "critic/skipped_steps": "critic optimizer steps skipped for a non-finite loss or gradient",
    # weight sync
    "sync/logprob_max_abs_diff": "largest |log-prob(rollout) - log-prob(actor)| on the probe batch after the sync "
    "(checked steps only: rollout.sync.verify_every)",
    "sync/logprob_mean_abs_diff": "mean |log-prob(rollout) - log-prob(actor)| on the probe batch after the sync "
    "(checked steps only: rollout.sync.verify_every)",
    "sync/checksum_tensors": "HF tensors every rollout worker loaded bit for bit as the actor holds them, in "
    "model.dtype (checked steps only: rollout.sync.verify_every)",
    "sync/weight_version": "weight version of the rollout engines after the sync (+1 per sync)",
    "sync/seconds": "wall time of the weight send (gather, convert, transport)",
    "sync/gigabytes": (
        "gigabytes handed to the transport, summed over the sending ranks (every copy counted: "
        "a colocated ring per rank, a shard sync's pieces per receiver)"
    ),
    "sync/buckets": "buckets handed to the transport",
    "sync/peak_buffer_megabytes": "most bridge buffer memory alive at once on a rank",
    # validation
    "val/reward/mean": "mean sequence reward on the validation prompts",
    "reward/rm_mean": "mean reward-model score of the step's samples (added to the reward function's score)",
    "dapo/rounds": "rollout rounds dynamic sampling needed to fill the step with groups that have reward variation",
    "dapo/groups_kept_ratio": "groups kept by dynamic sampling / groups rolled out",
    "val/response_length/mean": "mean response length on the validation prompts",
    # throughput
    "perf/total_tokens": "prompt + response tokens of the step's samples",
    "perf/tokens_per_s": "perf/total_tokens / timing/step",
    "perf/round_trips": (
        "driver round trips of the step: calls from the driver to a worker group, each answered by its ranks "
        "(generation, hand-over, staging, passes, updates, weight sync, checkpoint, validation)"
    ),
    "perf/update_tflops": (
        "model TFLOP/s of the actor update: matmul FLOPs of forward and backward over the samples' "
        "prompt + response tokens, padding excluded, × actor.ppo_epochs (megarl.models.flops), "
        "/ timing/update_actor"
    ),
    "perf/peak_tflops": (
        "the actor group's matmul peak, all its ranks together: measured at start-up in model.dtype "
        "(megarl.workers.matmul_peak), or trainer.peak_flops"
    ),
    "perf/mfu": "model FLOPs utilisation of the actor update: perf/update_tflops / perf/peak_tflops",
    **{f"timing/{phase}": f"seconds: {meaning}" for phase, meaning in PHASES.items()},
}

AGENT_METRICS: dict[str, str] = {
    "agent/turns/mean": "assistant turns per sample",
    "agent/tool_calls/mean": "tool calls per sample (those the parser rejected included)",
    "agent/tool_call_rate": "fraction of samples that called a tool at least once",
    "agent/tool_errors/mean": "failed tool calls per sample",
    **{
        f"agent/tool_errors/{kind}": f"tool calls per sample that failed as {kind}: {meaning}"
        for kind, meaning in TOOL_ERRORS.items()
    },
    "agent/tool_latency_s/mean": "mean wall time of one tool call",
    "agent/tool_latency_s/max": "longest tool call of the step",
    "agent/masked_token_fraction": "share of response tokens that are tool observations (masked out of the loss)",
    "agent/observations_truncated/mean": "tool results per sample cut to rollout.multi_turn.max_observation_tokens",
    **{f"agent/ended/{how}": f"fraction of samples whose trajectory ended by {how}" for how in ENDINGS},
}
"""The metrics of multi-turn steps only (`rollout.multi_turn.enable`), documented like `DOCUMENTED_METRICS`."""
"""Metric name -> one-line meaning (and `memory/<role>/<phase>/<stat>`: `megarl.cluster.memory_metrics`)."""

MOE_LAYER_STATS: dict[str, str] = {
    "tokens_per_expert": "token copies routed to one expert of the layer in the update (tokens × top-k ÷ experts)",
    "load_min": "the layer's least loaded expert: its tokens ÷ the mean expert's (1 = balanced)",
    "load_max": "the layer's most loaded expert: its tokens ÷ the mean expert's (1 = balanced)",
    "load_cv": "standard deviation ÷ mean of the layer's tokens per expert (0 = balanced)",
}
"""Stat of an `actor/moe/layer_<i>/<stat>` metric (layer i of a mixture of experts, from 0, over the
actor's update: `megarl.workers.moe_metrics`) -> what it is."""
_MOE_LAYER_KEY = re.compile(r"moe_layer_(\d+)_(" + "|".join(MOE_LAYER_STATS) + ")")

_WORKER_NAMES: dict[str, dict[str, str]] = {
    "actor": {
        "loss": "actor/loss",
        "pg_loss": "actor/pg_loss",
        "kl_loss": "actor/kl",
        "entropy": "actor/entropy",
        "clip_frac": "actor/pg_clipfrac",
        "clip_frac_lower": "actor/pg_clipfrac_lower",
        "approx_kl": "actor/ppo_kl",
        "grad_norm": "actor/grad_norm",
        "lr": "actor/lr",
        "tokens": "actor/tokens",
        "steps": "actor/optimizer_steps",
        "skipped_steps": "actor/skipped_steps",
        "moe_aux_loss": "actor/moe/aux_loss",
        "moe_z_loss": "actor/moe/z_loss",
        "routing_agreement": "actor/moe/routing_agreement",
        "logprob_gap_no_replay": "actor/moe/logprob_gap_no_replay",
        "logprob_gap_replay": "actor/moe/logprob_gap_replay",
        "kl_k3": "mismatch/kl_k3",
        "kl_k1": "mismatch/kl_k1",
        "chi2_token": "mismatch/chi2_token",
        "chi2_seq": "mismatch/chi2_seq",
        "ppl_ratio": "mismatch/ppl_ratio",
        "correction_weight_mean": "correction/weight_mean",
        "correction_out_of_range_tokens": "correction/out_of_range_tokens",
        "correction_out_of_range_seqs": "correction/out_of_range_seqs",
    },
    "critic": {
        "loss": "critic/vf_loss",
        "clip_frac": "critic/vf_clipfrac",
        "vpred_mean": "critic/vpred_mean",
        "grad_norm": "critic/grad_norm",
        "lr": "critic/lr",
        "tokens": "critic/tokens",
        "steps": "critic/optimizer_steps",
        "skipped_steps": "critic/skipped_steps",
    },
}
"""Keys of `MegatronActor.update_policy` / `MegatronCritic.update_critic` results -> logged names."""


def worker_metrics(role: Literal["actor", "critic"], update_result: Mapping[str, float]) -> dict[str, float]:
    """An update's result dict under the logged names: `{"clip_frac": 0.1}` -> `{"actor/pg_clipfrac": 0.1}`,
    `{"moe_layer_3_load_max": 1.4}` -> `{"actor/moe/layer_3/load_max": 1.4}`."""
    names = dict(_WORKER_NAMES[role])
    for key in update_result:
        layer = _MOE_LAYER_KEY.fullmatch(key)
        if layer and role == "actor":
            names[key] = f"actor/moe/layer_{layer.group(1)}/{layer.group(2)}"
    unknown = sorted(set(update_result) - set(names))
    if unknown:
        raise KeyError(
            f"{role} update returned metrics without a logged name: {unknown}; add them to "
            "megarl.trainer.metrics._WORKER_NAMES and DOCUMENTED_METRICS"
        )
    return {names[key]: float(value) for key, value in update_result.items()}


def rollout_metrics(
    rewards: Sequence[float],
    response_lengths: Sequence[int],
    max_response_length: int,
    prompt_lengths: Sequence[int],
) -> dict[str, float]:
    """`reward/*`, `response_length/*` and `prompt_length/mean` of one step's samples (`[N]` each);
    a response of `max_response_length` tokens counts as cut (`clip_ratio`)."""
    return {
        "reward/mean": _mean(rewards),
        "reward/std": _pstdev(rewards),
        "reward/max": float(max(rewards)),
        "reward/min": float(min(rewards)),
        "response_length/mean": _mean(response_lengths),
        "response_length/max": float(max(response_lengths)),
        "response_length/min": float(min(response_lengths)),
        "response_length/clip_ratio": _mean([length >= max_response_length for length in response_lengths]),
        "prompt_length/mean": _mean(prompt_lengths),
    }


def agent_metrics(trajectories: Sequence[Trajectory], loss_masks: Sequence[Tensor]) -> dict[str, float]:
    """`agent/*` of one step's multi-turn samples: turns, tool calls and errors per sample, the share of
    samples that called a tool, tool latency, tool results cut to their token cap, how trajectories
    ended, and the share of response tokens that are observations (masked out of the loss)."""
    calls = [t.tool_calls for t in trajectories]
    latencies = [s for t in trajectories for s in t.tool_latency_s]
    errors = Counter()
    for t in trajectories:
        errors.update(t.tool_errors)
    tokens = sum(len(mask) for mask in loss_masks)
    masked = sum(int((~mask).sum()) for mask in loss_masks)
    metrics = {
        "agent/turns/mean": _mean([t.turns for t in trajectories]),
        "agent/tool_calls/mean": _mean(calls),
        "agent/tool_call_rate": _mean([c > 0 for c in calls]),
        "agent/tool_errors/mean": sum(errors.values()) / len(trajectories),
        "agent/tool_latency_s/mean": _mean(latencies) if latencies else 0.0,
        "agent/tool_latency_s/max": max(latencies, default=0.0),
        "agent/masked_token_fraction": masked / tokens if tokens else 0.0,
        "agent/observations_truncated/mean": _mean([t.observations_truncated for t in trajectories]),
    }
    metrics |= {f"agent/tool_errors/{kind}": errors[kind] / len(trajectories) for kind in TOOL_ERRORS}
    ends = Counter(t.ended for t in trajectories)
    return metrics | {f"agent/ended/{how}": ends[how] / len(trajectories) for how in ENDINGS}


def throughput_metrics(total_tokens: int, step_seconds: float) -> dict[str, float]:
    """`perf/total_tokens` (prompt + response tokens of the step) and `perf/tokens_per_s`."""
    return {"perf/total_tokens": float(total_tokens), "perf/tokens_per_s": total_tokens / step_seconds}


def update_mfu_metrics(update_flops: float, update_seconds: float, peak_flops: float) -> dict[str, float]:
    """`perf/update_tflops`, `perf/peak_tflops` and `perf/mfu` of an actor update of `update_flops` model
    FLOPs that took `update_seconds`, on a group whose peak is `peak_flops` FLOP/s."""
    achieved = update_flops / update_seconds
    return {
        "perf/update_tflops": achieved / 1e12,
        "perf/peak_tflops": peak_flops / 1e12,
        "perf/mfu": achieved / peak_flops,
    }


def reward_trend(records: Sequence[Mapping[str, object]], name: str = "reward/mean", window: int = 10) -> str:
    """`name` averaged over the first and over the last `window` steps that logged it (half of them each
    when fewer than 2 × window), the run's end line: "reward/mean 0.123 over steps 1-10 -> 0.812 over steps
    91-100". One value, or none, when fewer than two steps logged it (non-finite values are logged as null)."""
    logged = [(record["step"], record[name]) for record in records if record.get(name) is not None]
    if len(logged) < 2:
        return f"{name} {logged[0][1]:.3f} at step {logged[0][0]}" if logged else f"{name}: no step logged it"
    width = min(window, len(logged) // 2)
    first, last = logged[:width], logged[-width:]
    return (
        f"{name} {_mean([v for _, v in first]):.3f} {_over(first)} -> {_mean([v for _, v in last]):.3f} {_over(last)}"
    )


def _over(logged: Sequence[tuple[int, float]]) -> str:
    first, last = logged[0][0], logged[-1][0]
    return f"at step {first}" if first == last else f"over steps {first}-{last}"


def undocumented(names: Iterable[str]) -> list[str]:
    """The names (sorted) that `DOCUMENTED_METRICS`, `AGENT_METRICS` and the memory catalogue do not explain."""
    return sorted(
        name
        for name in set(names) - set(DOCUMENTED_METRICS) - set(AGENT_METRICS)
        if not _is_memory_metric(name) and not _is_moe_layer_metric(name)
    )


def _is_moe_layer_metric(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) == 4
        and parts[:2] == ["actor", "moe"]
        and re.fullmatch(r"layer_\d+", parts[2]) is not None
        and parts[3] in MOE_LAYER_STATS
    )


def _is_memory_metric(name: str) -> bool:
    parts = name.split("/")
    return (
        len(parts) == 4
        and parts[0] == "memory"
        and parts[1] in MEMORY_ROLES
        and parts[2] in MEMORY_PHASES
        and parts[3] in MEMORY_STATS
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _pstdev(values: Sequence[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
