"""The summary table of benchmarks/README.md from the JSON results:
`python -m megarl.bench.report benchmarks/results`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(results: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """(benchmark, figure, value, goal and verdict) for every result present."""
    out = []
    if "rollout" in results:
        r = results["rollout"]
        ratio, paired = r["megarl_over_vllm"], r["megarl_over_vllm_paired"]
        out.append(
            (
                "rollout",
                "megarl rollout ÷ vLLM `LLM.generate`, time (paired)",
                f"{ratio:.3f}× ({paired:.3f}×)",
                _goal("≤ 1.1×", ratio <= 1.1, paired <= 1.1),
            )
        )
        if "hf_over_megarl" in r:
            out.append(
                (
                    "rollout",
                    "HF `generate` ÷ megarl rollout, time = megarl's speed-up (paired)",
                    f"{r['hf_over_megarl']:.2f}× ({r['hf_over_megarl_paired']:.2f}×)",
                    "reported",
                )
            )
    if "train" in results:
        r = results["train"]
        ratio, paired = r["megatron_over_pytorch_throughput"], r["megatron_over_pytorch_throughput_paired"]
        out.append(
            (
                "train",
                "Megatron TP 1 ÷ plain PyTorch, tokens/s (paired)",
                f"{ratio:.2f}× ({paired:.2f}×)",
                _goal("≥ 0.8×", ratio >= 0.8, paired >= 0.8),
            )
        )
        for name, layout in r["layouts"].items():
            out.append(
                (
                    "train",
                    f"Megatron {name.upper().replace('_', ' ')} time per token ÷ TP 1 (2 processes)",
                    f"{layout['over_tp1_megatron']:.2f}× ({layout['microseconds_per_token']:.0f} µs/token)",
                    "reported",
                )
            )
    if "step" in results:
        r = results["step"]
        share = r["phase_share"]["other"]
        out.append(
            (
                "step",
                '"other" ÷ GRPO step (driver work outside the timed phases)',
                f"{share:.1%}",
                _goal("≤ 10 %", share <= 0.10, share <= 0.10),
            )
        )
    if "sync" in results:
        r, g = results["sync"], results["sync"]["goals"]
        size = f"{r['model']['parameters'] / 1e6:.1f} M parameters"
        ratio, paired = g["in_process_over_clone"], g["in_process_over_clone_paired"]
        out.append(
            (
                "sync",
                f"in-process bridge ÷ `clone` of the same bytes, worst layout and bucket size ({size}) (paired)",
                f"{ratio:.2f}× ({paired:.2f}×)",
                _goal("≤ 2×", ratio <= 2, paired <= 2),
            )
        )
        ratio, paired = g["cross_process_over_raw"], g["cross_process_over_raw_paired"]
        out.append(
            (
                "sync",
                "cross-process shard sync ÷ raw transfer of the same bytes between the same ranks, worst (paired)",
                f"{ratio:.2f}× ({paired:.2f}×)",
                _goal("≤ 1.3×", ratio <= 1.3, paired <= 1.3),
            )
        )
        sent = g["sent_over_receivers_need"]
        out.append(
            (
                "sync",
                "bytes a trainer rank sends ÷ what the rollout workers it sends to need, worst",
                f"{sent:.2f}",
                _goal("≤ 1", sent <= 1, sent <= 1),
            )
        )
        peak = g["peak_over_two_buckets"]
        out.append(
            (
                "sync",
                "peak extra memory of a sync ÷ 2 buckets, worst",
                f"{peak:.2f}",
                _goal("≤ 1", peak <= 1, peak <= 1),
            )
        )
    return out


def _goal(goal: str, met: bool, met_paired: bool) -> str:
    """The verdict; when the ratio of medians and the paired ratio disagree, both are named."""
    if met == met_paired:
        return f"{goal}: {'met' if met else 'NOT met'}"
    return f"{goal}: {'met' if met_paired else 'NOT met'} on the paired ratio, {'met' if met else 'NOT met'} on the medians"


def markdown(results: dict[str, dict]) -> str:
    lines = ["| benchmark | figure | value | goal |", "|---|---|---|---|"]
    lines += [f"| {b} | {f} | {v} | {g} |" for b, f, v, g in rows(results)]
    return "\n".join(lines)


def load(directory: Path) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


if __name__ == "__main__":
    print(markdown(load(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))))
