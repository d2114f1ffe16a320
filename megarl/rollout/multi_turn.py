"""The agent loop: multi-turn rollouts with tool calls, token in, token out.

Each sample is a trajectory that grows turn by turn. A turn is one generation from the whole context
so far (prompt + every token since); the turn's text is parsed for tool calls; the calls of every
trajectory of the turn run together (`Tools.run`: concurrently, each under its own time limit); each
trajectory that called tools gets the observation tokens (`ObservationEncoder`) appended with loss mask
0, then the next turn starts. A trajectory ends at a turn without tool calls ("answer"), after
`max_turns` turns, when a turn reaches `rollout.max_new_tokens` ("turn_length"), or when it reaches
`max_total_tokens` ("max_total_tokens"; cut there). The engines see only token ids and the trainer
trains on exactly the ids the engines produced: nothing the model wrote is re-tokenized.

Turns are generated in waves: every live trajectory's next turn is one request of one batched call
across the engines, so trajectories share each forward pass and a slow tool holds back only until
its time limit, once per turn, never sample by sample.

Seeds: turn t of the k-th live trajectory is seeded `sampling.seed + t·S + k` (S = samples of the
call), inside the block of `S × max_turns` seeds `settings.step_seed` reserves per rollout round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from megarl.config.rollout import MultiTurnConfig
from megarl.data import Prompt
from megarl.orchestration.worker_group import WorkerGroup
from megarl.rollout.observation import ObservationEncoder
from megarl.rollout.samples import Samples, Trajectory
from megarl.rollout.single_turn import generate_contexts, offset_seed
from megarl.workers.rollout.base import SamplingConfig


class ParsedCall(Protocol):
    name: str
    arguments: dict


class ParsedTurn(Protocol):
    calls: list[ParsedCall]
    errors: list[str]
    """One message per malformed call (bad JSON, no name): each becomes an error observation."""


class CallResult(Protocol):
    text: str
    error: str | None
    latency_s: float


class Parser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class Tools(Protocol):
    def run(self, calls: list[ParsedCall]) -> list[CallResult]: ...


@dataclass
class _Live:
    """A trajectory being generated."""

    prompt: Prompt
    slot: int
    """Row of the sample in the call's prompt-major order."""
    group: int
    """Index of its prompt in the call."""
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    trajectory: Trajectory = field(default_factory=Trajectory)
    pending: list[ParsedCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    turn_text: str = ""

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None, budget: int) -> bool:
        """Append tokens (the model's when `log_probs` is given, else an observation's), cut at `budget`
        tokens in all; whether they all fit."""
        room = budget - len(self.ids)
        kept = list(ids[:room])
        self.ids += kept
        self.log_probs += list(log_probs[:room]) if log_probs is not None else [0.0] * len(kept)
        self.mask += [log_probs is not None] * len(kept)
        return len(kept) == len(ids) and len(self.ids) < budget


class AgentLoop:
    """The multi-turn rollout function: `loop(prompts, sampling, group_prefix) -> Samples`."""

    def __init__(self, engines: WorkerGroup, tools: Tools, parser: Parser, observations: ObservationEncoder,
                 decode: Callable[[list[int]], str], settings: MultiTurnConfig):
        """`decode`: token ids -> text with special tokens kept (tool-call tags may be special tokens)."""
        self.engines = engines
        self.tools = tools
        self.parser = parser
        self.observations = observations
        self.decode = decode
        self.settings = settings

    def __call__(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str) -> Samples:
        live = [_Live(prompt, i * sampling.n + j, i) for i, prompt in enumerate(prompts) for j in range(sampling.n)]
        done: list[_Live] = []
        per_turn = replace(sampling, n=1)
        for turn in range(self.settings.max_turns):
            if not live:
                break
            self._generate(live, offset_seed(per_turn, turn * len(prompts) * sampling.n), sampling.max_new_tokens)
            calling = [t for t in live if not t.trajectory.ended]
            done += [t for t in live if t.trajectory.ended]
            if turn + 1 == self.settings.max_turns:
                for t in calling:
                    t.trajectory.ended = "max_turns"
                done += calling
                break
            self._observe(calling)
            live = [t for t in calling if not t.trajectory.ended]
            done += [t for t in calling if t.trajectory.ended]
        return self._samples(done, group_prefix)

    def _generate(self, live: list[_Live], sampling: SamplingConfig, turn_cap: int) -> None:
        """One turn of every live trajectory; parses its tool calls or ends it."""
        budget = self.settings.max_total_tokens
        caps = [min(turn_cap, budget - len(t.ids)) for t in live]
        outputs = generate_contexts(self.engines, [t.prompt.token_ids + tuple(t.ids) for t in live], sampling, caps)
        for t, output in zip(live, outputs, strict=True):
            ids, log_probs, reason = output.response_token_ids[0], output.response_logprobs[0], output.finish_reasons[0]
            fits = t.append(ids, log_probs.tolist(), budget)
            t.turn_text = self.decode(ids)
            parsed = self.parser.parse(t.turn_text)
            t.pending, t.malformed = list(parsed.calls), list(parsed.errors)
            t.trajectory.final_turn = list(ids)
            t.trajectory.messages.append({"role": "assistant", "content": t.turn_text,
                                          "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in t.pending]})
            if not fits:
                t.trajectory.ended = "max_total_tokens"
            elif reason == "length":
                t.trajectory.ended = "turn_length"
            elif not t.pending and not t.malformed:
                t.trajectory.ended = "answer"

    def _observe(self, calling: list[_Live]) -> None:
        """Run every pending call at once; append each trajectory's observation (loss mask 0)."""
        results = iter(self.tools.run([call for t in calling for call in t.pending]))
        for t in calling:
            messages = []
            for call in t.pending:
                result = next(results)
                messages.append({"role": "tool", "name": call.name, "content": result.text})
                t.trajectory.tool_latency_s.append(result.latency_s)
                if result.error:
                    t.trajectory.tool_errors[result.error] = t.trajectory.tool_errors.get(result.error, 0) + 1
            for error in t.malformed:
                messages.append({"role": "tool", "name": "", "content": error})
                t.trajectory.tool_errors["malformed"] = t.trajectory.tool_errors.get("malformed", 0) + 1
            t.trajectory.tool_calls += len(t.pending) + len(t.malformed)
            t.trajectory.messages += messages
            if not t.append(self.observations.encode(messages, t.turn_text), None, self.settings.max_total_tokens):
                t.trajectory.ended = "max_total_tokens"
            t.pending, t.malformed = [], []

    @staticmethod
    def _samples(done: list[_Live], group_prefix: str) -> Samples:
        """Prompt-major samples (the loop finishes trajectories out of order)."""
        samples = Samples.empty()
        for t in sorted(done, key=lambda t: t.slot):
            samples.prompts.append(t.prompt)
            samples.response_ids.append(t.ids)
            samples.rollout_log_probs.append(torch.tensor(t.log_probs, dtype=torch.float32))
            samples.loss_masks.append(torch.tensor(t.mask, dtype=torch.bool))
            samples.finish_reasons.append("length" if t.trajectory.ended in ("max_total_tokens", "turn_length") else "stop")
            samples.index.append(f"{group_prefix}/{t.group}")
            samples.trajectories.append(t.trajectory)
        return samples
