"""The CUDA IPC ring on a real GPU: a sender (this process, standing for a trainer rank) streams
buckets through two CUDA IPC slots (`CudaIpcTransport`) to a reader in another process on the same
GPU (standing for the colocated engine worker), which opens each handle by the GPU's UUID on its own
index and reads the buffers in place. CPU twin: the shared-memory ring (tests/unit/rollout/
test_shared_memory_transport.py, tests/distributed/bridge/test_per_device_rings.py) and the fake-UUID
keying (tests/unit/gpu_contracts/test_cuda_ipc_contract.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from megarl.bridge.per_rank import bucketed
from megarl.bridge.protocol import pack
from megarl.bridge.shared_ring import read_ring
from megarl.bridge.transports.cuda_ipc import CudaIpcTransport, local_index, pack_ipc_bucket, visible_uuids

pytestmark = pytest.mark.gpu

TIMEOUT_S = 120


def _reader(ring, results) -> None:
    """The engine worker on the sender's GPU: every tensor of the sync, copied to the CPU."""
    torch.cuda.set_device(0)
    got = {}
    read_ring(
        ring,
        "reader on cuda:0",
        torch.device("cuda", 0),
        lambda tensors: got.update({name: tensor.cpu() for name, tensor in tensors}),
    )
    results.put(got)


def test_buckets_are_keyed_by_the_gpus_uuid():
    flat, metadata = pack([("model.norm.weight", torch.ones(8, device="cuda"))])
    bucket = pack_ipc_bucket(flat, metadata)
    assert bucket.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
    assert local_index(bucket.device_uuid, visible_uuids(), own=0) == 0


def test_a_cuda_ipc_ring_reaches_a_process_on_the_same_gpu(memory_phase):
    torch.manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 64, device="cuda") for i in range(6)}
    transport = CudaIpcTransport(readers=1, timeout_s=TIMEOUT_S)
    ring = transport.begin()
    context = mp.get_context("spawn")
    results = context.Queue()
    reader = context.Process(target=_reader, args=(ring, results))
    reader.start()
    with memory_phase("cuda_ipc_send"):
        # Two tensors per bucket: three buckets through two slots, so a slot is reused once released.
        transport.send(bucketed(tensors.items(), bucket_bytes=2 * 64 * 64 * 4, dtype=torch.float32))
    got = results.get(timeout=TIMEOUT_S)
    reader.join(TIMEOUT_S)
    assert reader.exitcode == 0
    assert sorted(got) == sorted(tensors)
    assert all(torch.equal(got[name], tensor.cpu()) for name, tensor in tensors.items())
    assert transport.peak_shared_bytes <= 2 * transport.largest_bucket_bytes
