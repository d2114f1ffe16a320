"""`VLLMRolloutEngine.shutdown` leaves nothing behind: no worker process, no shared-memory segment a worker
mapped (its CPU collectives' segments, its and the engine's message queues' rings), even when vLLM has to
terminate workers that are still exiting (the common case on a loaded machine, where a worker's interpreter
teardown outlasts vLLM's grace, and the case of workers that a Ctrl-C reached before the engine)."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from pathlib import Path

import psutil

from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

SHM_DIR = Path("/dev/shm")


def _exit_slowly(worker) -> None:
    """In a worker: an exit that never finishes by itself, and the default SIGTERM action, which a
    Python process is back to late in its teardown, so vLLM's SIGTERM ends it on the spot."""
    atexit.register(threading.Event().wait)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _pid(worker) -> int:
    return os.getpid()


def mapped_shm(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (/proc/<pid>/maps)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split(maxsplit=5)[5]).name for line in lines if f" {SHM_DIR}/" in line}


def test_tp2_shutdown_of_terminated_workers_leaves_no_shm_and_no_process(base_model_dir, monkeypatch):
    # No grace: vLLM terminates the workers as soon as it has asked them to exit.
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "0")
    engine = make_rollout_engine(
        "vllm", EngineArgs(base_model_dir, tensor_parallel_size=2, dtype="float32", max_model_len=64)
    )
    pids = engine._llm.collective_rpc(_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    names = set().union(*map(mapped_shm, pids))
    assert sum(name.startswith("psm_") for name in names) >= 3, names  # the broadcast queue, 2 response queues
    engine._llm.collective_rpc(_exit_slowly)

    engine.shutdown()

    assert [name for name in names if (SHM_DIR / name).exists()] == []
    assert [pid for pid in pids if psutil.pid_exists(pid)] == []
