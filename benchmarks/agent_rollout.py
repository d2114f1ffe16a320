"""What multi-turn costs in generation: one batch of the agent quickstart's rollout (16 prompts × 8
trajectories, the warmed-up model, the built-in calculator in its isolated process) through the agent
loop, against single-turn generation of exactly as many model tokens per sample (each sample's count as
its cap, no stop token), on the same vLLM engine, alternating, median of `--repeats`.

    python benchmarks/agent_rollout.py --json benchmarks/results/extra/agent_rollout.json

Needs the agent quickstart's warmed-up model and prompts (`bash scripts/agent_quickstart.sh` makes them).
The difference is the price of turns: every turn re-enters the engine with a longer context (prefix
caching keeps the prefill small), the calls run, and the observation tokens are prefilled too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from megarl.config.loader import load_config
from megarl.data import load_prompts
from megarl.rollout import AgentLoop, ObservationEncoder, single_turn
from megarl.tools import ToolSet, parser_for
from megarl.trainer.settings import sampling_config, stop_token_ids
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

RECIPE = "configs/agent_quickstart.yaml"


class OneEngine:
    """One in-process engine behind the rollout WorkerGroup's `call_each`."""

    world_size = 1

    def __init__(self, engine):
        self.engine = engine

    def call_each(self, method, args):
        return [getattr(self.engine, method)(*a) for a in args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    config = load_config(RECIPE)
    multi_turn = config.rollout.multi_turn
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    sampling = sampling_config(config, stop_token_ids(tokenizer, config.rollout.stop), seed=0)
    with ToolSet(multi_turn) as tools:
        tools.wait_ready()
        prompts = load_prompts(config.data.train_files, tokenizer, config.data, tools.schemas())[0]
        prompts = prompts[: config.data.train_batch_size]
        engine = make_rollout_engine(
            "vllm",
            EngineArgs(
                config.model.path,
                dtype="float32",
                max_model_len=config.data.max_prompt_length + multi_turn.max_total_tokens,
            ),
        )
        try:
            engines = OneEngine(engine)
            loop = AgentLoop(
                engines,
                tools,
                parser_for(multi_turn.tool_format, tools.schemas()),
                ObservationEncoder(tokenizer),
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                multi_turn,
            )
            loop(prompts, sampling, "warm-up")
            single_turn(engines, prompts, replace(sampling, stop_token_ids=()), "warm-up")
            rows = []
            for repeat in range(args.repeats):
                seeded = replace(sampling, seed=1000 * (repeat + 1))
                start = time.perf_counter()
                samples = loop(prompts, seeded, "agent")
                agent_s = time.perf_counter() - start
                model_tokens = [int(mask.sum()) for mask in samples.loss_masks]
                contexts = [p.token_ids for p in samples.prompts]
                flat = replace(seeded, n=1, stop_token_ids=())  # run every sample to its cap
                start = time.perf_counter()
                outputs = engine.generate(contexts, flat, model_tokens)
                single_s = time.perf_counter() - start
                assert [len(o.response_token_ids[0]) for o in outputs] == model_tokens
                rows.append(
                    {
                        "agent_s": agent_s,
                        "single_turn_s": single_s,
                        "model_tokens": sum(model_tokens),
                        "observation_tokens": sum(len(ids) for ids in samples.response_ids) - sum(model_tokens),
                        "turns_mean": sum(t.turns for t in samples.trajectories) / len(samples),
                    }
                )
        finally:
            engine.shutdown()
    ratio = statistics.median(r["agent_s"] / r["single_turn_s"] for r in rows)
    result = {
        "recipe": RECIPE,
        "samples": len(prompts) * sampling.n,
        "repeats": rows,
        "median_agent_over_single_turn": ratio,
        "machine": platform.processor() or platform.machine(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print("| samples | turns/sample | model tokens | observation tokens | agent loop s | single turn s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {result['samples']} | {r['turns_mean']:.2f} | {r['model_tokens']} | {r['observation_tokens']} | "
            f"{r['agent_s']:.2f} | {r['single_turn_s']:.2f} | {r['agent_s'] / r['single_turn_s']:.2f} |"
        )
    print(f"median agent ÷ single turn: {ratio:.2f}")


if __name__ == "__main__":
    main()
