"""`python -m benchmarks.sync`: weight-sync seconds and GB/s vs a plain clone, per bucket size."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from megarl.bench.sync_bridge import RECEIVERS, as_json, markdown_table, run_benchmark
from megarl.models.tiny import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sync", description=__doc__)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=16, help="(default 768 × 16 layers: ~101 M parameters)")
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--train-tp", type=int, default=2)
    parser.add_argument("--train-pp", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--receiver", choices=RECEIVERS, default="raw", help="raw: receive only; vllm: a TP-1 vLLM engine reloads"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/sync/results.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megarl-bench-sync-") as tmp:
        model_dir = make_tiny_model(
            tmp, "qwen2", hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
            num_attention_heads=args.hidden_size // 64, num_key_value_heads=min(4, args.hidden_size // 64), head_dim=64,
            intermediate_size=args.intermediate_size,
        )
        results = run_benchmark(
            model_dir, train_tp=args.train_tp, train_pp=args.train_pp, bucket_sizes=args.bucket_mb,
            repeats=args.repeats, receiver=args.receiver,
        )
    parameters = round(results[0].gigabytes * 1e9 / 4)
    report = as_json(
        results, model=f"qwen2 hidden {args.hidden_size}, {args.num_layers} layers, ffn {args.intermediate_size}",
        parameters=parameters, train_tp=args.train_tp, train_pp=args.train_pp, dtype="float32",
        transport="gloo broadcast over loopback", receiver=args.receiver,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{parameters / 1e6:.1f} M parameters, train TP={args.train_tp} PP={args.train_pp}; wrote {args.out}")
    print(markdown_table(results))


if __name__ == "__main__":
    main()
