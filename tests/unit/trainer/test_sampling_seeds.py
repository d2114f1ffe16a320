"""No two samples of a run share a sampling seed: the 7B GRPO recipe's engines × prompts × n samples
per step over several steps, seeds computed as the trainer and the engines derive them
(`settings.step_seed` → `rollout.single_turn` → an engine seeds sample j of its i-th prompt with
`seed + i·n + j`, `megarl/workers/rollout/base.py:prompt_seeds` and vLLM's per-sample
`seed + j`)."""

from pathlib import Path

import pytest

from megarl.config import load_config, plan_batches
from megarl.data import Prompt
from megarl.rollout import offset_seed, single_turn
from megarl.trainer.settings import sampling_config, step_seed
from megarl.workers.rollout.base import RolloutOutput

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
STEPS = 3


class SeedRecordingEngines:
    """`generate` calls of a rollout WorkerGroup: records every sample's seed, answers with one token."""

    def __init__(self, engines: int):
        self.world_size = engines
        self.seeds: list[int] = []

    def call_each(self, method, per_engine_args):
        assert method == "generate"
        outputs = []
        for prompt_ids, sampling in per_engine_args:
            self.seeds += [sampling.seed + i * sampling.n + j for i in range(len(prompt_ids)) for j in range(sampling.n)]
            outputs.append([RolloutOutput(list(ids), [[1]] * sampling.n, [None] * sampling.n, ["length"] * sampling.n)
                            for ids in prompt_ids])
        return outputs


@pytest.mark.parametrize("recipe", ["grpo_qwen2.5-7b_gsm8k.yaml", "dapo_qwen2.5-math-7b_math.yaml"])
def test_every_sample_of_a_run_has_its_own_seed(recipe):
    config = load_config(CONFIGS / recipe)
    plan = plan_batches(config)
    prompts = [Prompt(f"p{i}", (i + 4,), None, {}, "test") for i in range(plan.prompts_per_step)]
    engines = SeedRecordingEngines(plan.rollout_engines)
    rounds = config.algorithm.dynamic_sampling.max_rounds if config.algorithm.dynamic_sampling.enable else 1
    for step in range(1, STEPS + 1):
        sampling = sampling_config(config, (0,), seed=step_seed(config, plan, step))
        for round_ in range(rounds):  # as RolloutPhase offsets DAPO's rounds
            single_turn(engines, prompts, offset_seed(sampling, round_ * plan.samples_per_step), f"{step}.{round_}")
    assert plan.rollout_engines > 1 and config.rollout.n > 1
    assert len(engines.seeds) == STEPS * rounds * plan.samples_per_step
    assert len(set(engines.seeds)) == len(engines.seeds)
