"""The memory of each role through the phases of the hand-over (`megarl.cluster.handover`), read from a
run's metrics.jsonl: the table of issue 15's "memory per phase", for a colocated run.

    python benchmarks/handover_memory.py outputs/quickstart/metrics.jsonl \\
        --json benchmarks/results/extra/handover_memory.json

Prints a markdown table (GiB per role and phase, at the first and the last step; rows in the hand-over's
order, `metrics.MEMORY_PHASES`) and writes every step's numbers as JSON (phase -> role -> one value per step). The run's own
`memory.png` (written at its end by `megarl.trainer.plots`, or by `megarl plot RUN_DIR`) draws the last
step's column.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.cluster.memory_metrics import MEMORY_PHASES, MEMORY_ROLES, MEMORY_STATS, memory_metric


def memory_by_phase(step: dict, stat: str) -> dict[str, dict[str, float]]:
    """phase -> role -> GiB of one step's record, for the (phase, role) pairs it logged."""
    return {
        phase: {
            role: step[memory_metric(role, phase, stat)]
            for role in MEMORY_ROLES
            if memory_metric(role, phase, stat) in step
        }
        for phase in MEMORY_PHASES
    }


def logged_stat(step: dict) -> str | None:
    """The memory stat a run logged (`rss_gib` on CPU; on CUDA the first of the allocator's); None if none."""
    stats = [
        stat for stat in MEMORY_STATS if any(name.endswith("/" + stat) for name in step if name.startswith("memory/"))
    ]
    return stats[0] if stats else None


def markdown(first: dict, last: dict, first_step: int, last_step: int, stat: str) -> str:
    roles = [role for role in MEMORY_ROLES if any(role in by_role for by_role in last.values())]
    header = ["phase", *(f"{role}, step {step}" for role in roles for step in (first_step, last_step))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for phase in MEMORY_PHASES:
        cells = [
            f"{table[phase][role]:.3f}" if role in table[phase] else "" for role in roles for table in (first, last)
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return f"{stat}, GiB (the highest rank of each role):\n\n" + "\n".join(lines)


def one_line_per_series(header: dict, series: dict[str, dict[str, list[float]]]) -> str:
    """JSON of `header` plus `series` under "by_phase", one line per key and per phase (readable in a diff)."""
    lines = [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in header.items()]
    phases = [f"  {json.dumps(phase)}: {json.dumps(roles)}" for phase, roles in series.items()]
    return "{\n" + "\n".join(lines) + '\n "by_phase": {\n' + ",\n".join(phases) + "\n }\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="the run's metrics.jsonl")
    parser.add_argument("--json", type=Path, help="write every step's table here")
    args = parser.parse_args()
    if not args.metrics.is_file():
        parser.error(f"{args.metrics}: no such file; pass a run's metrics.jsonl (RUN_DIR/metrics.jsonl)")
    steps = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    stat = logged_stat(steps[0]) if steps else None
    if stat is None:
        parser.error(
            f"{args.metrics}: no memory/<role>/<phase>/<stat> metric in its first step; a colocated run "
            "logs them every step (megarl.cluster.handover)"
        )
    tables = {step["step"]: memory_by_phase(step, stat) for step in steps}
    first, last = steps[0]["step"], steps[-1]["step"]
    print(markdown(tables[first], tables[last], first, last, stat))
    if args.json:
        run = f"{args.metrics.parent.name}/{args.metrics.name}"
        series = {
            phase: {role: [round(tables[step][phase][role], 6) for step in tables] for role in tables[last][phase]}
            for phase in MEMORY_PHASES
        }
        header = {"metrics": run, "stat": stat, "unit": "GiB", "steps": list(tables)}
        args.json.write_text(one_line_per_series(header, series))


if __name__ == "__main__":
    main()
