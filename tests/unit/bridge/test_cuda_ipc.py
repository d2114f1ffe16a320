"""The CUDA IPC transport on a machine without CUDA: a clear refusal at construction, and the pure
handle packing (device substitution, picklable bucket)."""

from __future__ import annotations

import pickle

import pytest
import torch

from megarl.bridge.protocol import pack
from megarl.bridge.transports.cuda_ipc import CudaIpcTransport, IpcBucket, pack_ipc_bucket, with_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_construction_without_cuda_fails_clearly():
    with pytest.raises(RuntimeError, match="needs CUDA.*use rollout.sync.transport: collective"):
        CudaIpcTransport(readers=1)


def test_cpu_buckets_are_refused():
    flat, metadata = pack([("model.norm.weight", torch.ones(4))])
    with pytest.raises(ValueError, match="CUDA IPC shares CUDA memory, the bucket is on cpu"):
        pack_ipc_bucket(flat, metadata)


def test_receiver_substitutes_its_device_index_and_the_bucket_pickles():
    # rebuild_cuda_tensor's argument tuple (torch 2.x): the device is its 7th entry.
    args = (
        torch.Tensor,
        (4,),
        (1,),
        0,
        "storage",
        torch.float32,
        3,
        b"handle",
        16,
        0,
        False,
        b"ref",
        0,
        b"event",
        True,
    )
    moved = with_device(args, 0)
    assert moved[6] == 0 and moved[:6] == args[:6] and moved[7:] == args[7:]
    _, metadata = pack([("model.norm.weight", torch.ones(4))])
    bucket = IpcBucket(metadata, "6a1c0c2e-0000-4000-8000-00000000000a", args)
    assert pickle.loads(pickle.dumps(bucket)) == bucket
