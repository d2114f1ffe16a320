"""Which device a process computes on (`megarl.parallel.device`): the driver's decision handed to the
workers, and the CUDA ordinal of a Ray-assigned GPU.

`visible_index` mirrors Ray 2.60's contract: `ray/_private/utils.py: set_visible_accelerator_ids` sets
`CUDA_VISIBLE_DEVICES` of a GPU task/actor to `",".join(ids)` of its assigned ids
(`ray/_private/accelerators/nvidia_gpu.py: NvidiaGPUAcceleratorManager.set_current_process_visible_accelerator_ids`),
unless `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES` is set, when the node's list stays and
`ray/_private/worker.py: Worker.get_accelerator_ids_for_accelerator_resource` maps the ids into it.
"""

import pytest
import torch

from megarl.parallel.device import DEVICE_ENV, DeviceError, uses_cuda, visible_index, worker_env


@pytest.mark.parametrize(
    "assigned, visible, index",
    [
        (["5"], "5", 0),  # Ray narrowed the list to the one assigned GPU: ordinal 0, not 5
        (["6", "3"], "3,6", 0),  # a multi-GPU process (ids in no order): its first visible GPU
        (["6"], "2,4,6,7", 2),  # NOSET: the node's list stays, the id's position counts
        ([7], "4, 5, 6, 7", 3),  # ids as ints, spaces in the list
        (["2"], None, 2),  # nothing narrowed, every GPU visible: the id is the ordinal
        (["GPU-a1b2"], "GPU-9f,GPU-a1b2", 1),  # UUIDs
    ],
)
def test_the_ordinal_is_the_position_among_the_visible_gpus(assigned, visible, index):
    assert visible_index(assigned, visible) == index


def test_an_id_outside_the_visible_list_names_the_variable():
    with pytest.raises(DeviceError, match=r"\['3'\] assigned by Ray are not in CUDA_VISIBLE_DEVICES='0,1'"):
        visible_index(["3"], "0,1")
    with pytest.raises(DeviceError, match="assigned no GPU"):
        visible_index([], "0")


def test_the_drivers_decision_overrides_the_process_cuda(monkeypatch):
    """A `trainer.device: cpu` run on a GPU machine stays on the CPU, and the other way round."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert not uses_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert uses_cuda()
    monkeypatch.delenv(DEVICE_ENV)
    assert not uses_cuda()  # no decision (torchrun, the test spawner): the process's own CUDA
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(DeviceError, match="MEGARL_DEVICE='gpu'"):
        uses_cuda()


def test_cpu_workers_see_no_gpu_and_cuda_workers_keep_what_ray_gave_them():
    assert worker_env("cpu") == {DEVICE_ENV: "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert worker_env("cuda") == {DEVICE_ENV: "cuda"}
