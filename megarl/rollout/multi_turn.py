"""The agent loop: multi-turn rollouts with tool calls, token in, token out.

Each sample is a trajectory that grows turn by turn. A turn is one generation from the whole context
so far (prompt + every token since); the turn's text is parsed for tool calls, which start at once
(`Tools.submit`: concurrently, each under its own time limit); once a trajectory's calls are all back
it gets the observation tokens (`ObservationEncoder`) appended with loss mask 0 and is ready for its
next turn. A trajectory ends at a turn without tool calls ("answer"), after `max_turns` turns, when a
turn reaches `rollout.max_new_tokens` ("turn_length"), or when it reaches `max_total_tokens`
("max_total_tokens"; cut there). The engines see only token ids and the trainer trains on exactly the
ids the engines produced: nothing the model wrote is re-tokenized.

Turns are generated in waves: the next turns of every ready trajectory are one batched call across
the engines, so trajectories share each forward pass. A wave does not wait for every tool call: after
a wave, the loop waits until some trajectory's calls are all back, then at most
`multi_turn.straggler_wait_s` more for the rest, and the trajectories that are back form the next
wave; one still waiting on a slow tool keeps its calls running and joins a later wave when its
results (or its timeout's error observation) arrive. The samples come back in prompt order whatever
the timing.

Seeds: turn t of the trajectory in row k (prompt-major) is seeded `sampling.seed + t·S + k` (S =
samples of the call), whichever wave it is generated in, inside the block of `S × max_turns` seeds
`settings.step_seed` reserves per rollout round: a trajectory's tokens depend on its own context and
tool results, not on the timing of the others' tools.

Partial rollouts (`rollout.partial_rollout`, trainer.rollout_mode async; `megarl.rollout.partial` is the
single-turn case): a wave's turns are generated `segment` new tokens at a time, and `between_segments()`
runs before every segment, the first of each turn included, so a weight update waits for one segment
(or, while every trajectory waits on its tools, for the next wave's calls to come back; the calls of
trajectories left out of a wave run on through the update) and lands between two turns or inside one. A turn a
segment cut short goes on in the wave's next segment from prompt + every token so far, under the
weights the engines hold then; its tokens are parsed for tool calls only once the turn ended. Every
token records the weight version that sampled it (`Samples.token_versions`), and an observation's
tokens, which the loss masks out, the version of the turn whose calls they answer, so the staleness
bound and `rollout/token_version_lag` see a trajectory's oldest model token. Segment s >= 1 of turn t
is seeded `sampling.seed + (t + s·max_turns)·S + k`: past the round's block, as a continued
single-turn segment is (its context differs from whatever else holds that seed).

Routing replay (`actor.moe.router_replay`): each call returns the routing of every token it fed; a token
keeps the routing of the call that fed it first, the one it was sampled under (an observation's tokens:
the next turn's call; a closing observation no call fed: -1, nothing reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from megarl.config.rollout import MultiTurnConfig
from megarl.data import Prompt
from megarl.orchestration.worker_group import WorkerGroup
from megarl.rollout.carry import stale_groups
from megarl.rollout.observation import ObservationEncoder
from megarl.rollout.samples import Samples, Trajectory, extend_routing, fit_routing
from megarl.rollout.single_turn import generate_contexts
from megarl.workers.rollout.base import SamplingConfig


class ParsedCall(Protocol):
    name: str
    arguments: dict


class CallError(Protocol):
    kind: str
    message: str
    name: str


class ParsedTurn(Protocol):
    calls: list[ParsedCall]
    errors: list[CallError]
    """One per call that may not run (malformed, arguments that do not fit the tool's schema): each
    becomes an error observation, counted under its `kind`."""


class CallResult(Protocol):
    text: str
    error: str | None
    latency_s: float


class Parser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class Tools(Protocol):
    def submit(self, calls: list[ParsedCall]) -> list[Future]:
        """One future per call, in order, set to its `CallResult` when the call ends; returns at once."""


@dataclass(eq=False)
class _Live:
    """A trajectory being generated."""

    prompt: Prompt
    slot: int
    """Row of the sample in prompt-major order: in the call, or among all a `TrajectoriesInFlight` started."""
    group: str
    """Its group's id (`Samples.index`): `{group_prefix}/{number of its prompt}`."""
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    trajectory: Trajectory = field(default_factory=Trajectory)
    pending: list[ParsedCall] = field(default_factory=list)
    results: list[Future] = field(default_factory=list)
    """The futures of `pending`'s calls, once submitted."""
    rejected: list[CallError] = field(default_factory=list)
    """The turn's calls the parser did not pass on."""
    turn_ids: list[int] = field(default_factory=list)
    """The tokens of the turn being generated (several segments with partial rollouts)."""
    turn_text: str = ""
    finish: str = ""
    """How the turn's last segment ended ("stop" or "length")."""
    versions: list[int] = field(default_factory=list)
    """The weight version of each token of `ids` (an observation's: its turn's)."""
    version: int = 0
    """The weight version of the turn's last segment."""
    routed: torch.Tensor | None = None
    """With routing replay: `[tokens fed so far, L, k]` the experts each context token was routed to by the
    call that fed it first (`extend_routing`)."""

    def append(self, ids: Sequence[int], log_probs: Sequence[float] | None, budget: int) -> bool:
        """Append tokens (the model's when `log_probs` is given, else an observation's), cut at `budget`
        tokens in all; whether they all fit."""
        room = budget - len(self.ids)
        kept = list(ids[:room])
        self.ids += kept
        self.log_probs += list(log_probs[:room]) if log_probs is not None else [0.0] * len(kept)
        self.mask += [log_probs is not None] * len(kept)
        self.versions += [self.version] * len(kept)
        return len(kept) == len(ids) and len(self.ids) < budget

    def calls_back(self) -> bool:
        return all(future.done() for future in self.results)


@dataclass
class Trajectories:
    """Trajectories in flight: ready for their next turn, waiting for their tool calls, ended."""

    ready: list[_Live] = field(default_factory=list)
    waiting: list[_Live] = field(default_factory=list)
    done: list[_Live] = field(default_factory=list)

    def everyone(self) -> list[_Live]:
        return [*self.ready, *self.waiting, *self.done]


class AgentLoop:
    """The multi-turn rollout function: `loop(prompts, sampling, group_prefix) -> Samples`."""

    def __init__(
        self,
        engines: WorkerGroup,
        tools: Tools,
        parser: Parser,
        observations: ObservationEncoder,
        decode: Callable[[list[int]], str],
        settings: MultiTurnConfig,
        *,
        segment: int = 0,
        between_segments: Callable[[], int] | None = None,
    ):
        """`decode`: token ids -> text with special tokens kept (tool-call tags may be special tokens).
        Partial rollouts: `segment` (`rollout.partial_rollout`) new tokens at a time, `between_segments()`
        before each segment returning the engines' weight version (`AsyncRolloutStream.between_segments`);
        0 and None: whole turns, and no `token_versions`."""
        assert (segment > 0) == (between_segments is not None), (segment, between_segments)
        self.engines = engines
        self.tools = tools
        self.parser = parser
        self.observations = observations
        self.decode = decode
        self.settings = settings
        self.segment = segment
        self.between_segments = between_segments

    def __call__(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str) -> Samples:
        flight = Trajectories(ready=self.start(prompts, sampling.n, group_prefix))
        self.run(flight, sampling, lambda: False)
        return self.samples(flight.done)

    @staticmethod
    def start(prompts: Sequence[Prompt], n: int, group_prefix: str, first: int = 0) -> list[_Live]:
        """`n` new trajectories per prompt; prompt i's group is `{group_prefix}/{first + i}`, its rows from
        `(first + i) * n`."""
        return [
            _Live(prompt, (first + i) * n + j, f"{group_prefix}/{first + i}")
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]

    def run(self, flight: Trajectories, sampling: SamplingConfig, enough: Callable[[], bool]) -> None:
        """Waves over `flight` until every trajectory ended or, checked before each wave, `enough()`."""
        count = len(flight.everyone())
        while (flight.ready or flight.waiting) and not enough():
            ready = flight.ready
            if ready:
                self._generate(ready, sampling, count)
                for t in ready:
                    if not t.trajectory.ended and t.trajectory.turns == self.settings.max_turns:
                        t.trajectory.ended = "max_turns"  # its last turn's calls are not run
                flight.done += [t for t in ready if t.trajectory.ended]
                flight.waiting += self._submit([t for t in ready if not t.trajectory.ended])
            back = self._wait_for_tools(flight.waiting)
            flight.waiting = [t for t in flight.waiting if t not in back]
            flight.ready = []
            for t in back:
                self._observe(t)
                (flight.done if t.trajectory.ended else flight.ready).append(t)

    def _generate(self, ready: list[_Live], sampling: SamplingConfig, count: int) -> None:
        """One turn of every ready trajectory, in one batched call per segment (`count`: trajectories in
        flight, the seeds' stride); parses each turn's tool calls or ends the trajectory."""
        budget = self.settings.max_total_tokens
        for t in ready:
            t.turn_ids = []
        going, piece = list(ready), 0
        while going:
            going = [
                t
                for t in self._segment(going, sampling, count, piece)
                if len(t.turn_ids) < sampling.max_new_tokens and len(t.ids) < budget
            ]
            piece += 1
        for t in ready:
            t.turn_text = self.decode(t.turn_ids)
            parsed = self.parser.parse(t.turn_text)
            t.pending, t.rejected = list(parsed.calls), list(parsed.errors)
            t.trajectory.final_turn = list(t.turn_ids)
            t.trajectory.messages.append(
                {
                    "role": "assistant",
                    "content": t.turn_text,
                    "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in t.pending],
                }
            )
            if len(t.ids) >= budget:
                t.trajectory.ended = "max_total_tokens"
            elif t.finish == "length":
                t.trajectory.ended = "turn_length"
            elif not t.pending and not t.rejected:
                t.trajectory.ended = "answer"

    def _segment(self, going: list[_Live], sampling: SamplingConfig, count: int, piece: int) -> list[_Live]:
        """Segment `piece` of the turns `going` (the whole turn without partial rollouts): one batched call,
        each capped at what is left of its turn and of the token budget. The turns the cap cut short."""
        if self.between_segments is not None:
            version = self.between_segments()
            for t in going:
                t.version = version
        step = self.segment or sampling.max_new_tokens
        caps = [
            min(step, sampling.max_new_tokens - len(t.turn_ids), self.settings.max_total_tokens - len(t.ids))
            for t in going
        ]
        turns = self.settings.max_turns
        seeds = (
            None
            if sampling.seed is None
            else [sampling.seed + (t.trajectory.turns + piece * turns) * count + t.slot for t in going]
        )
        # min_new_tokens <= segment (validate): the turn's first segment honoured it.
        outputs = generate_contexts(
            self.engines,
            [t.prompt.token_ids + tuple(t.ids) for t in going],
            replace(sampling, n=1, min_new_tokens=0) if piece else replace(sampling, n=1),
            caps,
            seeds,
        )
        cut = []
        for t, output, cap in zip(going, outputs, caps, strict=True):
            ids, log_probs = output.response_token_ids[0], output.response_logprobs[0]
            t.append(ids, log_probs.tolist(), self.settings.max_total_tokens)
            t.turn_ids += ids
            t.finish = output.finish_reasons[0]
            if output.routed_experts:
                t.routed = extend_routing(t.routed, output.routed_experts[0])
            if t.finish == "length" and len(ids) == cap:
                cut.append(t)
        return cut

    def _submit(self, calling: list[_Live]) -> list[_Live]:
        """Start the calls of a wave's trajectories, as one submit (the search calls among them go to
        the index as one batch); `calling`, each holding its calls' futures."""
        calls = [call for t in calling for call in t.pending]
        futures = iter(self.tools.submit(calls) if calls else [])
        for t in calling:
            t.results = [next(futures) for _ in t.pending]
        return calling

    def _wait_for_tools(self, waiting: list[_Live]) -> list[_Live]:
        """The trajectories whose calls are all back: waits until one's are, then at most
        `straggler_wait_s` for the others'."""

        def unfinished() -> list[Future]:
            return [future for t in waiting for future in t.results if not future.done()]

        if not waiting:
            return []
        while not any(t.calls_back() for t in waiting):
            wait(unfinished(), return_when=FIRST_COMPLETED)
        wait(unfinished(), timeout=self.settings.straggler_wait_s)
        return sorted((t for t in waiting if t.calls_back()), key=lambda t: t.slot)  # waves in row order

    def _observe(self, t: _Live) -> None:
        """Append the observation of the trajectory's calls, all back (loss mask 0)."""
        messages = []
        for call, future in zip(t.pending, t.results, strict=True):
            result = future.result()
            messages.append(self._tool_message(t, call.name, result.text))
            t.trajectory.tool_latency_s.append(result.latency_s)
            if result.error:
                t.trajectory.tool_errors[result.error] = t.trajectory.tool_errors.get(result.error, 0) + 1
        for error in t.rejected:
            messages.append(self._tool_message(t, error.name, error.message))
            t.trajectory.tool_errors[error.kind] = t.trajectory.tool_errors.get(error.kind, 0) + 1
        t.trajectory.tool_calls += len(t.pending) + len(t.rejected)
        t.trajectory.messages += messages
        if not t.append(self.observations.encode(messages, t.turn_text), None, self.settings.max_total_tokens):
            t.trajectory.ended = "max_total_tokens"
        t.pending, t.results, t.rejected = [], [], []

    def _tool_message(self, t: _Live, name: str, content: str) -> dict:
        """A `tool` message of `content` cut to `max_observation_tokens` (counted in the trajectory)."""
        content, cut = self.observations.capped(content, self.settings.max_observation_tokens)
        t.trajectory.observations_truncated += cut
        return {"role": "tool", "name": name, "content": content}

    def samples(self, done: list[_Live]) -> Samples:
        """Prompt-major samples of ended trajectories (the loop finishes them out of order); with partial
        rollouts with `token_versions`."""
        partial = self.between_segments is not None
        samples = Samples.empty()
        for t in sorted(done, key=lambda t: t.slot):
            samples.prompts.append(t.prompt)
            samples.response_ids.append(t.ids)
            samples.rollout_log_probs.append(torch.tensor(t.log_probs, dtype=torch.float32))
            samples.loss_masks.append(torch.tensor(t.mask, dtype=torch.bool))
            samples.finish_reasons.append(
                "length" if t.trajectory.ended in ("max_total_tokens", "turn_length") else "stop"
            )
            samples.index.append(t.group)
            samples.trajectories.append(t.trajectory)
            samples.token_versions.append(t.versions if partial else None)
        if done and done[0].routed is not None:
            samples.routed_experts = [
                fit_routing(t.routed, len(t.prompt.token_ids) + len(t.ids) - 1)
                for t in sorted(done, key=lambda t: t.slot)
            ]
        return samples


class TrajectoriesInFlight:
    """The agent loop's trajectories carried from one call to the next (`megarl.rollout.carry.CarryOver`,
    `rollout.over_sampling`): a call stops its waves once enough groups ended; the trajectories still ready for
    a turn or waiting for their tool calls (which run on) go on in the next call's waves. Rows are numbered
    across calls, so each keeps its seeds' row; the seeds' stride is the trajectories in flight, so two
    trajectories of different calls may share a seed on different contexts."""

    def __init__(self, loop: AgentLoop):
        self.loop = loop
        self.trajectories = Trajectories()

    def start(self, prompts: Sequence[Prompt], sampling: SamplingConfig, group_prefix: str, first: int) -> None:
        self.trajectories.ready += self.loop.start(prompts, sampling.n, group_prefix, first)

    def restart_stale(self, oldest_allowed: int) -> int:
        """The groups holding a token sampled by weights older than `oldest_allowed` start over from their
        prompts (their tool calls in flight are left to end unread); how many did."""
        stale = stale_groups(((t.group, t.versions) for t in self.trajectories.everyone()), oldest_allowed)
        flight = self.trajectories
        again = [_Live(t.prompt, t.slot, t.group) for t in flight.everyone() if t.group in stale]
        flight.waiting = [t for t in flight.waiting if t.group not in stale]
        flight.done = [t for t in flight.done if t.group not in stale]
        flight.ready = [*(t for t in flight.ready if t.group not in stale), *again]
        return len(stale)

    def run(self, sampling: SamplingConfig, enough: Callable[[], bool]) -> None:
        self.loop.run(self.trajectories, sampling, enough)

    def finished_groups(self, sampling: SamplingConfig) -> list[str]:
        """The groups whose trajectories all ended, in the order they were started."""
        going = {t.group for t in (*self.trajectories.ready, *self.trajectories.waiting)}
        ended = sorted(self.trajectories.done, key=lambda t: t.slot)
        return list(dict.fromkeys(t.group for t in ended if t.group not in going))

    def take(self, groups: set[str]) -> Samples:
        """The samples of `groups` (ended), which leave the flight."""
        done = self.trajectories.done
        self.trajectories.done = [t for t in done if t.group not in groups]
        return self.loop.samples([t for t in done if t.group in groups])

    def groups(self) -> int:
        return len({t.group for t in self.trajectories.everyone()})
