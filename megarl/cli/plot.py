"""`megarl plot RUN_DIR`: draw a run's training curves from RUN_DIR/metrics.jsonl into RUN_DIR/curves.png,
and its memory per hand-over phase, when it logged some, into memory.png beside it.

Works on a finished run and on one still training (it reads the steps logged so far).
"""

import argparse
import sys
from pathlib import Path

from megarl.trainer.plots import CURVES_FILE, MEMORY_FILE, plot_memory, plot_metrics
from megarl.trainer.sinks import METRICS_FILE, read_metrics_file


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="plot a run's reward, response length, KL and sync gap curves",
        description=f"Read RUN_DIR/{METRICS_FILE} and write a PNG with reward (and its rolling mean), response "
        f"length, KL to the reference and the weight-sync log-prob gap over steps "
        f"(default RUN_DIR/{CURVES_FILE}), and each role's memory through the last step's hand-over "
        f"phases into {MEMORY_FILE} beside it when the run logged memory metrics.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="the run's directory: trainer.output_dir/trainer.experiment_name"
    )
    parser.add_argument("--out", type=Path, help=f"PNG to write instead of RUN_DIR/{CURVES_FILE}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    metrics_path = args.run_dir / METRICS_FILE
    if not metrics_path.is_file():
        print(
            f"megarl plot: no metrics file at {metrics_path}; pass the directory of a run "
            "(trainer.output_dir/trainer.experiment_name) that has logged at least one step",
            file=sys.stderr,
        )
        return 2
    try:
        records = read_metrics_file(metrics_path)
    except ValueError as error:
        print(f"megarl plot: {error}", file=sys.stderr)
        return 2
    if not records:
        print(
            f"megarl plot: {metrics_path} holds no steps yet; plot again once the run has logged one", file=sys.stderr
        )
        return 2
    problem = _record_problem(records) or _out_problem(args.out)
    if problem is not None:
        print(f"megarl plot: {problem.replace('{file}', str(metrics_path))}", file=sys.stderr)
        return 2
    title = args.run_dir.resolve().name
    out_path = plot_metrics(records, args.out or args.run_dir / CURVES_FILE, title=title)
    print(f"wrote {out_path} ({len(records)} steps)")
    memory_path = plot_memory(records, out_path.with_name(MEMORY_FILE), title=title)
    if memory_path is not None:
        print(f"wrote {memory_path}")
    return 0


def _record_problem(records: list) -> str | None:
    """Why the records are not megarl's metrics (each an object with an integer step and numbers or null),
    or None. `{file}` stands for the file."""
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            return f"{{file}}: record {number} is a JSON {type(record).__name__}, not an object of metrics"
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return f'{{file}}: record {number} has no integer "step" (step = {step!r})'
        for name, value in record.items():
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
                return (
                    f"{{file}}: step {step}: {name} = {shown} is a {type(value).__name__}, not a number; "
                    "megarl writes numbers (or null) only: was the file edited? fix or remove that line"
                )
    return None


def _out_problem(out: Path | None) -> str | None:
    """Why the PNG cannot be written to --out (checked before drawing), or None."""
    if out is None:
        return None
    if not out.parent.is_dir():
        return f"--out {out}: the directory {out.parent} does not exist; create it, or choose a path in an existing one"
    if out.is_dir():
        return f"--out {out} is a directory; name the PNG file, e.g. {out / 'curves.png'}"
    return None
