"""The fork server's imports (`megarl.parallel.rank_preload`) leave the CUDA runtime alone, so ranks forked
from it on a GPU machine can start it themselves. CPU torch has no CUDA runtime to start: the check stands
in for a CUDA build (`torch.cuda._is_compiled`, as `is_available` and `device_count` ask it) and watches the
two ways torch counts GPUs, the runtime's (`torch._C._cuda_getDeviceCount`, which poisons a later fork) and
NVML's (fork-safe), as torch/cuda/__init__.py's `is_available` and `device_count` choose between them."""

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
print(len(runtime), torch.cuda.is_initialized())
"""


def test_the_fork_servers_imports_never_start_the_cuda_runtime():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["0", "False"], result.stdout
