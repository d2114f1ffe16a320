"""Launch to first step of the quickstart: `megarl train configs/quickstart.yaml` started as a user starts
it, its output read line by line as it comes, and three moments taken from the clock of this process:
the start-up line (`start-up 16.1 s: reward ... | ray ... | megatron ... | engines ...`, printed when
the workers are up), the line of step 1 and the line of the last step. Before the start-up line's own
phases come the interpreter, the imports and the config's load and validation ("before start-up").
Median over `--repeats` launches, one after another; the quickstart's model and data must exist
(`bash scripts/quickstart.sh` makes them).

    python benchmarks/launch.py --json benchmarks/results/extra/launch.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP = re.compile(r"^start-up ([\d.]+) s: (.*)$")
STEP = re.compile(r"^step (\d+)/\d+ \|")
STEPS = 2
"""Step 1 and one more (a steady step, no first-call warm-ups), then the run ends and saves."""


def launch(workdir: Path) -> dict:
    """One `megarl train` to STEPS steps: seconds from launch to each marker line, and the start-up phases."""
    command = [
        sys.executable,
        "-m",
        "megarl.cli.main",
        "train",
        "configs/quickstart.yaml",
        "checkpoint.resume=disable",
        f"trainer.total_steps={STEPS}",
        f"trainer.output_dir={workdir}",
        "trainer.experiment_name=launch",
    ]
    began = time.perf_counter()
    seen: dict = {"steps": {}}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            now = time.perf_counter() - began
            if match := STARTUP.match(line.strip()):
                seen["startup_line"] = now
                seen["startup_seconds"] = float(match[1])
                seen["phases"] = {
                    name: float(value) for name, value in (part.rsplit(" ", 2)[:2] for part in match[2].split(" | "))
                }
            elif match := STEP.match(line.strip()):
                seen["steps"][int(match[1])] = now
    if process.returncode != 0 or "startup_line" not in seen or len(seen["steps"]) != STEPS:
        raise SystemExit(f"launch: megarl train exited {process.returncode} before its start-up and step lines")
    seen["end"] = time.perf_counter() - began
    seen["before_startup"] = seen["startup_line"] - seen["startup_seconds"]
    return seen


def main() -> None:
    from megarl.bench.common import context, write_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        runs = [launch(Path(workdir) / str(index)) for index in range(args.repeats)]

    def median(pick) -> float:
        return statistics.median(pick(run) for run in runs)

    report = dict(
        benchmark="launch",
        context=context(),
        config="configs/quickstart.yaml",
        repeats=args.repeats,
        runs=runs,
        median_launch_to_first_step=median(lambda run: run["steps"][1]),
        median_before_startup=median(lambda run: run["before_startup"]),
        median_startup=median(lambda run: run["startup_seconds"]),
        median_phases={name: median(lambda run, n=name: run["phases"][n]) for name in runs[0]["phases"]},
        median_first_step=median(lambda run: run["steps"][1] - run["startup_line"]),
    )
    write_json(args.json, report)
    print(
        f"launch → step 1: {report['median_launch_to_first_step']:.1f} s (median of {args.repeats}) = before "
        f"start-up {report['median_before_startup']:.1f} s + start-up {report['median_startup']:.1f} s ("
        + ", ".join(f"{name} {value:.1f} s" for name, value in report["median_phases"].items())
        + f") + step 1 {report['median_first_step']:.1f} s"
    )


if __name__ == "__main__":
    main()
