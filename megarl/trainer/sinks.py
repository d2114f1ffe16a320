"""Where the per-step metrics go: console, JSONL, TensorBoard, Weights & Biases, behind one facade.

    with MetricsLogger.from_config(config, plan, total_steps=100, resumed_step=None) as metrics_logger:
        for step in range(1, 101):
            ...
            metrics_logger.log(step, metrics)       # one call per step, steps increasing
    # on exit: sinks closed, run_dir/curves.png (and memory.png) written

Run directory `trainer.output_dir/trainer.experiment_name` holds `metrics.jsonl` (always written:
the plot and the e2e checks read it), `run_config.json`, `tensorboard/` and `wandb/` when configured,
`curves.png` and `memory.png` (`megarl.trainer.plots`).

The run's description (`run_config`: the resolved config's sections and `batch_plan`, the batch plan's
sizes) is logged once when each run starts: `run_config.json` beside metrics.jsonl, the W&B run's
config, a TensorBoard text summary (`run_config`). A resumed run logs the description it runs with.

Resume policy (JSONL and TensorBoard alike): a run resumed from the checkpoint of step N keeps the
records of steps <= N and drops later ones, which the resumed run logs again; a fresh run
(`resumed_step=None`) starts empty. So a run interrupted and resumed any number of times leaves
exactly one record per step.

Besides that description, only the numbers passed to `log` are written: never the environment or
credentials (W&B reads its API key from the environment itself).
"""

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Protocol, TextIO

import yaml
from tqdm import tqdm

from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config, to_dict
from megarl.credentials import credential
from megarl.trainer.plots import CURVES_FILE, MEMORY_FILE, plot_memory, plot_metrics

METRICS_FILE = "metrics.jsonl"
"""One JSON object per step in the run directory: `{"step": N, "<name>": value, ...}`; non-finite values as null."""
RUN_CONFIG_FILE = "run_config.json"
"""The run's description as JSON, in the run directory (`run_config`)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files, under the run directory."""
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
"""Values of `trainer.loggers`."""


class LoggerSetupError(ValueError):
    """A configured logger cannot start (the message names `trainer.loggers` and the fix)."""


def run_config(config: Config, plan: BatchPlan) -> dict:
    """What each sink logs once per run: the resolved config's sections (`model`, `actor`, ...) and
    `batch_plan`, the plan's derived sizes, as plain JSON-ready data."""
    return to_dict(config) | {"batch_plan": to_dict(plan)}


def write_run_config(path: Path, description: Mapping[str, object]) -> None:
    """`description` as JSON at `path`, replaced whole (a crash leaves the old file or the new one)."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(description, indent=1) + "\n")
    os.replace(partial, path)


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of `step`."""

    def close(self) -> None:
        """Flush and release files or connections."""


# Console: (label, metric) shown in this order when the step has the metric.
_CONSOLE_FIELDS = (
    ("reward", "reward/mean"),
    ("len", "response_length/mean"),
    ("len_clip", "response_length/clip_ratio"),
    ("kl", "actor/kl"),
    ("ent", "actor/entropy"),
    ("pg_clip", "actor/pg_clipfrac"),
    ("gnorm", "actor/grad_norm"),
    ("vf_loss", "critic/vf_loss"),
    ("sync_gap", "sync/logprob_max_abs_diff"),
    ("val_reward", "val/reward/mean"),
    ("tok/s", "perf/tokens_per_s"),
)


def console_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    """`step 3/10 | reward 0.5 | len 12.3 | ... | time 2.41s (rollout 1.2 reward 0.05 ...)`."""
    parts = [f"step {step}/{total_steps}"]
    parts += [f"{label} {metrics[name]:.4g}" for label, name in _CONSOLE_FIELDS if name in metrics]
    phases = [
        (name.removeprefix("timing/"), seconds)
        for name, seconds in metrics.items()
        if name.startswith("timing/") and name != "timing/step"
    ]
    if "timing/step" in metrics or phases:
        total = f"{metrics['timing/step']:.3g}s " if "timing/step" in metrics else ""
        parts.append(f"time {total}({' '.join(f'{phase} {seconds:.3g}' for phase, seconds in phases)})")
    return " | ".join(parts)


class ConsoleSink:
    """One line per step; on a terminal a progress bar (tqdm) with ETA below the lines, elsewhere (CI
    logs, files) the ETA at the end of each line instead, so no carriage returns reach the log."""

    def __init__(
        self, total_steps: int, resumed_step: int | None, stream: TextIO, clock: Callable[[], float] = time.monotonic
    ):
        self.total_steps = total_steps
        self.start_step = resumed_step or 0
        self.stream = stream
        self.clock = clock
        self.start_time = clock()
        self.bar = None
        if stream.isatty():
            self.bar = tqdm(total=total_steps, initial=self.start_step, file=stream, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        line = console_line(step, self.total_steps, metrics)
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
            self.bar.update(step - self.bar.n)
            return
        elapsed = self.clock() - self.start_time
        print(f"{line} | elapsed {_duration(elapsed)} eta {self._eta(step, elapsed)}", file=self.stream, flush=True)

    def _eta(self, step: int, elapsed: float) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        return _duration(elapsed / done * max(self.total_steps - step, 0))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class JsonlSink:
    """`metrics.jsonl`, flushed after every step; reopened on resume per the module's policy."""

    def __init__(self, path: Path, resumed_step: int | None):
        kept = (
            []
            if resumed_step is None or not path.exists()
            else [record for record in read_metrics_file(path) if record["step"] <= resumed_step]
        )
        # Rewrite then rename: a crash while truncating must not lose the kept records.
        partial = path.with_name(path.name + ".tmp")
        partial.write_text("".join(_json_line(record) for record in kept))
        os.replace(partial, path)
        self.file = path.open("a")

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        self.file.write(_json_line({"step": step, **metrics}))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _json_line(record: Mapping[str, object]) -> str:
    strict = {
        name: None if isinstance(value, float) and not math.isfinite(value) else value for name, value in record.items()
    }
    return json.dumps(strict, allow_nan=False) + "\n"


def read_metrics_file(path: Path) -> list[dict[str, float | None]]:
    """The records of a `metrics.jsonl`, in file order. A last line without its newline that does not
    parse is a write cut short by a crash and is skipped; any other bad line is an error."""
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ValueError(
                f"{path}:{number}: not a JSON object ({error}); the metrics file is damaged, "
                "move it away to start a new one"
            ) from None
        records.append(record)
    return records


class TensorBoardSink:
    """Scalars under their metric names; `purge_step` makes TensorBoard hide the re-run steps' old values.
    The run's description is a text summary `run_config` (YAML) at the run's first step."""

    def __init__(self, log_dir: Path, resumed_step: int | None, description: Mapping[str, object] | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=0 if resumed_step is None else resumed_step + 1)
        if description is not None:
            # Indented four spaces: TensorBoard renders the text as Markdown, this keeps the YAML a code block.
            text = yaml.safe_dump(dict(description), sort_keys=False, width=120)
            self.writer.add_text(
                "run_config", "".join(f"    {line}\n" for line in text.splitlines()), global_step=resumed_step or 0
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run named after the experiment, the run's description as its config; a resumed megarl run
    continues the same W&B run (its id is kept in `run_dir/wandb_run_id`). W&B itself ignores steps it
    already has, so a re-run step keeps its first values there. `WANDB_MODE=offline` keeps the run in
    `run_dir/wandb/` for `wandb sync`."""

    def __init__(
        self,
        run_dir: Path,
        project_name: str,
        experiment_name: str,
        resumed_step: int | None,
        description: Mapping[str, object] | None,
    ):
        try:
            import wandb
        except ImportError:
            raise LoggerSetupError(
                "trainer.loggers includes 'wandb' but the wandb package is not installed: install it "
                "(pip install 'megarl[wandb]') or drop 'wandb' from trainer.loggers, e.g. trainer.loggers=[console,jsonl]"
            ) from None
        self.wandb = wandb
        id_file = run_dir / "wandb_run_id"
        resuming = resumed_step is not None and id_file.exists()
        # A fresh run takes the id W&B makes (None): wandb has no public id generator.
        run_id = id_file.read_text().strip() if resuming else None
        # quiet: W&B still says where the run's data went and how to sync it, not its banner and history table.
        try:
            self.run = wandb.init(
                project=project_name,
                name=experiment_name,
                id=run_id,
                dir=str(run_dir),
                resume="allow",
                config=None if description is None else dict(description),
                # The key `megarl train` took out of the environment (megarl.credentials), or W&B's own login.
                settings=wandb.Settings(quiet=True, api_key=credential("WANDB_API_KEY")),
            )
        except wandb.errors.UsageError as error:  # no API key, a bad setting: what the user can fix
            wandb.teardown()
            raise LoggerSetupError(
                f"trainer.loggers includes 'wandb' but W&B cannot start a run: {error} Log in (wandb login, or set "
                "WANDB_API_KEY), or keep the run local with WANDB_MODE=offline (wandb sync uploads it later), "
                "or drop 'wandb' from trainer.loggers"
            ) from None
        id_file.write_text(self.run.id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() leaves W&B's service process (wandb-core) running until this process exits: the
        # driver has no other W&B run, so it is stopped now, with the run.
        self.wandb.teardown()


class MetricsLogger:
    """The loop's one handle on metrics: validates each step's dict and fans it out to the sinks.
    Lives on the driver only. `close` (or leaving the `with` block) writes `run_dir/curves.png` and
    `run_dir/memory.png`."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: tuple[str, ...] | list[str],
        total_steps: int,
        *,
        project_name: str = "megarl",
        experiment_name: str = "default",
        resumed_step: int | None = None,
        description: Mapping[str, object] | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`loggers`: `trainer.loggers` (JSONL is written whether listed or not). `total_steps`: the
        steps the run will have done at its end (for the progress and ETA). `resumed_step`: the step of
        the checkpoint this run resumed from, None for a fresh run. `description`: the run's
        (`run_config`), logged once to each sink; None logs none. `stream`: console output (stdout)."""
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise LoggerSetupError(f"trainer.loggers={list(loggers)}: unknown {unknown}; choose among {list(LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.last_step = -1 if resumed_step is None else resumed_step
        self.sinks: list[Sink] = []
        # W&B first: the one sink that can fail for a missing package fails before any file is touched.
        if "wandb" in loggers:
            self.sinks.append(WandbSink(self.run_dir, project_name, experiment_name, resumed_step, description))
        self.sinks.append(JsonlSink(self.run_dir / METRICS_FILE, resumed_step))
        if description is not None:
            write_run_config(self.run_dir / RUN_CONFIG_FILE, description)
        if "tensorboard" in loggers:
            self.sinks.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR, resumed_step, description))
        if "console" in loggers:
            self.sinks.append(ConsoleSink(total_steps, resumed_step, sys.stdout if stream is None else stream, clock))

    @classmethod
    def from_config(
        cls, config: Config, plan: BatchPlan, total_steps: int, resumed_step: int | None = None
    ) -> "MetricsLogger":
        """For the run `trainer.output_dir/trainer.experiment_name`, described by `config` and `plan`."""
        trainer = config.trainer
        return cls(
            Path(trainer.output_dir) / trainer.experiment_name,
            trainer.loggers,
            total_steps,
            project_name=trainer.project_name,
            experiment_name=trainer.experiment_name,
            resumed_step=resumed_step,
            description=run_config(config, plan),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """All metrics of `step` (a number per name, see `megarl.trainer.metrics.DOCUMENTED_METRICS`)."""
        if step <= self.last_step:
            raise ValueError(
                f"metrics of step {step} logged after step {self.last_step}: log each step once, "
                "in increasing order (merge validation metrics into the step's dict)"
            )
        self._write(step, metrics)
        self.last_step = step

    def restore(self, step: int, metrics: Mapping[str, float]) -> bool:
        """The record of `step`, the step the resumed checkpoint was saved at, from the checkpoint
        (`metrics`: what the step had measured when it saved), when the run that saved it, writing to this
        run dir, stopped before logging it: metrics.jsonl then ends before `step`. Whether it was missing.
        With it every step has exactly one record across any stop."""
        records = read_metrics_file(self.run_dir / METRICS_FILE)
        if records and records[-1]["step"] >= step:
            return False
        self._write(step, metrics)
        return True

    def _write(self, step: int, metrics: Mapping[str, float]) -> None:
        if "step" in metrics:
            raise ValueError("metrics contain 'step': pass the step as log's first argument instead")
        numbers = {}
        for name, value in metrics.items():
            try:
                numbers[name] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {name!r} of step {step} is {value!r}, not a number") from None
        for sink in self.sinks:
            sink.log(step, numbers)

    def close(self) -> Path | None:
        """Closes the sinks and plots the run (`curves.png`, and `memory.png` when the run logged memory);
        returns the curves' path (None when no step was ever logged)."""
        for sink in self.sinks:
            sink.close()
        records = read_metrics_file(self.run_dir / METRICS_FILE)
        if not records:
            return None
        plot_memory(records, self.run_dir / MEMORY_FILE, title=self.run_dir.name)
        return plot_metrics(records, self.run_dir / CURVES_FILE, title=self.run_dir.name)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
