"""The fork server's imports (`megarl.parallel.rank_preload`) leave the CUDA runtime alone, so ranks forked
from it on a GPU machine can start it themselves. CPU torch has no CUDA runtime to start: the check stands
in for a CUDA build (`torch.cuda._is_compiled`, as `is_available` and `device_count` ask it) and watches the
two ways torch counts GPUs, the runtime's (`torch._C._cuda_getDeviceCount`, which poisons a later fork) and
NVML's (fork-safe), as torch/cuda/__init__.py's `is_available` and `device_count` choose between them.

The same process then ends as the fork server does (SystemExit once its last client is gone) after forking a
"rank" that runs its exit handlers as a rank does (`spawn._exit_without_finalizing`): the rank passes the
server's exit handler by, the server skips Python's teardown (a module deleted by it would say so)."""

import subprocess
import sys

CHECK = """
import sys
import torch, torch.cuda
runtime = []
compiled = torch.cuda._is_compiled()  # False: read before the stand-in adds the runtime's function
# A CUDA build for the GPU-count question only (torch's compile stack would look for CUDA symbols).
asks = {("is_available", torch.cuda.__file__), ("device_count", torch.cuda.__file__)}
torch.cuda._is_compiled = lambda: (sys._getframe(1).f_code.co_name, sys._getframe(1).f_code.co_filename) in asks or compiled
torch._C._cuda_getDeviceCount = lambda: runtime.append(1) or 0
torch.cuda._device_count_nvml = lambda: 0
import megarl.parallel.rank_preload
print(len(runtime), torch.cuda.is_initialized(), flush=True)

import atexit, os
class Witness:
    def __del__(self):
        os.write(1, b"torn-down\\n")
sys.modules["megarl_teardown_witness"] = Witness()
rank = os.fork()
if rank == 0:
    atexit._run_exitfuncs()
    os.write(1, b"rank-passed\\n")
    os._exit(0)
os.waitpid(rank, 0)
raise SystemExit
"""


def test_the_fork_servers_imports_never_start_the_cuda_runtime_and_it_ends_without_teardown():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["0", "False", "rank-passed"], result.stdout
