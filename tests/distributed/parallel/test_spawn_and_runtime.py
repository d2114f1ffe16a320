"""The spawn harness reports failures by rank; the CPU runtime stays out of the way with CUDA."""

import os
import subprocess
import sys

import pytest

from megarl.parallel.spawn import DistributedFailure, run_distributed


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the harness killing it


def _exit_without_result():
    os._exit(3)


class _WritesWhenFinalized:
    """Writes its file when Python's module teardown collects it (a module global's `__del__`)."""

    def __init__(self, path):
        self.path = path

    def __del__(self, _open=open):  # bound now: teardown may have emptied the builtins by then
        with _open(self.path, "w") as file:
            file.write("finalized")


def _leave_exit_work(directory):
    """Registers an atexit handler (must run: a rank's cleanup) and parks an object for module teardown
    (skipped: `spawn._exit_without_finalizing`); returns a large result, which must reach the parent whole."""
    import atexit

    import torch.distributed as dist

    rank = dist.get_rank()
    atexit.register(lambda: open(os.path.join(directory, f"atexit{rank}"), "w").close())
    sys.modules[__name__]._parked = _WritesWhenFinalized(os.path.join(directory, f"finalized{rank}"))
    return [rank] * 1_000_000


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_a_rank_runs_its_atexit_handlers_and_skips_module_teardown(tmp_path):
    """After its result, a rank runs atexit handlers and exits without Python's module teardown (a full
    garbage collection over megatron, transformers and torch, seconds per rank): the handlers' files
    exist, the teardown's does not, and a result far larger than a pipe's buffer arrives whole."""
    results = run_distributed(_leave_exit_work, 2, str(tmp_path))
    assert results == [[0] * 1_000_000, [1] * 1_000_000]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["atexit0", "atexit1"]


def test_failure_names_rank_and_traceback():
    with pytest.raises(DistributedFailure, match=r"rank 1 of 2 failed:(.|\n)*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=120)


def test_dead_rank_is_reported():
    with pytest.raises(DistributedFailure, match=r"exited with code 3"):
        run_distributed(_exit_without_result, 1, timeout_s=120)


_CHECK_NOOP_WITH_CUDA = """
import torch
torch.cuda.is_available = lambda: True
from megarl.parallel import cpu_runtime
import megatron.core.utils as mutils
original_type = torch.Tensor.type
cpu_runtime.install()
assert not cpu_runtime.is_active()
assert mutils.torch is torch, "megatron module was redirected although CUDA is available"
assert torch.Tensor.type is original_type
"""

_CHECK_ACTIVE_ON_CPU = """
import torch
from megarl.parallel import cpu_runtime
import megatron.core.utils as mutils
cpu_runtime.install()
assert cpu_runtime.is_active()
buf = mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "x")
assert buf.device.type == "cpu" and buf.shape == (2, 3)
import megatron.core.transformer.utils as tutils
assert tutils.get_default_causal_mask(4).device.type == "cpu"
# Only megatron callers see CUDA type names.
assert torch.zeros(1).type() == "torch.FloatTensor"
"""

_CHECK_CPU_DECIDED_ON_A_GPU_MACHINE = """
import os
import torch
torch.cuda.is_available = lambda: True
os.environ["MEGARL_DEVICE"] = "cpu"  # trainer.device=cpu, as the driver hands it to every worker
from megarl.parallel import cpu_runtime
from megarl.parallel.distributed import default_backend
cpu_runtime.install()
assert cpu_runtime.is_active(), "the CPU runtime must follow the driver's decision, not this process's CUDA"
assert default_backend() == "gloo"
"""


@pytest.mark.parametrize(
    "script",
    [_CHECK_NOOP_WITH_CUDA, _CHECK_ACTIVE_ON_CPU, _CHECK_CPU_DECIDED_ON_A_GPU_MACHINE],
    ids=["cuda-noop", "cpu-active", "cpu-decided-on-gpu-machine"],
)
def test_cpu_runtime(script):
    # A fresh interpreter: install() patches process-wide state.
    subprocess.run([sys.executable, "-c", script], check=True)
