"""The weight-sync process group: the trainer's sending ranks, then the rollout workers
(`schedule.sender_rank` / `receiver_rank`; the trainer's global rank 0 is group rank 0).

It is standalone, made from a `TCPStore` and a process-group object directly, not through
`torch.distributed.init_process_group`: each side already has its own default world (Megatron's on
the trainer, vLLM's inside the workers) and neither may be disturbed. Gloo on CPU, NCCL on GPU,
chosen by the device, the same code path otherwise. Both sides use this module:

    store = listen_weight_sync_store(host, W, 60)  # trainer rank 0 (or the driver), before anyone joins
    group = create_weight_sync_group(host, store.port, 0, W, 60, store=store)  # its own rank, if it has one
    group = create_weight_sync_group(host, port, rank, W, 60)  # every other sending rank and rollout worker
    # then: shard_sync.ShardSender(..., group).send()  /  shard_sync.receive_rank_shards(group, plan, r, device)

Group creation blocks until all W ranks have joined, so all sides must run it concurrently.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import listen_store


def listen_weight_sync_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The group's store, listening on `host` alone, on a port the OS picks (no window in which another
    process can take a port chosen in advance). Open it before any rank connects (trainer rank 0, or the
    process that starts the ranks) and keep it alive; hand `store.port` to the ranks, and the store
    itself to `create_weight_sync_group` in the process that hosts it."""
    return listen_store(host, world_size, timeout_s)


def create_weight_sync_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, store: dist.Store | None = None
) -> dist.ProcessGroup:
    """Form a `world_size`-rank group over the store at host:port: `store` where this process hosts it
    (`listen_weight_sync_store`), else joined as a client, whatever the rank. NCCL when this process
    computes on CUDA (`device.uses_cuda`), gloo otherwise. Collectives time out after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
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
