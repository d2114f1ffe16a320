"""Weight sync: `megarl.bench.sync_bridge` (sync time vs a plain `clone` of the same bytes, in the
same trainer process), reported in this package's JSON."""

from __future__ import annotations

import dataclasses


def run(model_dir: str, repeats: int, train_tp: int = 2, train_pp: int = 1, bucket_mb: float = 16) -> dict:
    from megarl.bench.common import context, model_summary
    from megarl.bench.sync_bridge import run_benchmark

    (result,) = run_benchmark(model_dir, train_tp=train_tp, train_pp=train_pp, bucket_sizes=[bucket_mb],
                              repeats=repeats, receiver="raw")
    return dict(
        benchmark="sync", context=context(), model=model_summary(model_dir), repeats=repeats,
        layout=dict(train_tp=train_tp, train_pp=train_pp, rollout_tp=1, bucket_mb=bucket_mb),
        sync_over_clone_median=result.sync_seconds_median / result.clone_seconds,
        **dataclasses.asdict(result),
    )


def markdown(result: dict) -> str:
    layout = result["layout"]
    return "\n".join([
        f"sync: train TP {layout['train_tp']} PP {layout['train_pp']} → raw receiver, buckets of {layout['bucket_mb']:g} MB, "
        f"{result['gigabytes'] * 1e3:.1f} MB, {result['repeats']} repeats",
        "| sync s (best / median) | clone s (best) | sync ÷ clone (best / median) | peak extra MB |",
        "|---|---|---|---|",
        f"| {result['sync_seconds']:.4f} / {result['sync_seconds_median']:.4f} | {result['clone_seconds']:.4f} | "
        f"{result['sync_over_clone']:.1f}× / {result['sync_over_clone_median']:.1f}× | {result['peak_extra_megabytes']:.1f} |",
    ])


