"""Weight-sync throughput: a Megatron actor of (train TP, PP) sends a whole model through the bridge
(TP gather, HF conversion, buckets, gloo broadcast) to a receiver in this process, for several bucket
sizes, beside a plain `clone` of the same number of bytes in the same trainer process.

Receivers: "raw" only receives (into fresh buffers, checked against the checkpoint once): the
bridge and the wire. "vllm" is a TP-1 vLLM engine in this process receiving through its worker
extension and reloading the weights (`reload_weights`, oneDNN repacking on CPU): the whole sync.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.models.hf_config import read_model_dims
from megarl.parallel.spawn import free_port, run_distributed
from megarl.workers.rollout.sync_group import create_weight_sync_group, receive_buckets

HOST = "127.0.0.1"
RECEIVERS = ("raw", "vllm")


@dataclass
class BucketResult:
    """One bucket size, best of the repeats (and the median)."""

    bucket_mb: float
    buckets: int
    gigabytes: float
    sync_seconds: float
    """Best wall time of one whole sync on the sender (gather, convert, move, broadcast)."""
    sync_seconds_median: float
    sync_gb_per_s: float
    clone_seconds: float
    """Best time of `flat.clone()` of the same number of bytes, in the sender process."""
    clone_gb_per_s: float
    sync_over_clone: float
    """sync_seconds / clone_seconds."""
    peak_extra_megabytes: float
    """Most bytes of bridge buffers alive at once on any trainer rank (`SyncStats.peak_buffer_bytes`)."""
    receiver_seconds_median: float
    """Median wall time of one whole receive on the receiving side (for vLLM: until the reload is
    finished, so it includes vLLM's processing after the last bucket)."""


def _trainer(model_dir: str, layout: LayoutPair, port: int, bucket_sizes: list[float], repeats: int) -> list[dict]:
    import torch.distributed as dist

    from megarl.bridge.sync import WeightSender
    from megarl.bridge.transports.broadcast import BroadcastTransport
    from megarl.models.architectures import build_gpt_model
    from megarl.models.checkpoint import load_hf_weights
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import global_named_parameters

    groups = initialize_model_parallel(layout.train_tp, layout.train_pp, seed=0)
    model = build_gpt_model(model_dir, groups)
    load_hf_weights(model, model_dir, groups)
    dims = read_model_dims(model_dir)
    transport = BroadcastTransport.connect(HOST, port, 2, 600) if dist.get_rank() == 0 else None
    results = []
    for bucket_mb in bucket_sizes:
        plan = build_plan(dims, layout, bucket_mb=bucket_mb)
        sender = WeightSender(plan, lambda: global_named_parameters(model, groups), groups, transport)
        runs = [sender.send() for _ in range(repeats)]
        nbytes = sum(b.nbytes for b in plan.buckets)
        flat = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
        clones = []
        for _ in range(repeats):
            start = time.perf_counter()
            flat.clone()
            clones.append(time.perf_counter() - start)
        del flat
        results.append(dict(
            seconds=[r.seconds for r in runs], peak=max(r.peak_buffer_bytes for r in runs),
            buckets=len(plan.buckets), nbytes=nbytes, clone_seconds=min(clones),
        ))
    return results


def run_benchmark(
    model_dir: str | Path,
    *,
    train_tp: int,
    train_pp: int,
    bucket_sizes: list[float],
    repeats: int,
    receiver: str = "raw",
) -> list[BucketResult]:
    """Spawn the trainer world, receive every sync in this process (`receiver`, see the module
    docstring), and return one result per bucket size. Raises AssertionError if a tensor received
    by the raw receiver differs from the checkpoint."""
    model_dir = str(model_dir)
    dims = read_model_dims(model_dir)
    layout = LayoutPair(train_tp, train_pp, 1)
    port = free_port(HOST)
    with ThreadPoolExecutor(max_workers=1) as pool:
        trainers = pool.submit(
            run_distributed, _trainer, train_tp * train_pp, model_dir, layout, port, bucket_sizes, repeats, timeout_s=1800
        )
        plans = [build_plan(dims, layout, bucket_mb=bucket_mb) for bucket_mb in bucket_sizes]
        receive = _receive_into_vllm if receiver == "vllm" else _receive_raw
        received = receive(model_dir, port, plans, repeats)
        per_rank = trainers.result()
    results = []
    for i, bucket_mb in enumerate(bucket_sizes):
        sender = per_rank[0][i]
        seconds = [max(rank[i]["seconds"][r] for rank in per_rank) for r in range(repeats)]
        gigabytes = sender["nbytes"] / 1e9
        best = min(seconds)
        results.append(BucketResult(
            bucket_mb=bucket_mb, buckets=sender["buckets"], gigabytes=gigabytes,
            sync_seconds=best, sync_seconds_median=statistics.median(seconds), sync_gb_per_s=gigabytes / best,
            clone_seconds=sender["clone_seconds"], clone_gb_per_s=gigabytes / sender["clone_seconds"],
            sync_over_clone=best / sender["clone_seconds"],
            peak_extra_megabytes=max(rank[i]["peak"] for rank in per_rank) / 2**20,
            receiver_seconds_median=statistics.median(received[i]),
        ))
    return results


def _receive_raw(model_dir: str, port: int, plans, repeats: int) -> list[list[float]]:
    """Seconds of each receive, per plan."""
    group = create_weight_sync_group(HOST, port, 1, 2, 600)
    expected = _checkpoint(model_dir)
    seconds = []
    for plan in plans:
        seconds.append([])
        for repeat in range(repeats):
            start = time.perf_counter()
            for name, tensor in receive_buckets(group, plan.metadatas, torch.device("cpu")):
                if repeat == 0:
                    assert torch.equal(tensor, expected[name]), f"received {name} differs from the checkpoint"
            seconds[-1].append(time.perf_counter() - start)
    return seconds


def _receive_into_vllm(model_dir: str, port: int, plans, repeats: int) -> list[list[float]]:
    """Seconds of each receive-and-reload, per plan."""
    from megarl.bridge.sync import receiving
    from megarl.workers.rollout import make_rollout_engine

    engine = make_rollout_engine("vllm", model_dir, dtype="float32", max_model_len=64)
    try:
        engine.init_weight_sync(HOST, port, 2, 600).result(timeout=600)
        seconds = []
        for plan in plans:
            seconds.append([])
            for _ in range(repeats):
                start = time.perf_counter()
                with receiving(engine, plan):
                    pass
                seconds[-1].append(time.perf_counter() - start)
        return seconds
    finally:
        engine.shutdown()


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def as_json(results: list[BucketResult], **context) -> dict:
    return dict(context, results=[asdict(r) for r in results])


def markdown_table(results: list[BucketResult]) -> str:
    lines = [
        "| bucket MB | buckets | GB | sync s (best / median) | sync GB/s | clone GB/s | sync ÷ clone "
        "| peak extra MB | receiver s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.bucket_mb:g} | {r.buckets} | {r.gigabytes:.3f} | {r.sync_seconds:.3f} / {r.sync_seconds_median:.3f} | "
            f"{r.sync_gb_per_s:.2f} | {r.clone_gb_per_s:.2f} | {r.sync_over_clone:.1f}× | {r.peak_extra_megabytes:.0f} | "
            f"{r.receiver_seconds_median:.3f} |"
        )
    return "\n".join(lines)
