"""Helpers of the reliability tests: a tiny workspace, and `megarl train` as a watched subprocess.

    workspace = make_workspace(tmp_dir)                  # tiny model, quickstart data, recipe.yaml
    job = Job.start(workspace, run_dir, ["trainer.total_steps=4"])
    job.wait_for(lambda: job.last_step() >= 2, "step 2 logged")
    policy, rollout = job.rank_processes()               # psutil.Process lists, by rank order of pid
    job.wait(timeout_s=180)                              # exit code; stdout/stderr in job.output()
    python_stacks(policy[0].pid)                         # where a process is (py-spy dump)

Every job gets its own Ray temp dir (`RAY_TMPDIR`), so its session logs can be read and nothing is
shared with other Ray instances on the machine, and its own /dev/shm (`shm_testing.PrivateShm`), so
`job.shm.leftovers()` is exactly what the job left there; `Job.cleanup()` kills whatever the job left
behind and removes both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml
from shm_testing import PrivateShm

from megarl.models.tiny import make_tiny_model
from megarl.rewards.tasks import repeat_first_char_rows
from megarl.trainer.checkpoint_manager import Checkpoint, CheckpointManager

EXIT_GRACE_S = 10.0
"""How long a process of an ended job may take to exit before it counts as left behind."""

REWARDS_MODULE = '''"""Reward functions of the reliability tests (the job finds this module through PYTHONPATH)."""
import hashlib
import json
import os
import warnings

from megarl.rewards.tasks import repeat_first_char


def env_probe(prompts, responses, **columns):
    """repeat_first_char, after recording once this process's environment and parentage, and where on
    the machine it finds a value whose sha256 is in RELIABILITY_CANARY_DIGESTS (every environment /proc
    lets it read); and warning once, as user code may: the console must show it."""
    path = os.environ["RELIABILITY_PROBE_FILE"] + f".{os.getpid()}"
    if not os.path.exists(path):
        warnings.warn("env_probe: a warning from user code", UserWarning)
        digests = set(os.environ["RELIABILITY_CANARY_DIGESTS"].split(","))
        with open(path, "w") as f:
            json.dump(
                {"pid": os.getpid(), "ppid": os.getppid(), "environ": dict(os.environ), "found": _find(digests)}, f
            )
    return repeat_first_char(prompts, responses, **columns)


def _find(digests):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as file:
                entries = file.read().split(b"\\0")
        except OSError:
            continue
        for name, _, value in (entry.partition(b"=") for entry in entries):
            if hashlib.sha256(value).hexdigest() in digests:
                found.append([int(pid), name.decode()])
    return found
'''

MEGARL = str(Path(sys.executable).with_name("megarl"))
POLL_S = 0.2


def make_workspace(root: Path) -> Path:
    """`root` with model/, data/train.jsonl and recipe.yaml: the quickstart recipe (actor TP 2, two
    colocated TP-1 vLLM engines, 16 prompts × 8 samples, 2 new tokens) without validation."""
    import random

    make_tiny_model(root / "model", arch="qwen2")
    (root / "data").mkdir()
    rows = repeat_first_char_rows(1024, random.Random(0))
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = yaml.safe_load((Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml").read_text())
    recipe["model"]["path"] = str(root / "model")
    recipe["data"] |= {"train_files": [str(root / "data" / "train.jsonl")], "val_files": []}
    recipe["trainer"] |= {"test_freq": 0, "total_steps": 2, "loggers": ["console", "jsonl"]}
    recipe["checkpoint"] |= {"export_hf": False, "save_freq": 0}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (root / "reliability_rewards.py").write_text(REWARDS_MODULE)
    return root


@dataclass
class Job:
    """One `megarl` subprocess (`train` unless `launch`ed with another subcommand) and the directories it writes."""

    process: subprocess.Popen
    run_dir: Path
    """trainer.output_dir: metrics.jsonl lies in run_dir/<experiment>."""
    checkpoint_dir: Path
    ray_tmp: Path
    """This job's RAY_TMPDIR (short: Ray's socket paths must fit in 107 bytes)."""
    log: Path
    shm: PrivateShm
    """The job's /dev/shm."""
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    """Every descendant process observed so far, by pid (to prove they are all gone at the end)."""

    @classmethod
    def start(cls, workspace: Path, run_dir: Path, overrides: list[str], env: dict[str, str] | None = None) -> Job:
        """`megarl train` of the workspace's recipe, writing under `run_dir`."""
        checkpoint_dir = run_dir / "checkpoints"
        return cls.launch(
            [
                "train",
                str(workspace / "recipe.yaml"),
                f"trainer.output_dir={run_dir}",
                "trainer.experiment_name=job",
                f"checkpoint.dir={checkpoint_dir}",
                *overrides,
            ],
            workspace,
            run_dir,
            env,
        )

    @classmethod
    def launch(cls, megarl_args: list[str], cwd: Path, run_dir: Path, env: dict[str, str] | None = None) -> Job:
        """`megarl <megarl_args>` in `cwd`, its output in `run_dir`/job.log (any subcommand)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        ray_tmp = Path(tempfile.mkdtemp(prefix="mrl-", dir="/tmp"))
        log = run_dir / "job.log"
        full_env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("RAY_ADDRESS", None)
        shm = PrivateShm.make()
        with log.open("wb") as sink:
            process = subprocess.Popen(
                shm.wrap([MEGARL, *megarl_args]),
                cwd=cwd,
                env=full_env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(process, run_dir, run_dir / "checkpoints", ray_tmp, log, shm)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "job" / "metrics.jsonl"

    def metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def last_step(self) -> int:
        records = self.metrics()
        return records[-1]["step"] if records else 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update({p.pid: p for p in found})
        return found

    def rank_processes(self) -> tuple[list[psutil.Process], list[psutil.Process]]:
        """(policy ranks, rollout engines) among the job's Ray actors: an engine has vLLM's native
        library mapped, a policy rank does not import vLLM. A checkpoint writer a rank forked is neither."""
        policy, rollout = [], []
        for process in self.descendants():
            try:
                if "RankProcess" not in " ".join(process.cmdline()) or is_rank_fork(process):
                    continue
                maps = Path(f"/proc/{process.pid}/maps").read_text()
            except (psutil.Error, OSError):
                continue
            (rollout if "/vllm/" in maps else policy).append(process)
        return policy, rollout

    def wait_for(self, condition, what: str, timeout_s: float = 240.0) -> None:
        """Poll `condition()` until true; fail if the job exits first or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.descendants()
            if self.process.poll() is not None:
                raise AssertionError(
                    f"the job exited ({self.process.returncode}) before {what}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{self.output()[-4000:]}")
            time.sleep(POLL_S)

    def wait(self, timeout_s: float = 240.0) -> int:
        """The exit code; a job still running after `timeout_s` is killed and the test fails."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stacks = self.driver_stacks()
            self.cleanup()
            raise AssertionError(
                f"the job did not end within {timeout_s:.0f} s:\n{self.output()[-4000:]}\n"
                f"the driver's threads at the deadline:\n{stacks}"
            ) from None

    def driver_stacks(self) -> str:
        """Where the driver is stuck, so a hang seen once in CI can be diagnosed from its log."""
        return python_stacks(self.process.pid)

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this job still alive `EXIT_GRACE_S` after this call (the driver's descendants as
        seen while it ran, plus any process whose command line names this job's Ray temp dir). The grace:
        multiprocessing's resource tracker ends on its own once it sees the driver's pipe close, moments
        after the driver."""
        running = [p for p in self.seen.values() if _alive(p)]
        marker = str(self.ray_tmp)
        for process in psutil.process_iter(["cmdline"]):
            if process.pid not in self.seen and marker in " ".join(process.info["cmdline"] or ()):
                running.append(process)
        _, alive = psutil.wait_procs(running, timeout=EXIT_GRACE_S)
        return [p for p in alive if _alive(p)]

    def cleanup(self) -> None:
        """Kill the job and everything it started (only processes of this job), remove its Ray dir and /dev/shm."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for process in self.leftovers():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        self.shm.remove()


def failed_run_state(job: Job, failed_step: int) -> tuple[list[dict], Checkpoint]:
    """After `job` failed during `failed_step` (checkpoints every 2 steps): its records, which end at the
    step before, and its newest checkpoint, the last even step before the failure (verified)."""
    logged = job.metrics()
    assert logged[-1]["step"] == failed_step - 1
    latest = CheckpointManager(job.checkpoint_dir).latest()
    assert latest.step == failed_step - 1 - (failed_step - 1) % 2
    return logged, latest


def python_stacks(pid: int) -> str:
    """Every thread's Python stack of process `pid` (py-spy, a dependency of the test set)."""
    try:
        return subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(py-spy failed: {error})"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_rank_fork(process: psutil.Process) -> bool:
    """Whether `process` is a fork of a Ray rank: megarl's checkpoint save runs megatron-core's writer in forked
    children of each policy rank (FileSystemWriterAsync.write_preloaded_data_multiproc, a "fork" context), which
    carry the rank's name (`ray::RankProcess...`) and share its pages, for as long as the save writes."""
    return "RankProcess" in " ".join(process.cmdline()) and "RankProcess" in " ".join(process.parent().cmdline())
