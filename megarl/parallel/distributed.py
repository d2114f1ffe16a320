"""torch.distributed start-up and megatron-core's model-parallel grid, passed around explicitly.

megatron-core keeps its grid in module globals (`parallel_state`). This module is the one place that
reads them: it builds the grid once per process and hands out a `ProcessGroups` object that the rest
of megarl passes in, so no other code asks megatron's globals which group it is in.
"""

import dataclasses
import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.parallel import cpu_runtime
from megarl.parallel.device import uses_cuda
from megarl.parallel.seed import seed_everything

DEFAULT_TIMEOUT_S = 600
LOOPBACK_INTERFACE = "lo"
"""Linux's name for the loopback interface (gloo and NCCL bind by interface name)."""


def default_backend(cuda: bool | None = None) -> str:
    """NCCL for a process that computes on CUDA (`cuda`; None: `device.uses_cuda`), gloo otherwise."""
    return "nccl" if (uses_cuda() if cuda is None else cuda) else "gloo"


def init_distributed(
    timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.TCPStore | None = None, cuda: bool | None = None
) -> None:
    """Join the torch.distributed world described by the RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT (and LOCAL_RANK: the CUDA ordinal of the process's GPU) environment variables.

    Rank 0 serves the rendezvous store on MASTER_ADDR only (`listen_store`), or brings the one it
    opened earlier as `store`. A world that meets on a loopback address is machine-local: its gloo
    connections and NCCL's bootstrap are kept on the loopback interface too (unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise), so nothing of it can be reached from
    another machine. Collectives time out after `timeout_s`, so a dead peer ends the job instead of
    hanging it. `cuda`: join with NCCL on LOCAL_RANK's GPU, else with gloo (None: `uses_cuda()`); a
    process of a CUDA run that holds no GPU (a TP > 1 rollout engine: its vLLM workers hold them) passes
    False, so it neither opens a CUDA context nor joins NCCL with another process's GPU.
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variables {missing} are not set; start the process with "
            "torchrun, megarl.parallel.spawn.run_distributed, or a megarl worker group."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if is_loopback(host):
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, LOOPBACK_INTERFACE)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = (
            listen_store(host, world_size, timeout_s, port)
            if rank == 0
            else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        )
    cuda = uses_cuda() if cuda is None else cuda
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=default_backend(cuda),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def listen_store(host: str, world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on `host` alone (a `TCPStore` left to itself listens on
    every interface). `port=0`: a port the OS picks, held from then on, so no other process can take
    it before the peers connect; hand `store.port` to them."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=max(128, world_size))
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) means this machine's loopback interface."""
    address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    return ipaddress.ip_address(address).is_loopback


@dataclass(frozen=True)
class ProcessGroups:
    """The model-parallel grid of this process (one grid per process, shared by the roles it hosts).

    `collection` is megatron-core's `ProcessGroupCollection`, to pass into `GPTModel`, DDP and the
    optimizer; the named groups below are for megarl's own collectives.
    """

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    collection: object
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    vpp_size: int = 1
    """Virtual pipeline stages per PP rank (model chunks this rank holds; 1 without the interleaved schedule)."""
    ep: dist.ProcessGroup | None = None
    """Megatron's expert-parallel group (the ranks that split the experts of one layer); None for ep 1."""
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_rank: int = 0
    """Rank in the expert-data-parallel group (replicas of the same experts); the dense `dp_rank`
    counts the EP ranks too (EP is carved out of DP)."""
    etp: dist.ProcessGroup | None = None
    """Megatron's expert-tensor-parallel group (the ranks that split each expert's matrices); the TP
    group when ETP = TP."""
    etp_rank: int = 0
    etp_size: int = 1
    cp: dist.ProcessGroup | None = None
    """Megatron's context-parallel group (the ranks that split each sequence: same weights, same samples,
    different tokens); None for cp 1."""
    cp_rank: int = 0
    cp_size: int = 1
    dp_cp: dist.ProcessGroup | None = None
    """The data-parallel group with the context-parallel ranks in it (megatron's
    `get_data_parallel_group(with_context_parallel=True)`), over which gradients are reduced; `dp` (samples)
    when cp is 1."""

    @property
    def grad_group(self) -> dist.ProcessGroup:
        """The ranks whose gradients are summed into one step: DP × CP (`dp_cp`), `dp` without CP."""
        return self.dp if self.dp_cp is None else self.dp_cp

    def weight_replicas(self) -> "ProcessGroups":
        """The grid as the weight sync and the HF export see it: the CP ranks of a DP replica hold the same
        weights, so each (DP, CP) pair is a replica of them (`dp_rank` its rank in the DP × CP group, DP
        replica 0's CP rank 0 being replica 0, the one that sends); the grid itself without CP."""
        if self.dp_cp is None:
            return self
        return dataclasses.replace(self, dp_rank=dist.get_rank(self.dp_cp), dp_size=self.dp_cp.size())

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def initialize_model_parallel(
    tp: int,
    pp: int,
    seed: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    vpp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
) -> ProcessGroups:
    """Build megatron-core's (TP, CP, PP, DP) grid on an initialised world, install the CPU runtime when
    there is no GPU, and seed every RNG (the model-parallel streams included).

    DP is world_size / (tp * cp * pp). `cp` > 1: each sequence is split over that many ranks (context
    parallelism); they hold the same weights and take the same samples (the same `dp_rank`), and their
    gradients are reduced with DP's (`ProcessGroups.grad_group`). `vpp` > 1: each PP rank holds that many
    virtual stages (model chunks) and megatron runs its interleaved schedule. The experts have a grid of their own over the same ranks
    (megatron's): expert-TP `etp` (None: `tp`) × EP `ep` × expert-DP × PP, so ETP × EP must divide
    world_size / pp. Calling it again with the same sizes returns the same grid.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    cpu_runtime.install()
    world = dist.get_world_size()
    if world % (tp * cp * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tensor parallel {tp} × context parallel {cp} × pipeline "
            f"parallel {pp} = {tp * cp * pp}; choose sizes whose product divides the number of processes"
        )
    etp = tp if etp is None else etp
    if (world // pp) % (etp * ep):
        raise ValueError(
            f"expert tensor parallel {etp} × expert parallel {ep} = {etp * ep} does not divide the {world // pp} "
            f"ranks of a pipeline stage (world {world} / PP {pp}): megatron lays the experts out as "
            "ETP × EP × expert-DP on each stage; choose ETP × EP dividing it"
        )
    if mpu.model_parallel_is_initialized():
        shape = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
            mpu.get_expert_model_parallel_world_size(),
            mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
        )
        if shape != (tp, pp, vpp, ep, etp, cp):
            raise RuntimeError(
                "this process already has a model-parallel grid of a different shape; megarl keeps one "
                "grid per process (a role with another layout runs in processes of its own)"
            )
    else:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            context_parallel_size=cp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    groups = ProcessGroups(
        tp=mpu.get_tensor_model_parallel_group(),
        pp=mpu.get_pipeline_model_parallel_group(),
        dp=mpu.get_data_parallel_group(),
        mp=mpu.get_model_parallel_group(),
        collection=ProcessGroupCollection.use_mpu_process_groups(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_size=pp,
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        vpp_size=vpp,
        ep=mpu.get_expert_model_parallel_group() if ep > 1 else None,
        ep_rank=mpu.get_expert_model_parallel_rank(),
        ep_size=ep,
        expert_dp_rank=mpu.get_expert_data_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_group(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        etp_size=etp,
        cp=mpu.get_context_parallel_group() if cp > 1 else None,
        cp_rank=mpu.get_context_parallel_rank(),
        cp_size=cp,
        dp_cp=mpu.get_data_parallel_group(with_context_parallel=True) if cp > 1 else None,
    )
    seed_everything(seed, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank)
    return groups


def destroy() -> None:
    """Tear down megatron's grid and the torch.distributed world of this process."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
