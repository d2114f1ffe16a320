"""What a `megarl.parallel.spawn` rank imports before its function runs, imported once in multiprocessing's
fork server (`spawn._context`), from which every rank is forked: a rank then starts in ~0.1 s instead of
importing torch, megatron-core and transformers afresh (4-8 s of CPU each on a 2-core machine, where a
test's or a command's ranks start together and share the cores).

`quiet.install()` first: the fork server's imports print megatron-core's start-up warnings once, filtered
as every rank's would be. Nothing here may start a thread (a fork copies only the forking thread): torch,
megatron-core and transformers start theirs at first use, in the rank. Nor the CUDA runtime, which a forked
rank could not use ("Cannot re-initialize CUDA in forked subprocess"): `quiet.install` asks whether a GPU
is there (`torch.cuda.is_available`), which torch answers from NVML, without the runtime, with
`PYTORCH_NVML_BASED_CUDA_CHECK=1` (set in the fork server only: a rank takes its caller's environment).

The fork server ends without Python's teardown (`_end_server_now`).
"""

import atexit
import os

os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

from megarl import quiet

quiet.install()

import megatron.core  # noqa: E402
import megatron.core.models.gpt  # noqa: E402, F401
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401

from megarl.parallel import distributed  # noqa: E402, F401

_SERVER_PID = os.getpid()


def _end_server_now() -> None:
    """End the fork server at once when it ends (its last client gone: multiprocessing raises SystemExit in
    it): its teardown would garbage-collect everything imported above, 10.7 s measured on a busy machine,
    and the server would outlive the command that used it by that much. A rank, a fork of the server,
    inherits this handler and passes it by."""
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_end_server_now)
