"""One rollout's samples, flattened to one entry per sample (prompt-major: the `n` samples of prompt
`i` are rows `i*n .. i*n+n-1`; `index[row]` is the group id the advantage estimators normalise within).

A sample's response is every token after its prompt: one generated turn (single turn), or the model's
turns with the tool observations between them (multi-turn). `loss_masks` tells them apart: True on the
tokens the model wrote, False on observation tokens, which are trained on as context only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megarl.data import Prompt
from megarl.workers.rollout.base import RolloutOutput

TOOL_ERRORS = {
    "unknown_tool": "the call named no tool of the run",
    "raised": "the tool raised, or its process died",
    "timeout": "the tool ran past its timeout_s and was stopped",
    "bad_return": "the tool returned something other than a string",
    "malformed": "the parser could not read the call",
    "bad_arguments": "the call's arguments do not fit the tool's schema (missing, unknown, wrong JSON type)",
}
"""Ways a tool call fails, and what each means (`megarl.tools.ToolResult.error`, `megarl.tools.parser.CallError.kind`)."""
ENDINGS = ("answer", "max_turns", "max_total_tokens", "turn_length")
"""How a trajectory ends: a turn without tool calls, the turn limit, the token limit (cut there), a
turn that reached rollout.max_new_tokens."""


@dataclass
class Trajectory:
    """What one multi-turn sample did, as the reward function and rollouts.jsonl see it."""

    messages: list[dict] = field(default_factory=list)
    """The turns after the prompt: `{"role": "assistant", "content": text, "tool_calls": [{"name", "arguments"}]}`
    and `{"role": "tool", "name": tool, "content": observation}`."""
    final_turn: list[int] = field(default_factory=list)
    """Token ids of the last assistant turn: the answer the reward reads."""
    ended: str = ""
    """One of `ENDINGS`."""
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Failed calls by kind (`TOOL_ERRORS`)."""
    tool_latency_s: list[float] = field(default_factory=list)
    """Wall time of each call."""
    observations_truncated: int = 0
    """Tool results (and call errors) cut to `rollout.multi_turn.max_observation_tokens`."""

    @property
    def turns(self) -> int:
        return sum(message["role"] == "assistant" for message in self.messages)


@dataclass
class Samples:
    """One step's rollouts, one entry per sample (prompt-major)."""

    prompts: list[Prompt]
    """The prompt of each sample (repeated `n` times)."""
    response_ids: list[list[int]]
    """Token ids after the prompt (stop tokens included; multi-turn: observations included)."""
    rollout_log_probs: list[Tensor]
    """`[len(response)]` float32: log-prob the engine sampled each model token with (0 on observations)."""
    loss_masks: list[Tensor]
    """`[len(response)]` bool: True on tokens the model wrote."""
    finish_reasons: list[str]
    """"stop" or "length" (the sample was cut at a length limit)."""
    index: list[str]
    """Group id of each sample (unique per prompt and rollout round)."""
    trajectories: list[Trajectory | None]
    """Multi-turn: what each sample did; single turn: None."""
    token_versions: list[list[int] | None]
    """Partial rollouts (`megarl.rollout.partial`): `[len(response)]` the weight version that sampled each
    token; None: every token was sampled by the weights the batch was generated with."""
    routed_experts: list[Tensor] | None = None
    """`[len(prompt) + len(response) - 1, L, k]` int16 per sample: the experts the engine routed each token
    to in each of the model's `L` layers (`RolloutOutput.routed_experts`; rollout routing replay), a token
    generated over several calls (multi-turn, partial rollouts) by the call that fed it first
    (`extend_routing`); -1 on tokens no call fed (a trajectory's closing observation). None: the engines
    returned none."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, keep: Sequence[bool]) -> Samples:
        rows = [i for i, k in enumerate(keep) if k]
        return Samples(*(None if (values := getattr(self, f)) is None else [values[i] for i in rows] for f in _FIELDS))

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        if not parts:
            return Samples.empty()
        if len({part.routed_experts is None for part in parts}) > 1:
            raise ValueError("Samples.concat: some parts carry routed experts and others do not")
        return Samples(
            *(
                None if getattr(parts[0], f) is None else [x for part in parts for x in getattr(part, f)]
                for f in _FIELDS
            )
        )

    @staticmethod
    def empty() -> Samples:
        return Samples(*([] for _ in _FIELDS[:-1]))


_FIELDS = tuple(Samples.__dataclass_fields__)
"""`Samples`' fields in order (`routed_experts`, which may be None, last)."""


def flatten_rollouts(prompts: Sequence[Prompt], outputs: Sequence[RolloutOutput], group_prefix: str) -> Samples:
    """Single-turn samples: `outputs[i]` holds the samples of `prompts[i]`; every response token is the model's."""
    samples = Samples.empty()
    if any(output.routed_experts for output in outputs):
        samples.routed_experts = [routed for output in outputs for routed in output.routed_experts]
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for response, log_probs, finish in zip(
            output.response_token_ids, output.response_logprobs, output.finish_reasons, strict=True
        ):
            samples.prompts.append(prompt)
            samples.response_ids.append(list(response))
            samples.rollout_log_probs.append(log_probs)
            samples.loss_masks.append(torch.ones(len(response), dtype=torch.bool))
            samples.finish_reasons.append(finish)
            samples.index.append(f"{group_prefix}/{i}")
            samples.trajectories.append(None)
            samples.token_versions.append(None)
    return samples


def extend_routing(routed: Tensor | None, call: Tensor) -> Tensor:
    """A sample's routing `[tokens fed, L, k]` after one more engine call over its context (`call`, that call's
    `RolloutOutput.routed_experts` row): the tokens this call fed first taken from it, the earlier ones kept
    from the calls that fed them. That is the routing each token was sampled under: a later call's prefill of
    the same prefix may route otherwise (other kernels; with partial rollouts, newer weights)."""
    return call if routed is None else torch.cat([routed, call[len(routed) :]])


def fit_routing(routed: Tensor, tokens: int) -> Tensor:
    """`routed` cut or padded with -1 to `tokens` rows: a sample's response may end before the last call's
    tokens (cut at a budget) or after them (an observation no call fed)."""
    if len(routed) >= tokens:
        return routed[:tokens]
    return torch.cat([routed, routed.new_full((tokens - len(routed), *routed.shape[1:]), -1)])
