"""The peer comparison's prompt file (`megarl.bench.peer.prompt_count`): step k of the workload takes the same
prompts whatever `--repeats` the run has, so runs of different lengths time the same work per step."""

from __future__ import annotations

import json

from megarl.bench.peer import FULL, PROMPT_POOL_STEPS, _write_prompts, prompt_count
from megarl.data.loader import PromptLoader


def _batches(tmp_path, steps: int) -> list[list[dict]]:
    """The prompts of each of a run's 1 + `steps` steps, as megarl's loader hands them out (data.seed 0)."""
    path = _write_prompts(tmp_path / f"train_{steps}.jsonl", prompt_count(FULL["prompts_per_step"], steps))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    loader = PromptLoader(rows, FULL["prompts_per_step"], shuffle=True, seed=0)
    return [next(loader) for _ in range(steps + 1)]


def test_a_run_with_more_repeats_takes_the_same_prompts_at_every_step_it_shares(tmp_path):
    shorter, longer = _batches(tmp_path, steps=3), _batches(tmp_path, steps=4)
    assert longer[:4] == shorter


def test_a_run_longer_than_the_pool_gets_a_prompt_for_every_sample_of_every_step():
    steps = PROMPT_POOL_STEPS + 8
    assert prompt_count(FULL["prompts_per_step"], steps) == FULL["prompts_per_step"] * (steps + 1)
