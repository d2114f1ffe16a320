"""CPU soak: a long quickstart-sized GRPO run with periodic checkpoints and one forced resume, watching
the resident memory and open file descriptors of every process of the job.

    .venv/bin/python tests/e2e/reliability/soak.py --steps 200 --save-freq 20 --out /tmp/soak   # ~10 min here

Phase 1 trains towards `--steps` and is stopped by killing one policy rank inside the actor update
once it passed the checkpoint at `--resume-at` (the job must end within `KILL_TO_EXIT_S`); phase 2
resumes (`checkpoint.resume=auto`) and finishes. Every
`--interval` seconds each process is sampled (psutil: RSS, open fds) and tagged with the last logged
step. The report (JSON, printed and written to OUT/soak.json) gives per phase and per role
(driver, policy, rollout, reward, mp_helper, ray) the RSS and fds at the first sample after `--warmup` steps,
at the end, and the peak, plus processes left alive after each phase. Exit code 1 if a bound of
`check()` is exceeded. The suite's short version is test_soak.py.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from reliability_job import Job, is_rank_fork, make_workspace, python_stacks

MIB = 1024 * 1024
RSS_GROWTH_BOUND_MIB = 64.0
"""Allowed RSS growth of a role's processes (summed) between the first sample after warm-up and the
end of a phase. A leak of one batch per step (16 prompts × 8 samples) would exceed it well before 200 steps."""
WINDOW = 3
"""Samples whose median is a phase's start or end figure."""
FD_GROWTH_BOUND = 16
"""Allowed growth of a role's open file descriptors (summed) over the same span."""
KILL_TO_EXIT_S = 120.0
"""How long phase 1 may take to end once its policy rank is killed: Ray reports the actor's death within
seconds; the rest is the driver's shutdown of the other processes and of Ray."""


def role_of(process: psutil.Process, driver_pid: int, rollout_pids: set[int]) -> str:
    if process.pid == driver_pid:
        return "driver"
    line = " ".join(process.cmdline())
    if "RankProcess" in line:
        return "rollout" if process.pid in rollout_pids else "policy"
    if "megarl.rewards.worker" in line:
        return "reward"
    if "from multiprocessing." in line:
        return (
            "mp_helper"  # e.g. the save worker (and its resource tracker) a policy rank starts at its first checkpoint
        )
    return "ray"


def sample(job: Job, rollout_pids: set[int]) -> dict:
    """One sample: step, per role the summed RSS (MiB), open fds and process count, and whether a checkpoint
    save was writing (`saving`: a policy rank had a forked writer)."""
    roles: dict[str, dict[str, float]] = {}
    saving = False  # a rank's forked checkpoint writer counts the rank's shared pages again
    for process in [psutil.Process(job.process.pid), *job.descendants()]:
        try:
            role = role_of(process, job.process.pid, rollout_pids)
            rss, fds = process.memory_info().rss / MIB, process.num_fds()
            saving = saving or (role == "policy" and is_rank_fork(process))
        except psutil.Error:
            continue
        entry = roles.setdefault(role, {"rss_mib": 0.0, "fds": 0, "processes": 0})
        entry["rss_mib"] += rss
        entry["fds"] += fds
        entry["processes"] += 1
    return {"time": time.monotonic(), "step": job.last_step(), "roles": roles, "saving": saving}


def watch(job: Job, interval_s: float, stop_when=None) -> list[dict]:
    """Sample until the job exits (or `stop_when(job)` is true: then return without waiting)."""
    samples, rollout_pids = [], set()
    while job.process.poll() is None:
        if len(rollout_pids) < 2:
            rollout_pids = {p.pid for p in job.rank_processes()[1]}
        samples.append(sample(job, rollout_pids))
        if stop_when is not None and stop_when(job):
            break
        time.sleep(interval_s)
    return samples


def summarize(samples: list[dict], warmup: int) -> dict:
    """Per role: RSS and fds at the start (median of the first `WINDOW` samples at/after `warmup` steps)
    and at the end (median of the last `WINDOW` samples taken while the job still trained, i.e. before
    its last logged step), and the peak. Samples taken during a checkpoint save are left out (its writer
    processes come and go: under load a save spans several samples, and counted as growth twice the ranks'
    memory); medians, because other moments of a step briefly add memory and fds too."""
    final_step = max((s["step"] for s in samples), default=0)
    settled = [s for s in samples if warmup <= s["step"] < final_step and s["roles"] and not s["saving"]]
    if len(settled) < 2 * WINDOW:
        return {}
    head, tail = settled[:WINDOW], settled[-WINDOW:]
    summary = {"from_step": head[0]["step"], "to_step": tail[-1]["step"], "samples": len(settled), "roles": {}}
    for role in sorted(set(head[0]["roles"]) & set(tail[-1]["roles"])):

        def median(window, key):
            return statistics.median(s["roles"].get(role, {}).get(key, 0) for s in window)

        summary["roles"][role] = {
            "processes": tail[-1]["roles"][role]["processes"],
            "rss_start_mib": round(median(head, "rss_mib"), 1),
            "rss_end_mib": round(median(tail, "rss_mib"), 1),
            "rss_peak_mib": round(max(s["roles"].get(role, {}).get("rss_mib", 0.0) for s in settled), 1),
            "rss_growth_mib": round(median(tail, "rss_mib") - median(head, "rss_mib"), 1),
            "fds_start": median(head, "fds"),
            "fds_end": median(tail, "fds"),
            "fds_growth": median(tail, "fds") - median(head, "fds"),
        }
    return summary


def check(report: dict) -> list[str]:
    """Every bound the report exceeds, as sentences (empty: all within bounds)."""
    failures = []
    for phase in ("phase1", "phase2"):
        if not report[phase]["summary"]:
            failures.append(f"{phase}: fewer than {2 * WINDOW} samples after warm-up; sample more often or run longer")
        for role, figures in report[phase]["summary"].get("roles", {}).items():
            if figures["rss_growth_mib"] > RSS_GROWTH_BOUND_MIB:
                failures.append(f"{phase} {role}: RSS grew {figures['rss_growth_mib']} MiB > {RSS_GROWTH_BOUND_MIB}")
            if figures["fds_growth"] > FD_GROWTH_BOUND:
                failures.append(f"{phase} {role}: open fds grew by {figures['fds_growth']} > {FD_GROWTH_BOUND}")
        if report[phase]["leftover_processes"]:
            failures.append(f"{phase}: processes left alive: {report[phase]['leftover_processes']}")
    if report["phase1"]["exit_code"] == 0 or report["phase2"]["exit_code"] != 0:
        failures.append(
            f"exit codes {report['phase1']['exit_code']}, {report['phase2']['exit_code']}: expected "
            "the killed phase 1 to fail and the resumed phase 2 to succeed"
        )
    if report["resumed_from"] < report["resume_at"]:
        failures.append(f"phase 2 resumed from step {report['resumed_from']}, before {report['resume_at']}")
    if report["steps_logged"] != list(range(1, report["steps"] + 1)):
        failures.append("metrics.jsonl does not hold each step once after the resume")
    return failures


def write_samples(path: Path, samples: list[dict]) -> None:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))


def run_soak(
    workspace: Path, out: Path, *, steps: int, save_freq: int, resume_at: int, warmup: int, interval_s: float = 1.0
) -> dict:
    from megarl.trainer.checkpoint_manager import CheckpointManager

    overrides = [
        f"trainer.total_steps={steps}",
        f"checkpoint.save_freq={save_freq}",
        "trainer.total_epochs=1000",
        "checkpoint.max_keep=2",
    ]
    report = {"steps": steps, "save_freq": save_freq, "resume_at": resume_at, "warmup": warmup}
    first = Job.start(workspace, out, overrides)
    try:
        started = time.monotonic()
        samples = watch(first, interval_s, stop_when=lambda job: job.last_step() > resume_at)
        victim = first.rank_processes()[0][-1]
        # Its TP peer then waits for it in a collective: the death must be found all the same.
        first.wait_for(lambda: "update_actor" in python_stacks(victim.pid), "a policy rank inside update_actor")
        victim.kill()
        code = first.wait(KILL_TO_EXIT_S)
        write_samples(out / "samples-phase1.jsonl", samples)
        report["phase1"] = {
            "exit_code": code,
            "killed_pid": victim.pid,
            "failure": re.findall(r"megarl train: failed during .*\n.*", first.output()),
            "last_step": first.last_step(),
            "seconds": round(time.monotonic() - started, 1),
            "summary": summarize(samples, warmup),
            "leftover_processes": [p.pid for p in first.leftovers()],
        }
    finally:
        first.cleanup()
    report["resumed_from"] = CheckpointManager(first.checkpoint_dir).latest().step
    second = Job.start(workspace, out, overrides)
    try:
        started = time.monotonic()
        samples = watch(second, interval_s)
        code = second.wait(60)
        write_samples(out / "samples-phase2.jsonl", samples)
        report["phase2"] = {
            "exit_code": code,
            "seconds": round(time.monotonic() - started, 1),
            "summary": summarize(samples, report["resumed_from"] + warmup),
            "leftover_processes": [p.pid for p in second.leftovers()],
        }
        report["steps_logged"] = [r["step"] for r in second.metrics()]
        if code != 0:
            report["phase2"]["output_tail"] = second.output()[-3000:]
    finally:
        second.cleanup()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-freq", type=int, default=20)
    parser.add_argument("--resume-at", type=int, default=100, help="kill phase 1 once this step's checkpoint exists")
    parser.add_argument(
        "--warmup",
        type=int,
        default=25,
        help="steps before the memory baseline: after the first checkpoint, whose save starts "
        "long-lived helper processes",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=None, help="run dir (default: a new temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="megarl-soak-"))
    workspace = make_workspace(Path(tempfile.mkdtemp(prefix="megarl-soak-ws-")))
    report = run_soak(
        workspace,
        out,
        steps=args.steps,
        save_freq=args.save_freq,
        resume_at=args.resume_at,
        warmup=args.warmup,
        interval_s=args.interval,
    )
    report["failures"] = check(report)
    text = json.dumps(report, indent=1)
    (out / "soak.json").write_text(text + "\n")
    print(text)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
