"""Weight sync: the bridge against the least that moving the same bytes costs, in one run.

- **In-process** (the engine lives in the sender's process, as with `InProcessTransport`):
  `WeightSender.send` into a receiver that takes every bucket's HF-named views (what the engine's
  `load_weights` is handed) vs `clone()` of a buffer of the model's bytes in the sender process.
- **Cross-process** (the shard sync): `ShardSender.send` on every trainer rank, each sending its own
  TP shards to `rollout_tp` receiver ranks that assemble the HF tensors (`receive_shards`), vs a raw
  broadcast from global rank 0 of buffers of the plan's bucket sizes, in the same order, to the
  same receivers (over a broadcast group of its own: rank 0 and the receivers).

Each train layout runs in one trainer world (`run_distributed`); the receiver ranks are threads of
this process (gloo waits with the GIL released), one per receiver and group, each receiving every
bucket into a fresh buffer, as a vLLM worker does. The bridge's first sync of every plan is
compared with the checkpoint, tensor by tensor, on both sides (the benchmark fails otherwise); then
the contenders are timed in turn (`common.time_interleaved`) on global rank 0, each between two
barriers of the trainer world (from when every rank starts until every rank is done).
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
TIMEOUT_S = 1800


@dataclass(frozen=True)
class SyncShape:
    """What one benchmark run covers."""

    train_layouts: tuple[tuple[int, int, tuple[int, ...]], ...] = ((1, 1, (1,)), (2, 1, (1, 2)))
    """(train TP, train PP, rollout TPs of the cross-process runs): one trainer world each; the
    in-process runs use rollout TP 1 (the in-process engine is TP 1)."""
    bucket_mb: tuple[float, ...] = (16, 64, 256)
    """Bucket sizes (MiB) of the plans."""


SMOKE = SyncShape(train_layouts=((2, 1, (1, 2)),), bucket_mb=(0.05, 1))
MODEL_100M = dict(hidden_size=768, num_hidden_layers=16, intermediate_size=2048, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64)
"""The default model of `megarl bench sync`: a Qwen2 of 100.9 M parameters (403 MB in fp32)."""


def broadcast_bucket(group, flat) -> None:
    """The raw baseline: a plain broadcast of a flat buffer from group rank 0 to every rank."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()


def _checkpoint(model_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _check_views(named_tensors, expected: dict, where: str) -> None:
    for name, tensor in named_tensors:
        if not (tensor.shape == expected[name].shape and tensor.equal(expected[name])):
            raise AssertionError(f"sync benchmark: {name} received {where} differs from the checkpoint")


def _unpacking_transport(expected: dict | None):
    """`InProcessTransport` without an engine: hands on each bucket's HF-named views; the first
    send is checked against `expected` (the checkpoint)."""
    from megarl.bridge.transports.base import WeightTransport
    from megarl.bridge.protocol import unpack

    class Unpacking(WeightTransport):
        def __init__(self):
            self.expected = expected

        def send(self, buckets) -> None:
            for flat, metadata in buckets:
                views = unpack(flat, metadata)
                if self.expected is not None:
                    _check_views(views, self.expected, "in-process")
            self.expected = None

    return Unpacking()


def _trainer(model_dir: str, tp: int, pp: int, ports: dict[int, tuple[int, int]], shape: SyncShape,
             repeats: int) -> dict:
    """One trainer rank: for every bucket size, in-process then cross-process per rollout TP.
    `ports`: rollout TP → (broadcast group's port, shard group's port)."""
    import torch
    import torch.distributed as dist

    from megarl.bench.common import time_interleaved
    from megarl.bridge.plan import LayoutPair, build_plan
    from megarl.bridge.shard_send import ShardSender
    from megarl.bridge.sync import WeightSender
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters
    from megarl.bridge.shard_receive import sender_rank
    from megarl.bridge.sync_group import create_weight_sync_group

    groups = initialize_model_parallel(tp, pp, seed=0)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    dims = read_model_dims(model_dir)
    sender_rank0 = dist.get_rank() == 0
    broadcast_groups = {
        r: create_weight_sync_group(HOST, broadcast_port, 0, 1 + r, TIMEOUT_S) if sender_rank0 else None
        for r, (broadcast_port, _) in ports.items()
    }
    shard_groups = {
        r: create_weight_sync_group(HOST, shard_port, sender_rank(LayoutPair(tp, pp, r), groups.pp_rank, groups.tp_rank),
                                    tp * pp + r, TIMEOUT_S)
        for r, (_, shard_port) in ports.items()
    }
    expected = _checkpoint(model_dir) if sender_rank0 else None

    def params():
        return global_named_parameters(model, groups)

    out = dict(in_process=[], cross_process=[])
    for bucket_mb in shape.bucket_mb:
        plan = build_plan(dims, LayoutPair(tp, pp, 1), bucket_mb=bucket_mb)
        sender = WeightSender(plan, params, groups, _unpacking_transport(expected) if sender_rank0 else None)
        stats = [sender.send()]  # checked against the checkpoint
        flat = torch.empty(sum(b.nbytes for b in plan.buckets) // 4).normal_() if sender_rank0 else None

        def clone():
            if flat is not None:
                flat.clone()

        timings = time_interleaved({"bridge": lambda: stats.append(sender.send()), "clone": clone}, repeats)
        out["in_process"].append(_record(plan, bucket_mb, timings, stats, "clone"))
        flat = None  # frees the model-sized buffer before the cross-process runs
        for rollout_tp, broadcast_group in broadcast_groups.items():
            plan = build_plan(dims, LayoutPair(tp, pp, rollout_tp), bucket_mb=bucket_mb)
            shard_sender = ShardSender(plan, params, groups, shard_groups[rollout_tp])
            stats = [shard_sender.send()]  # checked by the receivers
            largest = torch.zeros(max(b.metadata.numel for b in plan.buckets)) if sender_rank0 else None

            # Each between two barriers of the trainer world: timed from when every rank starts until
            # every rank is done, neither overlapping the other contender.
            def bridge():
                dist.barrier()
                stats.append(shard_sender.send())
                dist.barrier()

            def broadcast():
                dist.barrier()
                if largest is not None:
                    for bucket in plan.buckets:
                        broadcast_bucket(broadcast_group, largest[: bucket.metadata.numel])
                dist.barrier()

            timings = time_interleaved({"bridge": bridge, "broadcast": broadcast}, repeats)
            record = _record(plan, bucket_mb, timings, stats, "broadcast")
            out["cross_process"].append(dict(record, rollout_tp=rollout_tp))
    return out


def _record(plan, bucket_mb: float, timings, stats, baseline: str) -> dict:
    """One plan's figures on this rank (the sender's are the ones reported)."""
    return dict(
        bucket_mb=bucket_mb, buckets=len(plan.buckets), bytes=sum(b.nbytes for b in plan.buckets),
        largest_bucket_bytes=max(b.nbytes for b in plan.buckets), seconds=timings.seconds,
        bridge_over_baseline=timings.ratio("bridge", baseline),
        bridge_over_baseline_paired=timings.paired_ratio("bridge", baseline),
        peak_extra_bytes=max(s.peak_buffer_bytes for s in stats),
    )


def _shard_receiver(port: int, rank: int, plans: list, sends: int, expected: dict | None) -> None:
    """Receiver `rank` of a shard group: per plan, `sends` whole syncs assembled by `receive_shards`;
    the first of each plan (the bridge's checked send) compared with `expected` unless None."""
    import torch

    from megarl.bridge.shard_receive import receive_shards
    from megarl.bridge.sync_group import create_weight_sync_group

    layout = plans[0].layout
    group = create_weight_sync_group(HOST, port, rank, layout.train_tp * layout.train_pp + layout.rollout_tp, TIMEOUT_S)
    for plan in plans:
        for send in range(sends):
            views = receive_shards(group, plan, torch.device("cpu"))
            if send == 0 and expected is not None:
                _check_views(views, expected, f"from the shards ({layout})")
            else:
                for _ in views:
                    pass


def _broadcast_receiver(port: int, rank: int, world: int, plans: list, sends: int) -> None:
    """Rank `rank` of a raw-broadcast group: per plan, `sends` whole receives of the plan's buckets,
    each into a fresh buffer."""
    import torch

    from megarl.bridge.sync_group import create_weight_sync_group

    group = create_weight_sync_group(HOST, port, rank, world, TIMEOUT_S)
    for plan in plans:
        for _ in range(sends):
            for metadata in plan.metadatas:
                broadcast_bucket(group, torch.empty(metadata.numel, dtype=metadata.dtype))


def _layout(model_dir: str, tp: int, pp: int, rollout_tps: tuple[int, ...], shape: SyncShape, repeats: int) -> dict:
    """The trainer world of one train layout with its receiver threads; rank 0's figures."""
    from megarl.bridge.plan import LayoutPair, build_plan
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.spawn import free_port, run_distributed
    from megarl.bridge.shard_receive import receiver_rank

    dims = read_model_dims(model_dir)
    ports = {r: (free_port(HOST), free_port(HOST)) for r in rollout_tps}
    receivers = [(r, worker) for r in rollout_tps for worker in range(r)]
    expected = _checkpoint(model_dir)
    plans = {r: [build_plan(dims, LayoutPair(tp, pp, r), bucket_mb=mb) for mb in shape.bucket_mb] for r in rollout_tps}
    with ThreadPoolExecutor(max_workers=1 + 2 * len(receivers)) as pool:
        trainers = pool.submit(run_distributed, _trainer, tp * pp, model_dir, tp, pp, ports, shape, repeats,
                               timeout_s=TIMEOUT_S, collective_timeout_s=TIMEOUT_S)
        received = [
            pool.submit(_shard_receiver, ports[r][1], receiver_rank(plans[r][0].layout, 0, worker), plans[r],
                        2 + repeats,  # the checked send, the warm-up, the timed ones
                        expected if worker == 0 else None)
            for r, worker in receivers
        ] + [
            pool.submit(_broadcast_receiver, ports[r][0], 1 + worker, 1 + r, plans[r], 1 + repeats)
            for r, worker in receivers
        ]
        per_rank = trainers.result()
        for future in received:
            future.result()
    result = per_rank[0]
    for kind in ("in_process", "cross_process"):  # the peak is the worst rank's
        for i, record in enumerate(result[kind]):
            peak = max(rank[kind][i]["peak_extra_bytes"] for rank in per_rank)
            record.update(train_tp=tp, train_pp=pp, peak_extra_bytes=peak)
            record.setdefault("rollout_tp", 1)
    return result


def run(model_dir: str, repeats: int, shape: SyncShape = SyncShape()) -> dict:
    """Every train layout of `shape`, every bucket size; the JSON report."""
    from megarl.bench.common import context, model_summary

    in_process, cross_process = [], []
    for tp, pp, rollout_tps in shape.train_layouts:
        result = _layout(model_dir, tp, pp, rollout_tps, shape, repeats)
        in_process += result["in_process"]
        cross_process += result["cross_process"]
    return dict(
        benchmark="sync", context=context(), model=model_summary(model_dir), repeats=repeats, dtype="float32",
        transport="gloo over loopback", in_process=in_process, cross_process=cross_process,
        goals=goals(in_process, cross_process),
    )


def goals(in_process: list[dict], cross_process: list[dict]) -> dict:
    """The worst case of every figure the issue sets a goal for (ratio of medians, paired ratio)."""
    runs = in_process + cross_process
    return dict(
        in_process_over_clone=max(r["bridge_over_baseline"] for r in in_process),
        in_process_over_clone_paired=max(r["bridge_over_baseline_paired"] for r in in_process),
        cross_process_over_broadcast=max(r["bridge_over_baseline"] for r in cross_process),
        cross_process_over_broadcast_paired=max(r["bridge_over_baseline_paired"] for r in cross_process),
        # "≤ 2 buckets": two of the plan's bucket size (or of its largest bucket, when one parameter exceeds it).
        peak_over_two_buckets=max(r["peak_extra_bytes"] / (2 * max(r["bucket_mb"] * 2**20, r["largest_bucket_bytes"]))
                                  for r in runs),
    )


def markdown(result: dict) -> str:
    gigabytes = result["in_process"][0]["bytes"] / 1e9
    lines = [
        f"sync: {result['model']['parameters'] / 1e6:.1f} M parameters ({gigabytes * 1e3:.0f} MB fp32), median of "
        f"{result['repeats']} after a warm-up; load average {result['context']['load_average_1_5_15_min'][0]:.1f}",
        "| path | train TP/PP → rollout TP | bucket MB (buckets) | bridge s | bridge GB/s | baseline s "
        "| bridge ÷ baseline (paired) | peak extra MB (÷ 2 buckets) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, baseline in (("in_process", "clone"), ("cross_process", "broadcast")):
        for r in result[kind]:
            bridge, base = statistics.median(r["seconds"]["bridge"]), statistics.median(r["seconds"][baseline])
            bound = 2 * max(r["bucket_mb"] * 2**20, r["largest_bucket_bytes"])
            lines.append(
                f"| {kind.replace('_', '-')} vs {baseline} | {r['train_tp']}/{r['train_pp']} → {r['rollout_tp']} | "
                f"{r['bucket_mb']:g} ({r['buckets']}) | {bridge:.3f} | {r['bytes'] / 1e9 / bridge:.2f} | {base:.3f} | "
                f"{r['bridge_over_baseline']:.2f}× ({r['bridge_over_baseline_paired']:.2f}×) | "
                f"{r['peak_extra_bytes'] / 2**20:.1f} ({r['peak_extra_bytes'] / bound:.2f}) |"
            )
    g = result["goals"]
    lines.append(
        f"worst cases: in-process ÷ clone {g['in_process_over_clone']:.2f}× "
        f"(paired {g['in_process_over_clone_paired']:.2f}×; "
        f"goal ≤ 2×), cross-process ÷ raw broadcast {g['cross_process_over_broadcast']:.2f}× (paired "
        f"{g['cross_process_over_broadcast_paired']:.2f}×; goal ≤ 1.5×), peak extra ÷ 2 buckets "
        f"{g['peak_over_two_buckets']:.2f} (goal ≤ 1)"
    )
    return "\n".join(lines)

