"""Run a function in N fresh processes that form a torch.distributed world (tests, CLI tools).

The processes are forked from multiprocessing's fork server, which imported torch, megatron-core and
transformers once (`_context`, `megarl.parallel.rank_preload`).

Usage:
    def check(x):                       # module-level, so the spawned processes can import it
        groups = initialize_model_parallel(tp=2, pp=1, seed=0)
        return groups.tp_rank * x

    run_distributed(check, 2, 10)       # -> [0, 10]

A failure on any rank stops every rank and raises `DistributedFailure` naming the rank with its
traceback; a rank that does not finish within `timeout_s` is killed and reported the same way. A stop
requested by a signal (`megarl.interrupt`, the CLI's `StopOnSignal`) is raised at the next poll and
kills the ranks on its way out; a caller killed outright takes its ranks with it (`_die_with_caller`).
Each rank leads a process group of its own, killed whole: a rank's own children go with it (megatron-core's
checkpoint writer starts a multiprocessing manager, a server that would otherwise outlive a killed rank
forever, and with it multiprocessing's resource tracker, which waits for every holder of its pipe).
"""

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl import interrupt


class DistributedFailure(RuntimeError):
    """A rank of a `run_distributed` world raised or timed out."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a rendezvous), drawn below the kernel's
    ephemeral range: a port the kernel hands out for `bind(0)` is also what it gives the next outgoing
    connection of any process, which took a chosen rendezvous port before its listener bound it
    ("Address already in use")."""
    low = max(_ephemeral_range()[0], _FIRST_PORT + 64)  # a kernel set to hand out low ports: share its range
    for port in random.Random().sample(range(_FIRST_PORT, low), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host} between {_FIRST_PORT} and {low}")


_FIRST_PORT = 20000
"""Above the ports services usually claim."""


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _context():
    """multiprocessing's fork server, preloaded with what every rank imports (`rank_preload`): ranks are
    forked from it, with the caller's sys.path and working directory (multiprocessing's preparation data)
    and its environment (`_rank_main`), as fresh spawned processes would have."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["megarl.parallel.rank_preload"])
    return context


def _die_with_caller(caller: int) -> None:
    """SIGKILL this rank's process group as soon as its caller (pid `caller`) ends, so no rank outlives a caller killed
    (SIGKILL, OOM) before its clean-up ran: a thread waits on the caller's pidfd (readable once it ended).
    The kernel's parent-death signal cannot do it: a rank's parent is the fork server, which lives while
    any process holds its "alive" pipe, and every rank inherits that pipe (multiprocessing.forkserver)."""
    try:
        caller_fd = os.pidfd_open(caller)
    except ProcessLookupError:  # ended already
        os._exit(1)

    def watch() -> None:
        select.select([caller_fd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="megarl-caller-watch", daemon=True).start()


def _rank_main(fn, args, rank, world_size, port, collective_timeout_s, results, caller, environment):
    os.setpgid(0, 0)  # before any child of its own: `_kill_rank` and `_die_with_caller` kill the group
    _die_with_caller(caller)
    os.environ.clear()  # the fork server's is the caller's at the server's start: take the caller's now
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from megarl import quiet

    quiet.install()
    # Each rank gets one intra-op thread: N ranks share the machine's cores.
    import torch

    torch.set_num_threads(1)
    from megarl.parallel.distributed import destroy, init_distributed

    try:
        init_distributed(timeout_s=collective_timeout_s)
        # Pickled to bytes here: the queue would share tensor storage by file descriptor, which
        # vanishes when this process exits before the parent reads it.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy()
    _exit_without_finalizing(results)


def _kill_rank(process) -> None:
    """SIGKILL a rank and every process of its group (`_rank_main`); a rank that has not made its group
    yet has started no process, and the plain kill ends it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no group yet, or it ended and its pid is another's now
        pass
    process.kill()


def _exit_without_finalizing(results) -> None:
    """End a rank whose result is on its way: the queue's feeder thread flushes it into the pipe,
    atexit handlers run (shared-memory unlinks, multiprocessing's finalizers), stdio is flushed, and the
    process ends without Python's module teardown, a full garbage collection over everything the rank
    imported (megatron-core, transformers, torch) that took 2-4 s per rank on an idle machine (gdb:
    `finalize_modules` → `_PyGC_CollectNoFail`) and had each `run_distributed` wait that long for it."""
    results.close()
    results.join_thread()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 120.0,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` gloo ranks; return the per-rank results in rank order."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environment = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, rank, world_size, port, collective_timeout_s, results, os.getpid(), environment),
            name=f"megarl-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            interrupt.check()  # a stop signal: the ranks are killed below
            remaining = deadline - time.monotonic()
            try:
                rank, ok, value = results.get(timeout=max(0.0, min(remaining, 1.0)))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise DistributedFailure(
                        f"rank {dead[0]} of {world_size} exited with code {procs[dead[0]].exitcode} "
                        "without reporting a result"
                    ) from None
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise DistributedFailure(
                        f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s"
                    ) from None
                continue
            if not ok:
                raise DistributedFailure(f"rank {rank} of {world_size} failed:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        if len(outputs) < world_size:
            for p in procs:  # peers of a failed rank may be blocked in a collective
                _kill_rank(p)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                _kill_rank(p)
                p.join()
    return [outputs[r] for r in range(world_size)]
