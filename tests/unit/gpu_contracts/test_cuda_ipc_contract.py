"""The CUDA IPC transport (`megarl/bridge/transports/cuda_ipc.py`) rewrites the device argument of
the `(rebuild_cuda_tensor, args)` pair that `torch.multiprocessing.reductions.reduce_tensor` makes
for a CUDA tensor, so the receiver opens the handle on its own index of the sender's GPU. Its
position must match both the producer (reduce_tensor's CUDA branch) and the consumer
(`rebuild_cuda_tensor`'s parameters) of the installed torch; neither runs without a GPU."""

import ast
import inspect
import textwrap

import pytest
from torch.multiprocessing import reductions

from megarl.bridge.transports import cuda_ipc

pytestmark = pytest.mark.unit


def _reduce_tensor_cuda_args() -> list[str]:
    """The expressions of the argument tuple that reduce_tensor returns with rebuild_cuda_tensor."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(reductions.reduce_tensor)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
                and ast.unparse(node.value.elts[0]) == "rebuild_cuda_tensor"):
            return [ast.unparse(argument) for argument in node.value.elts[1].elts]
    raise AssertionError("torch's reduce_tensor no longer returns (rebuild_cuda_tensor, (...))")


def test_device_position_matches_rebuild_cuda_tensor():
    parameters = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert parameters[cuda_ipc._DEVICE_ARG] == "storage_device"


def test_device_position_matches_reduce_tensor():
    arguments = _reduce_tensor_cuda_args()
    assert len(arguments) == len(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert arguments[cuda_ipc._DEVICE_ARG] == "device"


def test_with_device_replaces_only_the_device():
    args = tuple(range(15))
    moved = cuda_ipc.with_device(args, 3)
    assert moved[cuda_ipc._DEVICE_ARG] == 3
    assert [a for i, a in enumerate(moved) if i != cuda_ipc._DEVICE_ARG] == [
        a for i, a in enumerate(args) if i != cuda_ipc._DEVICE_ARG]
