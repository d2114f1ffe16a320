"""Partial rollouts (`megarl.rollout.partial`) against stand-in engines that follow `RolloutEngine.generate`'s
contract (megarl/workers/rollout/base.py: token ids in; per context `n` samples, their log-probs and finish
reasons out, capped per context by `max_new_tokens`) and that `generate_contexts` reaches as it reaches a
`WorkerGroup` (`call_each("generate", per-rank args)`).

The stand-in model is deterministic: the k-th response token is 1000 + k, and a sample whose prompt starts
with L stops with token 7 at its L-th token; its log-probs name the weight version that sampled them. So a
segmented rollout must give exactly the unsegmented responses, with each token's version and log-prob
from the weights of its segment."""

from functools import partial

import pytest
import torch

from megarl.data import Prompt
from megarl.rollout.carry import CarryOver
from megarl.rollout.partial import RowsInFlight, partial_single_turn
from megarl.rollout.single_turn import single_turn
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig

STOP = 7


class Engines:
    """A group of `world_size` stand-in engines holding weights of version `weights`."""

    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self.weights = 0
        self.calls: list[list[list[int]]] = []
        """The contexts of each generate call, per engine."""

    def call_each(self, method: str, per_rank_args: list[tuple]) -> list[list[RolloutOutput]]:
        assert method == "generate" and len(per_rank_args) == self.world_size
        return [self.generate(*args) for args in per_rank_args]

    def generate(self, contexts, sampling: SamplingConfig, max_new_tokens=None, seeds=None) -> list[RolloutOutput]:
        self.calls.append(contexts)
        caps = max_new_tokens or [sampling.max_new_tokens] * len(contexts)
        outputs = []
        for context, cap in zip(contexts, caps, strict=True):
            made = sum(token >= 1000 or token == STOP for token in context)  # response tokens so far
            length = context[0]  # the prompt's first token: where the sample stops
            ids = []
            while len(ids) < cap and made + len(ids) < length:
                ids.append(STOP if made + len(ids) == length - 1 else 1000 + made + len(ids))
            finish = "stop" if ids and ids[-1] == STOP else "length"
            outputs.append(
                RolloutOutput(
                    list(context),
                    [ids] * sampling.n,
                    [torch.full((len(ids),), -0.1 * (self.weights + 1))] * sampling.n,
                    [finish] * sampling.n,
                )
            )
        return outputs


PROMPTS = [Prompt(f"p{k}", (length, 50 + k), str(k), {}, "test") for k, length in enumerate((3, 9, 14))]
SAMPLING = SamplingConfig(n=2, max_new_tokens=12, stop_token_ids=(STOP,), seed=5)


def test_segments_give_the_whole_responses_each_token_with_the_version_that_sampled_it():
    engines = Engines()
    updates = iter([0, 1, 1, 3])  # a weight update lands before the second and the fourth segment

    def between_segments() -> int:
        engines.weights = next(updates)
        return engines.weights

    samples = partial_single_turn(engines, 4, between_segments, PROMPTS, SAMPLING, "1.0")
    whole = single_turn(Engines(), PROMPTS, SAMPLING, "1.0")
    assert samples.response_ids == whole.response_ids and samples.finish_reasons == whole.finish_reasons
    assert samples.index == whole.index
    assert [len(ids) for ids in samples.response_ids] == [3, 3, 9, 9, 12, 12]  # the last two cut at 12
    assert samples.finish_reasons == ["stop", "stop", "stop", "stop", "length", "length"]
    assert samples.token_versions[0] == [0, 0, 0]
    assert samples.token_versions[2] == [0] * 4 + [1] * 4 + [1]  # 4 + 4 + 1 tokens, the update before segment 2
    assert samples.token_versions[4] == [0] * 4 + [1] * 4 + [1] * 4  # segment 3 ended at the cap: no 4th
    for versions, log_probs, mask in zip(samples.token_versions, samples.rollout_log_probs, samples.loss_masks):
        assert torch.equal(log_probs, torch.tensor([-0.1 * (v + 1) for v in versions], dtype=torch.float32))
        assert mask.all() and len(mask) == len(versions)
    # Continuations carry prompt + tokens so far, one sample each, never past the length budget.
    continued = [context for call in engines.calls[2:] for context in call]
    assert all(len(c) - 2 <= 12 for c in continued)
    assert continued[0] == [9, 51, *range(1000, 1004)]


def test_no_segment_runs_after_every_sample_ended():
    engines = Engines()
    calls = []
    samples = partial_single_turn(engines, 20, lambda: calls.append(1) or 0, PROMPTS, SAMPLING, "1.0")
    assert len(calls) == 1 and len(engines.calls) == engines.world_size  # one segment holds every response
    assert samples.token_versions == [[0] * len(ids) for ids in samples.response_ids]


@pytest.mark.parametrize("segment", [1, 5])
def test_any_segment_length_gives_the_same_responses(segment):
    samples = partial_single_turn(Engines(), segment, lambda: 0, PROMPTS, SAMPLING, "1.0")
    assert samples.response_ids == single_turn(Engines(), PROMPTS, SAMPLING, "1.0").response_ids


class RoutingEngines(Engines):
    """`Engines` that also return routing, as an engine asked for routed experts does: for every token a call fed
    (its context, then its tokens but the last), `[weight version, position]` (one layer, k = 2)."""

    def generate(self, contexts, sampling: SamplingConfig, max_new_tokens=None, seeds=None) -> list[RolloutOutput]:
        outputs = super().generate(contexts, sampling, max_new_tokens, seeds)
        for output in outputs:
            fed = len(output.prompt_token_ids) + len(output.response_token_ids[0]) - 1
            routing = torch.stack([torch.full((fed,), self.weights), torch.arange(fed)], dim=-1).to(torch.int16)
            output.routed_experts = [routing[:, None]] * sampling.n
        return outputs


def test_each_token_keeps_the_routing_of_the_segment_that_fed_it_first():
    """Routing replay with partial rollouts: a token's routing is that of the segment that fed it first, under
    the weights that sampled the next token (a segment's last token is fed by the next segment, after an
    update), not the later segments' prefill of it."""
    engines = RoutingEngines()
    updates = iter([0, 1, 1, 3])

    def between_segments() -> int:
        engines.weights = next(updates)
        return engines.weights

    samples = partial_single_turn(engines, 4, between_segments, PROMPTS, SAMPLING, "1.0")
    for prompt, ids, versions, routed in zip(
        samples.prompts, samples.response_ids, samples.token_versions, samples.routed_experts, strict=True
    ):
        p = len(prompt.token_ids)
        assert routed[:, 0, 1].tolist() == list(range(p + len(ids) - 1))
        # Position q feeds the sampling of response token q - p + 1 (the prompt's: of the first one).
        assert routed[:, 0, 0].tolist() == [versions[max(q - p + 1, 0)] for q in range(p + len(ids) - 1)]
    assert {v for versions in samples.token_versions for v in versions} == {0, 1}


def carry_over(engines, between_segments, oldest_allowed, more_prompts, extra: int) -> CarryOver:
    """A `CarryOver` of single-turn rows generated in segments of 4 tokens, as the trainer makes it."""
    exact = partial(partial_single_turn, engines, 4, between_segments)
    return CarryOver(RowsInFlight(engines, 4, between_segments), exact, oldest_allowed, more_prompts, extra)


def _prompt(name: str, length: int) -> Prompt:
    """A prompt whose samples stop at their `length`-th token (the stand-in engines' rule)."""
    return Prompt(name, (length, 60), name, {}, "test")


SEGMENTED = SamplingConfig(n=2, max_new_tokens=12, stop_token_ids=(STOP,), seed=5)


def test_over_sampling_returns_the_first_groups_to_finish_and_carries_the_others_into_the_next_call():
    """One group per batch, one more in flight (`rollout.over_sampling` 1), segments of 4 tokens. The long group A
    is not waited for: B (3 tokens) makes the first batch, A goes on in the second call beside C, which started
    there, and makes the second batch whole, its tokens sampled across both calls' weights."""
    engines = Engines()
    versions = iter([0, 1, 1, 2, 2, 2])
    pulled = []

    def more_prompts():
        pulled.append(1)
        return [_prompt("B", 3), _prompt("C", 9)]

    def between_segments():
        engines.weights = next(versions)
        return engines.weights

    carry = carry_over(engines, between_segments, lambda: 0, more_prompts, extra=1)
    first = carry([_prompt("A", 14)], SEGMENTED, "1.0")
    assert [p.text for p in first.prompts] == ["B", "B"] and first.index == ["1.0/1", "1.0/1"]
    assert first.response_ids == [[1000, 1001, STOP]] * 2 and first.token_versions == [[0] * 3] * 2
    assert carry.carried_groups() == 1 and carry.metrics == {
        "rollout/carried_groups": 1.0,
        "rollout/restarted_groups": 0.0,
    }
    assert [p.text for p in carry.spare] == ["C"]  # pulled once, started when a group left

    second = carry([_prompt("D", 5)], SEGMENTED, "2.0")
    assert [p.text for p in second.prompts] == ["A", "A"] and second.index == ["1.0/0", "1.0/0"]
    whole = single_turn(Engines(), [_prompt("A", 14)], SEGMENTED, "1.0")
    assert second.response_ids == whole.response_ids and second.finish_reasons == ["length"] * 2  # cut at 12
    assert second.token_versions == [[0] * 4 + [1] * 4 + [1] * 4] * 2  # 4 tokens in the first call, 8 here
    for token_versions, log_probs in zip(second.token_versions, second.rollout_log_probs, strict=True):
        assert torch.equal(log_probs, torch.tensor([-0.1 * (v + 1) for v in token_versions]))
    assert [p.text for p in carry.flight.rows.prompts] == ["C", "C"] and carry.flight.rows.index == ["2.0/2", "2.0/2"]
    assert [p.text for p in carry.spare] == ["D"] and len(pulled) == 1  # no prompt skipped, none twice
    # A step made again has its first try's prefix: its new group (D) is numbered on, apart from C's.
    again = carry([_prompt("E", 2)], SEGMENTED, "2.0")
    assert [p.text for p in again.prompts] == ["C", "C"] and again.index == ["2.0/2", "2.0/2"]
    assert [p.text for p in carry.flight.rows.prompts] == ["D", "D"] and carry.flight.rows.index == ["2.0/3", "2.0/3"]


def test_a_carried_group_too_stale_for_the_next_batch_starts_over_from_its_prompt():
    engines = Engines()
    oldest_allowed = iter([0, 1])

    def between_segments():
        return engines.weights

    carry = carry_over(engines, between_segments, lambda: next(oldest_allowed), lambda: [_prompt("B", 3)], 1)
    carry([_prompt("A", 14)], SEGMENTED, "1.0")  # A carried with 4 tokens of version 0
    engines.weights = 1
    batch = carry([_prompt("C", 2)], SEGMENTED, "2.0")
    assert carry.metrics["rollout/restarted_groups"] == 1.0
    assert [p.text for p in batch.prompts] == ["C", "C"]
    assert carry.flight.rows.token_versions == [[1] * 4] * 2  # A again from its prompt: one segment, of version 1


def test_a_call_made_while_another_waits_between_segments_generates_exactly_its_prompts():
    """`AsyncRolloutStream.take` makes a stale batch again while the thread's call waits between two segments:
    that call gets its own prompts' groups, whole, with no carried counts of the other call in its record, and
    the suspended call goes on with its pool untouched."""
    engines = Engines()
    inner = []

    def between_segments():
        if carry.metrics and not inner:  # the thread's second call, its first segment: the trainer's call comes in
            inner.append(None)
            inner[0] = carry([_prompt("X", 5)], SEGMENTED, "9.0")
            inner.append(dict(carry.metrics))  # what the trainer's batch would be logged with
        return 0

    carry = carry_over(engines, between_segments, lambda: 0, lambda: [_prompt("B", 3)], extra=1)
    first = carry([_prompt("A", 14)], SEGMENTED, "1.0")
    assert [p.text for p in first.prompts] == ["B", "B"] and carry.metrics["rollout/carried_groups"] == 1.0
    second = carry([_prompt("C", 2)], SEGMENTED, "2.0")
    assert [p.text for p in inner[0].prompts] == ["X", "X"]
    assert inner[0].response_ids == [[1000, 1001, 1002, 1003, STOP]] * 2
    assert inner[1] == {}, "the exact call carried nothing: no carried counts of another call in its record"
    assert [p.text for p in second.prompts] == ["C", "C"] and carry.carried_groups() == 1
