"""A call's seed for the engine's one generator (`rollout.seed_each_sample: false`).

vLLM gives a request with a seed a `torch.Generator` of its own and draws its sampling noise one
request at a time; requests without one draw together from the worker process's default generator
(vllm/v1/sample/ops/topk_topp_sampler.py: `random_sample`'s `q.exponential_()` on GPU, one
`torch.randint` for the batch in `forward_cpu`). Reseeding that default generator before a call
makes the call's samples a function of its prompts, their order, the seed and the weights, at the
speed of unseeded sampling: on these CPUs the per-request draws cost 2 % of generation time
(benchmarks/README.md, "Generation by engine setting").

vLLM's second GPU model runner (the GPU default in 0.32) samples every request by a Gumbel draw keyed
on a per-request seed; a request without one gets `np.random.randint(...)` from numpy's global
generator when it is added (vllm/v1/worker/gpu/sample/states.py, `SamplingStates.add_request`), and
ignores torch's. So numpy's global generator is reseeded too.
"""

from __future__ import annotations

import numpy as np
import torch


class CallSeeding:
    """`seed_sampling`, run in every vLLM worker (`self` is the worker) before a seeded call."""

    def seed_sampling(self, seed: int) -> None:
        """Reseed this process's default generators: torch's (CPU and, where present, every GPU's) and
        numpy's global one (`np.random.seed` takes 32 bits)."""
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
