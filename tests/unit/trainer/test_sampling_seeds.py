"""No two samples of a run share a sampling seed: the 7B GRPO recipe's engines × prompts × n samples
per step over several steps, seeds computed as the trainer and the engines derive them
(`settings.step_seed` → `rollout.single_turn` → an engine seeds sample j of its i-th prompt with
`seed + i·n + j`, `megarl/workers/rollout/base.py:prompt_seeds` and vLLM's per-sample
`seed + j`)."""

from dataclasses import replace
from pathlib import Path

import pytest

from megarl.config.batch_plan import plan_batches
from megarl.config.loader import load_config
from megarl.data import Prompt
from megarl.rollout import offset_seed, single_turn
from megarl.trainer.settings import sampling_config, step_seed
from megarl.workers.rollout.base import RolloutOutput, call_seed, prompt_seeds

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
            self.seeds += [
                sampling.seed + i * sampling.n + j for i in range(len(prompt_ids)) for j in range(sampling.n)
            ]
            outputs.append(
                [
                    RolloutOutput(list(ids), [[1]] * sampling.n, [None] * sampling.n, ["length"] * sampling.n)
                    for ids in prompt_ids
                ]
            )
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


def test_with_seed_each_sample_off_the_call_seeds_the_engine_and_no_prompt_has_a_seed():
    """`rollout.seed_each_sample: false` reaches the sampling config, training and validation alike; an
    engine then reseeds its one generator with the call's first seed (`call_seed`: the chunk's or the
    agent wave's first) and gives no prompt a seed of its own (`prompt_seeds`), and the other way round."""
    config = load_config(CONFIGS / "grpo_qwen2.5-7b_gsm8k.yaml", ["rollout.seed_each_sample=false"])
    training, validation = (sampling_config(config, (0,), seed=40, validation=v) for v in (False, True))
    assert not training.seed_each_sample and not validation.seed_each_sample
    assert call_seed(training, None) == 40 and call_seed(training, [7, 9]) == 7
    assert prompt_seeds(training, 2, None) == [None, None] == prompt_seeds(training, 2, [7, 9])
    each = replace(training, seed_each_sample=True)
    assert call_seed(each, None) is None and call_seed(each, [7, 9]) is None
    assert prompt_seeds(each, 2, None) == [40, 40 + each.n] and prompt_seeds(each, 2, [7, 9]) == [7, 9]
    unseeded = replace(training, seed=None)
    assert call_seed(unseeded, [7]) is None and prompt_seeds(unseeded, 1, [7]) == [None]
