"""What partial rollouts and carried groups can save on this engine: (1) the cost of one decode step by the
number of rows decoding together, (2) a long-tail batch generated whole, in re-submitted segments (megarl's
`rollout.partial_rollout`: the prompt and the tokens so far sent again, with the prefix cache reset before each
segment as a weight load resets it, and without the reset), and with its requests kept alive in the engine
across the segment boundaries (engine steps, a worker RPC where a weight load would land: the in-flight updates
of NeMo-RL, not built in megarl).

Partial rollouts and carried groups (`rollout.over_sampling`) pay where a decode step of a few rows costs about
what a step of many costs, so that a batch waiting for its longest response wastes the engine; and segments pay
only if re-submitting a prefix is cheap. (1) says whether this engine is such an engine, (2) what a segment
costs. One TP-1 vLLM engine in this process, megarl's engine settings (`VLLMRolloutEngine`: eager on CPU, prefix
caching, unchunked prefill); contenders alternate (`time_interleaved`), median of `--repeats`.

The long-tail batch is `benchmarks/recipes/long_tail.yaml`'s: 24 prompts × 8 rows (its batch and its carried
groups), responses ending at EOS or at x, y, z, at most 128 tokens, segments of 32 (`step_modes.PARTIAL_SEGMENT`).

    python benchmarks/partial_segments.py --json benchmarks/results/extra/partial_segments.json
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

ROWS = (1, 4, 16, 64, 192)
"""Rows decoding together in part (1)."""
STEPS = 64
"""Decode steps of every part (1) call (no stop: every row makes exactly this many tokens)."""
PROMPTS, N, CAP, SEGMENT = 24, 8, 128, 32
"""Part (2): prompts × rows each, the response cap, the segment length."""
STOP = (37, 38, 39)
"""x, y, z of the tiny model's character tokenizer: the long-tail recipe's `rollout.stop`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="outputs/tiny-model", help="an HF checkpoint (the quickstart's tiny model)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as in a run

    from megarl.bench.common import context, model_summary, time_interleaved, write_json
    from megarl.workers.rollout.engine_args import EngineArgs
    from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine(EngineArgs(args.model, dtype="float32", max_model_len=200))
    llm = engine._llm  # the same engine instance: the variants below call vLLM as megarl's would not
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randrange(10, 24))] for _ in range(PROMPTS)]
    rows = [prompt for prompt in prompts for _ in range(N)]
    tokens: dict[str, int] = {}

    def counted(name, generate):
        def call() -> None:
            tokens[name] = generate(llm, rows)

        return call

    try:
        by_rows = time_interleaved({str(r): lambda r=r: _fixed(llm, rows[:r]) for r in ROWS}, args.repeats)
        variants = {
            "whole": counted("whole", _whole),
            "segments": counted("segments", lambda llm, rows: _segments(llm, rows, reset=True)),
            "segments_cache_kept": counted("segments_cache_kept", lambda llm, rows: _segments(llm, rows, reset=False)),
            "kept_alive": counted("kept_alive", _kept_alive),
        }
        long_tail = time_interleaved(variants, args.repeats)
    finally:
        engine.shutdown()
    step_ms = {r: by_rows.median(str(r)) / STEPS * 1e3 for r in ROWS}
    report = dict(
        benchmark="partial_segments",
        context=context(),
        model=model_summary(args.model),
        repeats=args.repeats,
        decode_step_ms_by_rows=step_ms,
        token_ms_by_rows={r: ms / r for r, ms in step_ms.items()},
        long_tail_tokens=tokens,
        long_tail_token_ms={name: long_tail.median(name) / tokens[name] * 1e3 for name in variants},
        # Seeded: each variant makes the same tokens in every round, so its paired time ratio scales to tokens.
        long_tail_token_over_whole_paired={
            name: long_tail.paired_ratio(name, "whole") * tokens["whole"] / tokens[name] for name in variants
        },
    )
    write_json(args.json, report)
    print(markdown(report))


def _params(seed: int, cap: int, **extra):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = extra.pop("output_kind", RequestOutputKind.FINAL_ONLY)
    return SamplingParams(
        max_tokens=cap, temperature=1.0, seed=seed, logprobs=0, detokenize=False, output_kind=kind, **extra
    )


def _fixed(llm, rows: list[list[int]]) -> None:
    """`STEPS` tokens for every row, in one call."""
    params = [_params(k, STEPS, ignore_eos=True) for k in range(len(rows))]
    llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)


def _whole(llm, rows: list[list[int]]) -> int:
    params = [_params(k, CAP, stop_token_ids=list(STOP)) for k in range(len(rows))]
    results = llm.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)
    return sum(len(result.outputs[0].token_ids) for result in results)


def _segments(llm, rows: list[list[int]], reset: bool) -> int:
    """megarl's partial rollout: every row cut short goes on as a new request of its prompt + tokens so far."""
    responses: list[list[int]] = [[] for _ in rows]
    going, segment = list(range(len(rows))), 0
    while going:
        if reset:
            llm.reset_prefix_cache()
        params = [
            _params(segment * len(rows) + k, min(SEGMENT, CAP - len(responses[k])), stop_token_ids=list(STOP))
            for k in going
        ]
        results = llm.generate([{"prompt_token_ids": rows[k] + responses[k]} for k in going], params, use_tqdm=False)
        for k, result in zip(going, results, strict=True):
            responses[k] += result.outputs[0].token_ids
        going = [
            k
            for k, result in zip(going, results, strict=True)
            if result.outputs[0].finish_reason == "length" and len(responses[k]) < CAP
        ]
        segment += 1
    return sum(map(len, responses))


def _kept_alive(llm, rows: list[list[int]]) -> int:
    """The requests stay in the engine; every `SEGMENT` engine steps a worker RPC stands for a weight load."""
    from vllm.sampling_params import RequestOutputKind

    engine, made, steps = llm.llm_engine, 0, 0
    for k, row in enumerate(rows):
        params = _params(k, CAP, stop_token_ids=list(STOP), output_kind=RequestOutputKind.DELTA)
        engine.add_request(f"kept-{k}", {"prompt_token_ids": row}, params)
    while engine.has_unfinished_requests():
        made += sum(len(output.outputs[0].token_ids) for output in engine.step())
        steps += 1
        if steps % SEGMENT == 0:
            llm.collective_rpc("rank_tokens_eagerly")
    return made


def markdown(report: dict) -> str:
    lines = [
        "| rows decoding together | ms per decode step | ms per token |",
        "|---|---|---|",
        *(
            f"| {rows} | {ms:.2f} | {report['token_ms_by_rows'][rows]:.3f} |"
            for rows, ms in report["decode_step_ms_by_rows"].items()
        ),
        "",
        "| long-tail batch | tokens | ms per token | per token ÷ whole (paired) |",
        "|---|---|---|---|",
        *(
            f"| {name} | {report['long_tail_tokens'][name]} | {ms:.3f} | "
            f"{report['long_tail_token_over_whole_paired'][name]:.2f} |"
            for name, ms in report["long_tail_token_ms"].items()
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
