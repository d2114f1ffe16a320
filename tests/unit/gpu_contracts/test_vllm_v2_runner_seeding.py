"""`rollout.seed_each_sample: false` on vLLM's second GPU model runner (the GPU default of vLLM 0.32):
it ignores torch's generator and keys each request's Gumbel draw on a seed that an unseeded request
takes from numpy's global generator when it is added (vllm/v1/worker/gpu/sample/states.py,
`SamplingStates.add_request`). The worker's per-call reseed (`CallSeeding.seed_sampling`) must fix
those seeds. The runner's code ships in the CPU wheel; only its UVA buffer (pinned, CUDA-mapped
memory: `vllm/v1/worker/gpu/buffer_utils.py` `UvaBackedTensor`, whose `.np` is the source of truth) is
stood in for by a plain CPU array."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.worker.gpu.sample import states

from megarl.workers.rollout.call_seeding import CallSeeding

pytestmark = pytest.mark.unit


class _CpuBackedTensor:
    """`UvaBackedTensor`'s fields as `SamplingStates` uses them, on the CPU."""

    def __init__(self, size, dtype, max_concurrency=None):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu

    def copy_to_uva(self, n=None):
        return self.gpu


def _seeds_after_reseed(seed: int, monkeypatch) -> list[int]:
    """The per-request seeds the V2 runner gives three unseeded requests added after `seed_sampling(seed)`."""
    monkeypatch.setattr(states, "UvaBackedTensor", _CpuBackedTensor)
    sampling = states.SamplingStates(max_num_reqs=4, vocab_size=64)
    CallSeeding().seed_sampling(seed)
    for index in range(3):
        sampling.add_request(index, SamplingParams(temperature=1.0, max_tokens=4))
    assert not sampling.seeds_set[:3].any()  # unseeded requests: the runner chose their seeds
    return sampling.seeds.np[:3].tolist()


def test_the_call_seed_fixes_the_v2_runners_request_seeds(monkeypatch):
    first = _seeds_after_reseed(7, monkeypatch)
    np.random.randint(0, 10, size=5)  # the global generator moves on between calls
    assert _seeds_after_reseed(7, monkeypatch) == first
    assert _seeds_after_reseed(8, monkeypatch) != first
    assert len(set(first)) == 3  # the requests of a call still differ from one another
