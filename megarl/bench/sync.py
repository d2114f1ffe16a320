"""Weight sync: the bridge against the least that moving the same bytes costs, in one run.

- **In-process** (the engine lives in the sender's process, as with `InProcessTransport`):
  `WeightSender.send` into a receiver that takes every bucket's HF-named views (what the engine's
  in-process source, `InProcessTensors`, holds) vs `clone()` of a buffer of the model's bytes in the sender process.
- **Cross-process** (the shard sync, `bridge.shard_sync`): `ShardSender.send` on every trainer rank,
  each sending each rollout worker only the pieces of its shards that the worker's vLLM TP shard
  needs (the planner's schedule), received and assembled by the workers (`receive_rank_shards`), vs
  the raw transfer of the same bytes between the same ranks: per bucket, one plain send of a flat
  buffer of each sender's bytes for each worker, received into a fresh buffer of the bucket's size.
  Reported per rank: the bytes each trainer rank sent and what the workers it sends to need (their
  shards' bytes), and the bytes each worker received and needs (its shard).

Each train layout runs in one trainer world (`run_distributed`); the receiver ranks are threads of
this process (gloo waits with the GIL released), one per worker, each receiving every bucket into
a fresh buffer, as a vLLM worker does. The bridge's first sync of every plan is checked: in-process
tensor by tensor against the checkpoint, cross-process by the exact checksums of every worker's
tensors (`checksum.VllmRankLayout`, as a vLLM worker records them) against the checkpoint's (the
benchmark fails otherwise); then the contenders are timed in turn (`common.time_interleaved`) on
global rank 0, each between two barriers of the trainer world (from when every rank starts until
every rank is done).
"""

from __future__ import annotations

import dataclasses
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
TIMEOUT_S = 1800
CONTENDERS = ("bridge", "raw")
"""The cross-process contenders, in the order `time_interleaved` is given them (the receivers replay it)."""


@dataclass(frozen=True)
class SyncShape:
    """What one benchmark run covers."""

    train_layouts: tuple[tuple[int, int, tuple[int, ...]], ...] = ((1, 1, (2,)), (2, 1, (1, 2)), (1, 2, (1,)))
    """(train TP, train PP, rollout TPs of the cross-process runs): one trainer world each; the
    in-process runs use rollout TP 1 (the in-process engine is TP 1)."""
    bucket_mb: tuple[float, ...] = (64,)
    """Bucket sizes (MiB) of the plans."""
    expert_layouts: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ((1, 1, 2, (1, 2)),)
    """A mixture-of-experts model's too: (train TP, train PP, train EP, rollout TPs), cross-process only (each
    expert sent by the EP rank holding it; the in-process sync gathers over TP and refuses experts split)."""


SMOKE = SyncShape(train_layouts=((2, 1, (1, 2)),), bucket_mb=(0.05, 1), expert_layouts=((1, 1, 2, (1, 2)),))
MODEL_100M = dict(
    hidden_size=768,
    num_hidden_layers=16,
    intermediate_size=2048,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
)
"""The default model of `megarl bench sync`: a Qwen2 of 100.9 M parameters (403 MB in fp32)."""


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
    from megarl.bridge.protocol import unpack
    from megarl.bridge.transports.base import WeightTransport

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


def raw_sizes(schedule, sender: int) -> list[tuple[int, int, int]]:
    """`(tag, worker, elements)`: what the raw contender sends, one buffer per bucket and worker of
    `sender`, the same bytes as its pieces, in the schedule's order."""
    sizes: dict[tuple[int, int], int] = {}
    for tag, piece in schedule.sent_by(sender):
        sizes[tag, piece.worker] = sizes.get((tag, piece.worker), 0) + piece.numel
    return [(tag, worker, numel) for (tag, worker), numel in sizes.items()]


def _trainer(model_dir: str, tp: int, pp: int, ep: int, ports: dict[int, int], shape: SyncShape, repeats: int) -> dict:
    """One trainer rank: for every bucket size, in-process (EP 1) then cross-process per rollout TP.
    `ports`: rollout TP → its sync group's port. Ranks that send nothing (DP replicas) join the timing."""
    import torch
    import torch.distributed as dist

    from megarl.bench.common import time_interleaved
    from megarl.bridge import LayoutPair, ShardSender, build_plan, build_schedule, receiver_rank
    from megarl.bridge.collect import sync_rank
    from megarl.bridge.sync_group import create_weight_sync_group
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.models.hf_config import read_model_dims
    from megarl.models.layout import VOCAB_DIVISIBLE_BY
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(tp, pp, seed=0, ep=ep)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    dims = read_model_dims(model_dir)
    sender_rank0 = dist.get_rank() == 0
    train = LayoutPair(tp, pp, 1, train_ep=ep)
    me = sync_rank(train, groups)  # the same for every rollout TP; None: sends nothing
    sync_groups = {
        r: None if me is None else create_weight_sync_group(HOST, port, me, train.senders + r, TIMEOUT_S)
        for r, port in ports.items()
    }
    expected = _checkpoint(model_dir) if sender_rank0 else None

    def params():
        return global_named_parameters(model, groups)

    out = dict(pp_rank=groups.pp_rank, tp_rank=groups.tp_rank, ep_rank=groups.ep_rank, sync_rank=me)
    out.update(in_process=[], cross_process=[])
    for bucket_mb in shape.bucket_mb:
        if ep == 1:
            _in_process(out, dims, train, bucket_mb, params, groups, expected, repeats)
        for rollout_tp, group in sync_groups.items():
            plan = build_plan(dims, dataclasses.replace(train, rollout_tp=rollout_tp), bucket_mb=bucket_mb)
            schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
            shard_sender = ShardSender(plan, params, groups, group)
            stats = [shard_sender.send()]  # checked by the receivers
            sizes = raw_sizes(schedule, me)
            largest = torch.zeros(max((numel for _, _, numel in sizes), default=0))

            # Each between two barriers of the trainer world: timed from when every rank starts until
            # every rank is done, neither overlapping the other contender.
            def bridge():
                dist.barrier()
                stats.append(shard_sender.send())
                dist.barrier()

            def raw():
                dist.barrier()
                works = [
                    group.send([largest[:numel]], receiver_rank(plan.layout, 0, worker), tag)
                    for tag, worker, numel in sizes
                ]
                for work in works:
                    work.wait()
                dist.barrier()

            timings = time_interleaved(dict(zip(CONTENDERS, (bridge, raw))), repeats)
            record = _record(plan, bucket_mb, timings, stats, "raw")
            workers = {piece.worker for _, piece in schedule.sent_by(me)}
            record.update(
                rollout_tp=rollout_tp,
                bytes_sent=stats[0].bytes_sent,
                receivers_need=sum(schedule.bytes_needed(w) for w in workers),
            )
            out["cross_process"].append(record)
    return out


def _in_process(out: dict, dims, train, bucket_mb: float, params, groups, expected, repeats: int) -> None:
    """The in-process contenders of one bucket size (the gathering sync vs a clone), into `out`."""
    import torch
    import torch.distributed as dist

    from megarl.bench.common import time_interleaved
    from megarl.bridge import build_plan
    from megarl.bridge.sync import WeightSender

    sender_rank0 = dist.get_rank() == 0
    plan = build_plan(dims, train, bucket_mb=bucket_mb)
    sender = WeightSender(plan, params, groups, _unpacking_transport(expected) if sender_rank0 else None)
    stats = [sender.send()]  # checked against the checkpoint
    flat = torch.empty(sum(b.nbytes for b in plan.buckets) // 4).normal_() if sender_rank0 else None

    def clone():
        if flat is not None:
            flat.clone()

    timings = time_interleaved({"bridge": lambda: stats.append(sender.send()), "clone": clone}, repeats)
    out["in_process"].append(_record(plan, bucket_mb, timings, stats, "clone"))


def _record(plan, bucket_mb: float, timings, stats, baseline: str) -> dict:
    """One plan's figures on this rank (the sender's are the ones reported)."""
    return dict(
        bucket_mb=bucket_mb,
        buckets=len(plan.buckets),
        bytes=sum(b.nbytes for b in plan.buckets),
        largest_bucket_bytes=max(b.nbytes for b in plan.buckets),
        seconds=timings.seconds,
        bridge_over_baseline=timings.ratio("bridge", baseline),
        bridge_over_baseline_paired=timings.paired_ratio("bridge", baseline),
        peak_extra_bytes=max(s.peak_buffer_bytes for s in stats),
    )


class _CountingGroup:
    """A receiver's sync group, counting the bytes it receives."""

    def __init__(self, group):
        self.group, self.received = group, 0

    def recv(self, tensors, src: int, tag: int):
        self.received += sum(t.nbytes for t in tensors)
        return self.group.recv(tensors, src, tag)


def _receiver(port: int, worker: int, plans: list, repeats: int) -> list[dict]:
    """Worker `worker` of one engine: per plan, the checked bridge sync (its checksums, as a vLLM
    worker records them, and the bytes it received), then the timed contenders in their order."""
    import torch

    from megarl.bench.common import interleaved_order
    from megarl.bridge import (
        LoadedChecksums,
        VllmRankLayout,
        build_schedule,
        receive_rank_shards,
        receiver_rank,
        recorded,
    )
    from megarl.bridge.sync_group import create_weight_sync_group
    from megarl.models.layout import VOCAB_DIVISIBLE_BY

    layout = plans[0].layout
    group = create_weight_sync_group(
        HOST, port, receiver_rank(layout, 0, worker), layout.senders + layout.rollout_tp, TIMEOUT_S
    )
    cpu = torch.device("cpu")
    checked = []
    for plan in plans:
        counting, record = _CountingGroup(group), LoadedChecksums("float32")
        for _ in recorded(
            receive_rank_shards(counting, plan, worker, cpu),
            record,
            VllmRankLayout(plan.dims, layout.rollout_tp, worker),
        ):
            pass
        schedule = build_schedule(plan, VOCAB_DIVISIBLE_BY)
        checked.append(
            dict(
                record=record,
                worker=worker,
                bytes_received=counting.received,
                bytes_needed=schedule.bytes_needed(worker),
            )
        )
        for name in interleaved_order(list(CONTENDERS), repeats):
            if name == "bridge":
                for _ in receive_rank_shards(group, plan, worker, cpu):
                    pass
            else:
                _receive_raw(group, schedule, worker)
    return checked


def _receive_raw(group, schedule, worker: int) -> None:
    """The raw contender's far side: per bucket, a fresh buffer of the worker's bytes, each sender's
    part received into it."""
    import torch

    for tag, bucket in enumerate(schedule.buckets):
        parts: dict[int, int] = {}
        for piece in bucket.pieces:
            if piece.worker == worker:
                parts[piece.sender] = parts.get(piece.sender, 0) + piece.numel
        flat = torch.empty(sum(parts.values()))
        works, offset = [], 0
        for sender, numel in parts.items():
            works.append(group.recv([flat[offset : offset + numel]], sender, tag))
            offset += numel
        for work in works:
            work.wait()


def _layout(
    model_dir: str, tp: int, pp: int, rollout_tps: tuple[int, ...], shape: SyncShape, repeats: int, ep: int = 1
) -> dict:
    """The trainer world of one train layout (EP `ep`: TP × EP ranks a stage) with its receiver threads;
    rank 0's timings, every sending rank's and every worker's bytes, each first cross-process sync checked
    exactly."""
    import torch

    from megarl.bridge import LayoutPair, build_plan
    from megarl.bridge.checksum import check_checksums, tensor_checksum
    from megarl.bridge.sync_group import listen_weight_sync_store
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.spawn import run_distributed

    dims = read_model_dims(model_dir)
    # Listening before any rank starts: receivers need not wait out TCPStore's connect backoff while
    # trainer rank 0 spawns (as `megarl.workers.sync_check.run_sync_check`).
    train = LayoutPair(tp, pp, 1, train_ep=ep)
    stores = {r: listen_weight_sync_store(HOST, train.senders + r, TIMEOUT_S) for r in rollout_tps}
    ports = {r: store.port for r, store in stores.items()}
    plans = {
        r: [build_plan(dims, dataclasses.replace(train, rollout_tp=r), bucket_mb=mb) for mb in shape.bucket_mb]
        for r in rollout_tps
    }
    expected = {name: tensor_checksum(tensor, torch.float32) for name, tensor in _checkpoint(model_dir).items()}
    with ThreadPoolExecutor(max_workers=1 + sum(rollout_tps)) as pool:
        trainers = pool.submit(
            run_distributed,
            _trainer,
            tp * pp * ep,
            model_dir,
            tp,
            pp,
            ep,
            ports,
            shape,
            repeats,
            timeout_s=TIMEOUT_S,
            collective_timeout_s=TIMEOUT_S,
        )
        received = {
            r: [pool.submit(_receiver, ports[r], worker, plans[r], repeats) for worker in range(r)] for r in rollout_tps
        }
        try:
            per_rank = trainers.result()
            checked = {r: [future.result() for future in futures] for r, futures in received.items()}
        except BaseException:  # a stop signal or a failed rank: the receivers must not wait out TIMEOUT_S
            stores.clear()  # their rendezvous servers go: a receiver still waiting there fails at once
            raise
    result = per_rank[0]
    for i, record in enumerate(result["in_process"]):  # the peak is the worst rank's
        peak = max(rank["in_process"][i]["peak_extra_bytes"] for rank in per_rank)
        record.update(train_tp=tp, train_pp=pp, train_ep=ep, rollout_tp=1, peak_extra_bytes=peak)
    runs = iter(enumerate(result["cross_process"]))  # bucket size by bucket size, rollout TP by rollout TP
    for m in range(len(shape.bucket_mb)):
        for r in rollout_tps:
            i, record = next(runs)
            workers = [checked[r][worker][m] for worker in range(r)]
            check_checksums(
                expected,
                [w.pop("record") for w in workers],
                dtype="float32",
                layout=plans[r][m].layout,
                engine="the benchmark's workers",
            )
            senders = [
                dict(
                    pp_rank=rank["pp_rank"],
                    tp_rank=rank["tp_rank"],
                    ep_rank=rank["ep_rank"],
                    bytes_sent=rank["cross_process"][i]["bytes_sent"],
                    receivers_need=rank["cross_process"][i]["receivers_need"],
                )
                for rank in per_rank
                if rank["sync_rank"] is not None
            ]
            record.pop("bytes_sent"), record.pop("receivers_need")  # rank 0's: in `senders`
            peak = max(rank["cross_process"][i]["peak_extra_bytes"] for rank in per_rank)
            record.update(
                train_tp=tp, train_pp=pp, train_ep=ep, peak_extra_bytes=peak, senders=senders, workers=workers
            )
    return result


def run(model_dir: str, repeats: int, shape: SyncShape = SyncShape()) -> dict:
    """Every train layout of `shape`, every bucket size; the JSON report."""
    from megarl.bench.common import context, model_summary
    from megarl.models.hf_config import read_model_dims

    in_process, cross_process = [], []
    layouts = [(tp, pp, 1, rollout_tps) for tp, pp, rollout_tps in shape.train_layouts]
    if read_model_dims(model_dir).num_experts:
        layouts += list(shape.expert_layouts)
    for tp, pp, ep, rollout_tps in layouts:
        result = _layout(model_dir, tp, pp, rollout_tps, shape, repeats, ep)
        in_process += result["in_process"]
        cross_process += result["cross_process"]
    return dict(
        benchmark="sync",
        context=context(),
        model=model_summary(model_dir),
        repeats=repeats,
        dtype="float32",
        transport="gloo over loopback",
        in_process=in_process,
        cross_process=cross_process,
        goals=goals(in_process, cross_process),
    )


def goals(in_process: list[dict], cross_process: list[dict]) -> dict:
    """The worst case of every figure the issue sets a goal for (ratio of medians, paired ratio)."""
    runs = in_process + cross_process
    return dict(
        in_process_over_clone=max(r["bridge_over_baseline"] for r in in_process),
        in_process_over_clone_paired=max(r["bridge_over_baseline_paired"] for r in in_process),
        cross_process_over_raw=max(r["bridge_over_baseline"] for r in cross_process),
        cross_process_over_raw_paired=max(r["bridge_over_baseline_paired"] for r in cross_process),
        # Bytes: a trainer rank sends no more than the workers it sends to need; a worker gets its shard once.
        sent_over_receivers_need=max(
            s["bytes_sent"] / s["receivers_need"] for r in cross_process for s in r["senders"] if s["receivers_need"]
        ),
        received_over_needed=max(w["bytes_received"] / w["bytes_needed"] for r in cross_process for w in r["workers"]),
        # "≤ 2 buckets": two of the plan's bucket size (or of its largest bucket, when one parameter exceeds it).
        peak_over_two_buckets=max(
            r["peak_extra_bytes"] / (2 * max(r["bucket_mb"] * 2**20, r["largest_bucket_bytes"])) for r in runs
        ),
    )


def _train(record: dict) -> str:
    """A record's train layout, "TP/PP" (EP > 1: "TP/PP/EP N", its senders then named (PP, TP, EP))."""
    return f"{record['train_tp']}/{record['train_pp']}" + (
        f"/EP {record['train_ep']}" if record["train_ep"] > 1 else ""
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
    for kind, baseline in (("in_process", "clone"), ("cross_process", "raw")):
        for r in result[kind]:
            bridge, base = statistics.median(r["seconds"]["bridge"]), statistics.median(r["seconds"][baseline])
            moved = r["bytes"] if kind == "in_process" else sum(s["bytes_sent"] for s in r["senders"])
            bound = 2 * max(r["bucket_mb"] * 2**20, r["largest_bucket_bytes"])
            lines.append(
                f"| {kind.replace('_', '-')} vs {baseline} | {_train(r)} → {r['rollout_tp']} | "
                f"{r['bucket_mb']:g} ({r['buckets']}) | {bridge:.3f} | {moved / 1e9 / bridge:.2f} | {base:.3f} | "
                f"{r['bridge_over_baseline']:.2f}× ({r['bridge_over_baseline_paired']:.2f}×) | "
                f"{r['peak_extra_bytes'] / 2**20:.1f} ({r['peak_extra_bytes'] / bound:.2f}) |"
            )
    lines += [
        "",
        "| train TP/PP → rollout TP | bucket MB | trainer rank (PP, TP[, EP]): MB sent / its workers need "
        "| worker: MB received / its shard | model MB |",
        "|---|---|---|---|---|",
    ]
    for r in result["cross_process"]:
        senders = ", ".join(
            f"({s['pp_rank']}, {s['tp_rank']}{', ' + str(s['ep_rank']) if r['train_ep'] > 1 else ''}): "
            f"{s['bytes_sent'] / 1e6:.1f} / {s['receivers_need'] / 1e6:.1f}"
            for s in r["senders"]
        )
        workers = ", ".join(
            f"{w['worker']}: {w['bytes_received'] / 1e6:.1f} / {w['bytes_needed'] / 1e6:.1f}" for w in r["workers"]
        )
        lines.append(
            f"| {_train(r)} → {r['rollout_tp']} | {r['bucket_mb']:g} | {senders} | {workers} | {r['bytes'] / 1e6:.1f} |"
        )
    g = result["goals"]
    lines.append(
        f"worst cases: in-process ÷ clone {g['in_process_over_clone']:.2f}× "
        f"(paired {g['in_process_over_clone_paired']:.2f}×; goal ≤ 2×), cross-process ÷ raw transfer of the same "
        f"bytes {g['cross_process_over_raw']:.2f}× (paired {g['cross_process_over_raw_paired']:.2f}×; goal ≤ 1.3×), "
        f"bytes sent ÷ what the rank's workers need {g['sent_over_receivers_need']:.2f} (goal ≤ 1), bytes received "
        f"÷ the worker's shard {g['received_over_needed']:.2f} (goal 1), peak extra ÷ 2 buckets "
        f"{g['peak_over_two_buckets']:.2f} (goal ≤ 1)"
    )
    return "\n".join(lines)
