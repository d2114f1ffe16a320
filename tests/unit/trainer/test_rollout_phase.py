"""ReMax's greedy baseline in the driver's rollout phase, and the advantages assembled from it.

The engines are a stand-in for the rollout WorkerGroup that records what each engine was asked for;
a sampled response is its seed (`seed + i * n + j`, megarl/workers/rollout/base.py
`prompt_seeds` with vLLM's per-child `seed + j`), a greedy one repeats the prompt's first token.
"""

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from megarl.algorithms.advantages import compute_advantages
from megarl.cluster.timing import PhaseTimer
from megarl.config.loader import load_config
from megarl.data import Prompt
from megarl.rewards.scorer import RewardResult
from megarl.rollout import single_turn
from megarl.trainer import rollout_batch as rb
from megarl.trainer.rollout import RolloutPhase
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@dataclass
class RecordingEngines:
    """`WorkerGroup.call_each("generate", ...)` of `world_size` engines."""

    world_size: int
    calls: list[tuple[list, SamplingConfig]] = field(default_factory=list)

    def call_each(self, method: str, args: list[tuple]) -> list[list[RolloutOutput]]:
        assert method == "generate" and len(args) == self.world_size
        results = []
        for prompts, sampling in args:
            self.calls.append((prompts, sampling))
            outputs = []
            for i, prompt in enumerate(prompts):
                if sampling.greedy:
                    responses = [[prompt[0]]]
                else:
                    responses = [[sampling.seed + i * sampling.n + j] for j in range(sampling.n)]
                outputs.append(
                    RolloutOutput(
                        list(prompt), responses, [torch.zeros(1)] * len(responses), ["length"] * len(responses)
                    )
                )
            results.append(outputs)
        return results


def _score_token(prompts, responses, **columns):
    """Reward = the response's single token, so a score shows which response it came from."""
    return RewardResult([float(r) for r in responses], {"reward/failed_samples": 0.0})


def _prompts(count: int, start: int = 0) -> list[Prompt]:
    return [Prompt(f"p{k}", (1000 + k,), None, {}, "test") for k in range(start, start + count)]


def _phase(config, engines: RecordingEngines) -> RolloutPhase:
    prompts = config.data.train_batch_size
    batches = iter(range(10**6))
    next_prompts = lambda: _prompts(prompts, next(batches) * prompts)  # noqa: E731
    return RolloutPhase(
        config, partial(single_turn, engines), _score_token, lambda ids: str(ids[0]), next_prompts, PhaseTimer()
    )


def test_remax_baseline_is_the_greedy_reward_of_each_prompt():
    config = load_config(CONFIGS / "quickstart.yaml", ["algorithm.adv_estimator=remax"])
    engines = RecordingEngines(2)
    phase = _phase(config, engines)
    sampling = SamplingConfig(n=config.rollout.n, seed=config.rollout.seed, max_new_tokens=1)
    samples, scores, _ = phase(sampling, step=1)
    baselines = phase.greedy_baseline(samples, sampling)

    greedy_calls = engines.calls[2:]  # after the sampling call of the two engines
    assert all(s.greedy and s.n == 1 for _, s in greedy_calls)
    asked = [tuple(p) for prompts, _ in greedy_calls for p in prompts]
    assert asked == list(dict.fromkeys(p.token_ids for p in samples.prompts))  # each prompt once, in order
    # Each sample's baseline is the score of its prompt's greedy response (the prompt's first token).
    assert baselines.tolist() == [float(p.token_ids[0]) for p in samples.prompts]

    # Batch assembly: ReMax's advantage is reward - baseline on every response token.
    batch = rb.policy_batch(samples, config.rollout.max_new_tokens)
    rewards = rb.token_level_scores(scores, batch.response_mask)
    advantages, _ = compute_advantages("remax", rewards, batch.response_mask, reward_baselines=baselines)
    expected = (scores - baselines).unsqueeze(-1) * batch.response_mask
    assert torch.equal(advantages, expected)
    assert (scores != baselines).any()
