"""The contract `cpu_sampler_ops` relies on, read from the installed vLLM (vllm/v1/sample/ops/logprobs.py,
vllm/v1/sample/sampler.py): the sampler looks the rank op up by its module-level name at each call, and
the op is a `torch.compile` wrapper whose `__wrapped__` is the plain function, computing the same ranks."""

from __future__ import annotations

import inspect

import torch
from vllm.v1.sample import sampler
from vllm.v1.sample.ops import logprobs


def test_the_sampler_calls_the_rank_op_by_its_module_name():
    source = inspect.getsource(sampler)
    assert "from vllm.v1.sample.ops.logprobs import batched_count_greater_than" in source
    assert "batched_count_greater_than(logprobs, sampled_logprobs)" in source


def test_the_eager_rank_op_counts_what_the_compiled_one_counts():
    eager = logprobs.batched_count_greater_than.__wrapped__
    assert eager.__name__ == "batched_count_greater_than" and not hasattr(eager, "__wrapped__")
    x = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    values = x.gather(1, torch.randint(0, 100, (16, 1), generator=torch.Generator().manual_seed(1)))
    expected = (x >= values).sum(-1)  # the op's documented meaning: entries at least the value
    assert torch.equal(eager(x, values), expected)
