"""What one worker process holds in memory right now, for the hand-over's per-phase metrics
(`megarl.cluster.handover`: `memory/<role>/<phase>/<stat>`).

On CUDA: `allocated_gib` (tensors alive, torch's allocator), `reserved_gib` (what the allocator keeps
from the device, freed or not) and `device_used_gib` (the whole GPU as the driver sees it: every
process on it, vLLM's memory pool included, which torch's counters of this process do not see). On
CPU: `rss_gib`, the resident memory of this process and of the processes it started (a TP > 1 vLLM
engine's workers), read from Linux's /proc.

`empty_cache` hands freed memory back to where it came from: torch's CUDA caching allocator keeps freed
blocks until `torch.cuda.empty_cache()`; on CPU, glibc's malloc keeps freed heap pages (every chunk
below its mmap threshold, which rises to 32 MiB as large blocks come and go) until `malloc_trim`, so
a freed gradient buffer would not leave the process's RSS without it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from megarl.parallel.device import uses_cuda

GIB = 2**30


def memory_stats() -> dict[str, float]:
    """This process's memory in GiB, by stat name (see the module docstring)."""
    if uses_cuda():
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated_gib": torch.cuda.memory_allocated() / GIB,
            "reserved_gib": torch.cuda.memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB,
        }
    return {"rss_gib": sum(_rss_bytes(pid) for pid in _process_tree(os.getpid())) / GIB}


def free_device_memory() -> tuple[float, float] | None:
    """(free, total) GiB of this process's GPU as the driver sees it, every process on it counted;
    None on CPU."""
    if not uses_cuda():
        return None
    free, total = torch.cuda.mem_get_info()
    return free / GIB, total / GIB


def empty_cache() -> None:
    """Return this process's freed memory to the device (CUDA: torch's allocator cache) or to the OS
    (CPU: glibc's `malloc_trim(0)`, which releases the free pages of every malloc arena)."""
    if uses_cuda():
        torch.cuda.empty_cache()
    else:
        _LIBC.malloc_trim(0)


_LIBC = ctypes.CDLL("libc.so.6")
"""glibc, for `malloc_trim` (Linux only, as /proc above)."""


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (threads' children included), as /proc lists them now."""
    tree, frontier = [pid], [pid]
    while frontier:
        children = []
        for parent in frontier:
            for task in Path(f"/proc/{parent}/task").glob("*/children"):
                children += [int(child) for child in _read(task).split()]
        tree += children
        frontier = children
    return tree


def _rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` (0 when it has exited meanwhile): /proc/<pid>/statm's second field, in pages."""
    fields = _read(Path(f"/proc/{pid}/statm")).split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):  # a process that exited between listing and reading
        return ""
