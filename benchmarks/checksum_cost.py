"""What the exact sync check costs per sync: `megarl.bridge.checksum.tensor_checksum` over every tensor of
a 100.9 M-parameter Qwen2 (`megarl.bench.sync.MODEL_100M`, what an engine worker records on each sync's
load), in the engines' dtypes, beside two baselines on the same tensors: a `clone()` (one pass over the
bytes) and a plain position-weighted sum Σ_i (2i + 1)·bits_i mod 2^32 (the cheapest exact weighted sum,
the arithmetic the check used before its weights became hashes). One CPU thread, contenders alternating,
median of `--repeats` after a warm-up.

    python benchmarks/checksum_cost.py --json benchmarks/results/extra/checksum_cost.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megarl.bench.common import context, model_summary, time_interleaved, write_json
from megarl.bench.sync import MODEL_100M, _checkpoint
from megarl.bridge.checksum import tensor_checksum
from megarl.models.tiny import make_tiny_model

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def affine_checksum(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Σ_i (2i + 1)·bits_i mod 2^32 over `tensor` cast to `dtype` (flat index i), in int32 chunks of rows."""
    ints = tensor.to(dtype).view(_INT_OF_WIDTH[dtype.itemsize])
    ints = ints.flatten(1) if ints.dim() > 1 else ints.reshape(-1, 1)
    width = ints.shape[1]
    weights = torch.arange(width, dtype=torch.int32) * 2 + 1
    total, step = 0, max(1, (1 << 24) // width)
    for start in range(0, ints.shape[0], step):
        rows = ints[start : start + step].to(torch.int32)
        offsets = (torch.arange(start, start + rows.shape[0]) * width * 2) * rows.sum(1, dtype=torch.int64)
        total += int((offsets + (rows * weights).sum(1, dtype=torch.int64)).sum())
    return total % (1 << 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/checksum_cost"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.workdir / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_model(str(model_dir), "qwen2", **MODEL_100M)
    tensors = list(_checkpoint(str(model_dir)).values())
    report = dict(
        benchmark="checksum_cost",
        context=context(),
        model=model_summary(model_dir),
        tensors=len(tensors),
        repeats=args.repeats,
        threads=1,
        dtypes={},
    )
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        timings = time_interleaved(
            {
                "checksum": lambda: [tensor_checksum(t, dtype) for t in tensors],
                "affine_sum": lambda: [affine_checksum(t, dtype) for t in tensors],
                "clone": lambda: [t.clone() for t in tensors],
            },
            args.repeats,
        )
        report["dtypes"][name] = dict(
            seconds=timings.seconds,
            median_seconds={k: timings.median(k) for k in timings.seconds},
            checksum_over_affine_paired=timings.paired_ratio("checksum", "affine_sum"),
            checksum_over_clone_paired=timings.paired_ratio("checksum", "clone"),
        )
    write_json(args.json, report)
    print(
        json.dumps(
            {name: {k: v for k, v in d.items() if k != "seconds"} for name, d in report["dtypes"].items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()
