"""The weight-sync process group: the trainer's sending ranks, then the rollout workers
(`plan.sender_rank` / `receiver_rank`; the trainer's global rank 0 is group rank 0).

It is standalone, made from a `TCPStore` and a process-group object directly, not through
`torch.distributed.init_process_group`: each side already has its own default world (Megatron's on
the trainer, vLLM's inside the workers) and neither may be disturbed. Gloo on CPU, NCCL on GPU,
chosen by the device, the same code path otherwise. Both sides use this module:

    # trainer rank 0 hosts the store; every sending rank and every rollout worker joins
    group = create_weight_sync_group(host, port, rank, W, 60)
    # then: shard_sync.ShardSender(..., group).send()  /  shard_sync.receive_rank_shards(group, plan, r, device)

Group creation blocks until all W ranks have joined, so all sides must run it concurrently.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import listen_store


def listen_weight_sync_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, listening on `host` alone, on a port the OS picks (no window in which another
    process can take a port chosen in advance); hand `store.port` to the other ranks, then pass the
    store to `create_weight_sync_group`."""
    return listen_store(host, world_size, timeout_s)


def join_weight_sync_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store another process hosts at host:port (`listen_weight_sync_store`); any rank,
    rank 0 included, joins it this way when the store's host is not a rank of the group."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def create_weight_sync_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, store: dist.Store | None = None
) -> dist.ProcessGroup:
    """Join (rank 0: host, or bring `store` from `listen_weight_sync_store`) the store at host:port
    and form a `world_size`-rank group; NCCL when this process computes on CUDA (`device.uses_cuda`), gloo
    otherwise. Collectives time
    out after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = (listen_store(host, world_size, timeout_s, port) if rank == 0
                 else join_weight_sync_store(host, port, world_size, timeout_s))
    if uses_cuda():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Bind gloo to this process's address on the route to the store (127.0.0.1 for a local run),
    # not to the hostname's interface: the store's own address exists only on rank 0's node.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_towards(host, port))]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def address_towards(host: str, port: int) -> str:
    """The local address this process uses to reach host:port (a listening store): the interface a
    rank on another node must bind its side of the group to."""
    with socket.create_connection((host, port)) as connection:
        return connection.getsockname()[0]


def join_weight_sync_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """`create_weight_sync_group` for any rank, rank 0 included, of a group whose store another process
    hosts at host:port (`listen_weight_sync_store`, listening before any rank starts)."""
    return create_weight_sync_group(host, port, rank, world_size, timeout_s,
                                    store=join_weight_sync_store(host, port, world_size, timeout_s))
