"""The CUDA IPC buffers (`megarl/bridge/transports/cuda_ipc.py`) against torch's real IPC API, with
fake device UUIDs standing in for the GPUs (none here).

A sender shares a slot with `torch.multiprocessing.reductions.reduce_tensor`, which for a CUDA
tensor returns `(rebuild_cuda_tensor, args)` (installed torch: `torch/multiprocessing/reductions.py`,
`reduce_tensor`'s CUDA branch, and `rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride,
tensor_offset, storage_cls, dtype, storage_device, storage_handle, ...)`). `args` names the GPU by
the *sender's* index; the bucket carries the GPU's UUID (`torch.cuda.get_device_properties(i).uuid`)
and the receiver puts its own index of that UUID into `storage_device` (`local_index`), refusing a
GPU it does not see or that is not its own device."""

import ast
import inspect
import textwrap

import pytest
import torch
from torch.multiprocessing import reductions

from megarl.bridge.protocol import pack
from megarl.bridge.transports import cuda_ipc

pytestmark = pytest.mark.unit

GPU_A, GPU_B, GPU_C = (
    "6a1c0c2e-0000-4000-8000-00000000000a",
    "6a1c0c2e-0000-4000-8000-00000000000b",
    "6a1c0c2e-0000-4000-8000-00000000000c",
)
"""Fake device UUIDs, in the format of `str(torch.cuda.get_device_properties(i).uuid)`."""


def _reduce_tensor_cuda_args() -> list[str]:
    """The expressions of the argument tuple that reduce_tensor returns with rebuild_cuda_tensor."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(reductions.reduce_tensor)))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Return)
            and isinstance(node.value, ast.Tuple)
            and ast.unparse(node.value.elts[0]) == "rebuild_cuda_tensor"
        ):
            return [ast.unparse(argument) for argument in node.value.elts[1].elts]
    raise AssertionError("torch's reduce_tensor no longer returns (rebuild_cuda_tensor, (...))")


def test_device_position_matches_rebuild_cuda_tensor():
    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert parameters[cuda_ipc._DEVICE_ARG] == "storage_device"


def test_device_position_matches_reduce_tensor():
    arguments = _reduce_tensor_cuda_args()
    assert len(arguments) == len(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert arguments[cuda_ipc._DEVICE_ARG] == "device"


def test_local_index_maps_a_uuid_to_this_processs_index():
    # The sender sees GPUs A, B, C as 0, 1, 2; a worker with CUDA_VISIBLE_DEVICES=C,B sees C as 0, B as 1.
    assert cuda_ipc.local_index(GPU_B, [GPU_C, GPU_B], own=1) == 1
    assert cuda_ipc.local_index(GPU_C, [GPU_C, GPU_B], own=0) == 0
    assert cuda_ipc.local_index(GPU_C, [GPU_C, GPU_B], own=None) == 0


def test_a_gpu_the_receiver_does_not_see_is_refused_by_uuid():
    with pytest.raises(RuntimeError, match=rf"GPU {GPU_A}, which this process does not see.*{GPU_C}.*ring_routes"):
        cuda_ipc.local_index(GPU_A, [GPU_C, GPU_B], own=0)


def test_a_handle_on_another_gpu_than_the_workers_own_is_refused():
    with pytest.raises(RuntimeError, match=rf"GPU {GPU_B} \(cuda:1 here\) but this worker runs on cuda:0 \({GPU_C}\)"):
        cuda_ipc.local_index(GPU_B, [GPU_C, GPU_B], own=0)


def _sender_args(sender_index: int) -> tuple:
    """A stand-in for `reduce_tensor(cuda_tensor)[1]`: one value per `rebuild_cuda_tensor` parameter,
    the device at the position reduce_tensor puts it."""
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    return tuple(sender_index if name == "storage_device" else f"<{name}>" for name in names)


def test_open_rebuilds_on_the_receivers_index_of_the_buckets_gpu(monkeypatch):
    _, metadata = pack([("model.norm.weight", torch.ones(4))])
    bucket = cuda_ipc.IpcBucket(metadata, GPU_B, _sender_args(sender_index=1))  # sender: B is cuda:1

    def rebuild(*args):  # binds like the real function, and shows which device it would open on
        bound = inspect.signature(reductions.rebuild_cuda_tensor).bind(*args)
        return bound.arguments

    monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(cuda_ipc, "visible_uuids", lambda: [GPU_B])  # the worker sees only B, as cuda:0
    opened = bucket.open(torch.device("cuda", 0))
    assert opened["storage_device"] == 0
    assert {k: v for k, v in opened.items() if k != "storage_device"} == {
        k: v
        for k, v in zip(inspect.signature(reductions.rebuild_cuda_tensor).parameters, bucket.rebuild_args)
        if k != "storage_device"
    }
