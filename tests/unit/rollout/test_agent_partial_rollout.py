"""The agent loop with partial rollouts (`rollout.partial_rollout` in trainer.rollout_mode async): turns
generated a segment at a time, weight updates landing inside a turn and between turns, every token keeping
its weight version, and the async stream's staleness accounting of such multi-turn samples.

The engines are test_agent_loop's scripted ones (their contract: megarl.workers.rollout.rollout_worker.
RolloutWorker.generate), made to continue a turn as vLLM does when given prompt + the tokens so far: the
turn so far is what follows the context's last generation prompt ("assistant: ", which the tiny chat
template and every observation end with), and the engines go on with the rest of the scripted turn. A
token's log-prob names the weights that sampled it: -(1 + k) / 100 - weights for the k-th token of a turn.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from test_agent_loop import EOS, SAMPLING, TOKENIZER, Parser, ScriptedEngines, Tools, prompts, three_calls_then_answer

from megarl.cluster.timing import PhaseTimer
from megarl.config.rollout import MultiTurnConfig
from megarl.rollout import AgentLoop, ObservationEncoder
from megarl.rollout.carry import CarryOver
from megarl.rollout.multi_turn import TrajectoriesInFlight
from megarl.trainer import generated
from megarl.trainer.async_stream import AsyncRolloutStream
from megarl.trainer.generated import GeneratedBatch
from megarl.workers.rollout.base import RolloutOutput, SamplingConfig

GENERATION_PROMPT = TOKENIZER.encode("assistant: ", add_special_tokens=False)
WAIT_S = 60  # a bound for conditions that must come; reached only when the stream is broken


class ContinuingEngines(ScriptedEngines):
    """Scripted engines holding weights of version `weights` that continue a turn cut short."""

    def __init__(self, world_size: int, script):
        super().__init__(world_size, script)
        self.weights = 0
        self.before_call = lambda: None
        """Runs at the start of every generate call (the test's hook into the timing)."""

    def call_each(self, method, args):
        assert method == "generate" and len(args) == self.world_size
        self.before_call()
        results = []
        for contexts, sampling, caps, seeds in args:
            assert sampling.n == 1
            outputs = []
            for context, cap, seed in zip(contexts, caps, seeds, strict=True):
                self.requests.append((list(context), seed, cap))
                so_far = _turn_so_far(context)
                text = TOKENIZER.decode(context)
                whole = TOKENIZER.encode(self.script(text, text.count("\ntool: ")), add_special_tokens=False) + [EOS]
                assert whole[: len(so_far)] == so_far, "the context is not a start of the scripted turn"
                ids = whole[len(so_far) : len(so_far) + cap]
                reason = "stop" if ids and ids[-1] == EOS else "length"
                log_probs = torch.tensor(
                    [-(1 + k) / 100 - self.weights for k in range(len(so_far), len(so_far) + len(ids))]
                )
                outputs.append(RolloutOutput(list(context), [ids], [log_probs], [reason]))
            results.append(outputs)
        return results


def _turn_so_far(context: list[int]) -> list[int]:
    """The tokens after the context's last generation prompt."""
    n = len(GENERATION_PROMPT)
    start = max(i + n for i in range(len(context) - n + 1) if context[i : i + n] == GENERATION_PROMPT)
    return list(context[start:])


def agent_loop(engines, segment: int = 0, between_segments=None, **settings) -> AgentLoop:
    config = MultiTurnConfig(enable=True, **{"max_turns": 4, "max_total_tokens": 1000, **settings})
    return AgentLoop(
        engines,
        Tools(),
        Parser(),
        ObservationEncoder(TOKENIZER),
        lambda ids: TOKENIZER.decode(ids, skip_special_tokens=False),
        config,
        segment=segment,
        between_segments=between_segments,
    )


def _each_segment_a_new_version(engines: ContinuingEngines):
    """`between_segments` as a stream whose weights change before every segment but the first: 0, 1, 2, ..."""
    calls = []

    def between_segments() -> int:
        engines.weights = len(calls)
        calls.append(engines.weights)
        return engines.weights

    return between_segments, calls


def _turn_lengths(script) -> list[int]:
    return [len(TOKENIZER.encode(script("", turn), add_special_tokens=False)) + 1 for turn in range(4)]


def test_turns_go_on_across_weight_updates_each_token_keeping_its_version():
    segment = 16
    engines = ContinuingEngines(2, three_calls_then_answer)
    between_segments, calls = _each_segment_a_new_version(engines)
    samples = agent_loop(engines, segment, between_segments)(prompts(3), SAMPLING, "1.0")
    whole_engines = ContinuingEngines(2, three_calls_then_answer)
    whole = agent_loop(whole_engines)(prompts(3), SAMPLING, "1.0")

    # The same trajectories as whole turns give: tool calls parsed from the turns the segments put together.
    assert samples.response_ids == whole.response_ids and samples.finish_reasons == whole.finish_reasons
    assert [m.tolist() for m in samples.loss_masks] == [m.tolist() for m in whole.loss_masks]
    assert samples.trajectories == whole.trajectories
    assert all(t.tool_calls == 3 and t.ended == "answer" for t in samples.trajectories)
    assert whole.token_versions == [None] * 6  # no partial rollouts: the batch's version holds

    # Every trajectory's turns run in the same waves (the tools answer at once), a segment per call:
    # token k of turn t was sampled by the weights of segment k // 16 of that turn.
    lengths = _turn_lengths(three_calls_then_answer)
    segments = [-(-n // segment) for n in lengths]
    assert calls == list(range(sum(segments)))
    observation = len(samples.response_ids[0]) - sum(lengths)  # three observations of equal length
    assert observation % 3 == 0
    expected = []
    for turn, n in enumerate(lengths):
        first = sum(segments[:turn])
        expected += [first + k // segment for k in range(n)]
        if turn < 3:  # the observation: the version of the turn whose calls it answers
            expected += [expected[-1]] * (observation // 3)
    for versions, log_probs, whole_log_probs, mask in zip(
        samples.token_versions, samples.rollout_log_probs, whole.rollout_log_probs, samples.loss_masks, strict=True
    ):
        assert versions == expected
        # The log-probs are those of the weights of each token's segment (0 on observations).
        shift = torch.tensor(versions, dtype=torch.float32) * mask
        torch.testing.assert_close(log_probs, whole_log_probs - shift, rtol=0, atol=1e-6)

    # The continuations carry prompt + every token so far and stop mid-turn; each asks for one segment.
    assert all(cap <= segment for _, _, cap in engines.requests)
    continued = [context for context, _, _ in engines.requests if _turn_so_far(context)]
    assert len(continued) == 6 * (sum(segments) - 4)
    # A turn's first segment has the seed the whole turn has; later segments seeds of their own.
    seeds = [seed for _, seed, _ in engines.requests]
    assert len(set(seeds)) == len(seeds)
    assert {seed for c, seed, _ in engines.requests if not _turn_so_far(c)} == {s for _, s, _ in whole_engines.requests}


def test_a_turn_cut_by_max_new_tokens_over_several_segments_ends_the_trajectory():
    engines = ContinuingEngines(1, three_calls_then_answer)
    sampling = SamplingConfig(n=1, max_new_tokens=20, seed=0, stop_token_ids=(EOS,))
    samples = agent_loop(engines, 8, lambda: 0)(prompts(1), sampling, "x")
    assert [cap for _, _, cap in engines.requests] == [8, 8, 4]
    assert samples.trajectories[0].ended == "turn_length" and samples.trajectories[0].tool_calls == 0
    assert len(samples.response_ids[0]) == 20 and samples.finish_reasons == ["length"]
    assert samples.token_versions == [[0] * 20]


def test_a_trajectory_cut_at_max_total_tokens_mid_segment_matches_whole_turns():
    budget = _turn_lengths(three_calls_then_answer)[0] + 5  # the first observation is cut
    segmented = agent_loop(ContinuingEngines(1, three_calls_then_answer), 6, lambda: 0, max_total_tokens=budget)
    samples = segmented(prompts(1), SAMPLING, "x")
    whole = agent_loop(ContinuingEngines(1, three_calls_then_answer), max_total_tokens=budget)(
        prompts(1), SAMPLING, "x"
    )
    assert samples.response_ids == whole.response_ids and samples.trajectories == whole.trajectories
    assert all(t.ended == "max_total_tokens" for t in samples.trajectories)
    assert all(len(v) == budget for v in samples.token_versions)


def test_a_weight_load_lands_inside_a_trajectory_in_the_async_stream():
    """The stream's thread generates with an agent loop whose segments ask the stream for the weights; step 1's
    sync arrives while step 2's trajectories are mid-turn and lands at their next segment. The batch's
    staleness is its oldest token's, and the token-version lag counts the model's tokens only."""
    engines = ContinuingEngines(1, three_calls_then_answer)
    box: list[AsyncRolloutStream] = []
    generating = {"step": 0, "calls": 0}
    mid_turn = threading.Event()

    def generate(step: int, version: int) -> GeneratedBatch:
        generating["step"], generating["calls"] = step, 0
        samples = agent_loop(engines, 16, lambda: box[0].between_segments())(prompts(2), SAMPLING, f"{step}.0")
        assert all(torch.equal(lp, _from_weights(v, m)) for v, lp, m in _rows(samples))
        return GeneratedBatch(samples, torch.zeros(len(samples)), {}, None, version)

    def before_call():
        generating["calls"] += 1
        if generating["step"] == 2 and generating["calls"] == 2:  # the second segment of step 2's first turn
            mid_turn.set()
            with box[0].cond:
                assert box[0].cond.wait_for(lambda: box[0].held, WAIT_S)

    def to_rollout(step: int) -> dict[str, float]:
        assert not stream.generating
        engines.weights = step
        return {}

    engines.before_call = before_call
    box.append(AsyncRolloutStream(generate, PhaseTimer(), PhaseTimer(), max_staleness=1, last_step=2, version=0))
    stream = box[0]
    assert stream.take(1).metrics["rollout/partial_samples"] == 0
    assert mid_turn.wait(WAIT_S)
    stream.sync(1, to_rollout)
    batch = stream.take(2)
    stream.close()
    samples = batch.samples
    assert batch.policy_version == 0 and batch.metrics["rollout/policy_version_lag/max"] == 1
    first_turn = _turn_lengths(three_calls_then_answer)[0]
    for versions in samples.token_versions:
        # Two segments of 16 tokens under version 0, then version 1: the rest of turn 0 and everything after.
        assert versions[:32] == [0] * 32 and set(versions[32:]) == {1} and len(versions) > first_turn
    model = [
        v for versions, mask in zip(samples.token_versions, samples.loss_masks) for v, m in zip(versions, mask) if m
    ]
    everything = [v for versions in samples.token_versions for v in versions]
    assert batch.metrics["rollout/token_version_lag/mean"] == pytest.approx(sum(1 - v for v in model) / len(model))
    assert batch.metrics["rollout/token_version_lag/mean"] != pytest.approx(
        sum(1 - v for v in everything) / len(everything)
    )  # the observations (version 1) would pull the mean down
    assert batch.metrics["rollout/partial_samples"] == len(samples)


def _rows(samples):
    return zip(samples.token_versions, samples.rollout_log_probs, samples.loss_masks, strict=True)


def _from_weights(versions: list[int], mask: torch.Tensor) -> torch.Tensor:
    """The log-probs ContinuingEngines give a multi-turn response token by token, from `versions`."""
    expected, k = [], 0
    for version, mine in zip(versions, mask.tolist(), strict=True):
        expected.append(-(1 + k) / 100 - version if mine else 0.0)
        k = k + 1 if mine else 0
    return torch.tensor(expected)


def test_a_checkpoint_keeps_a_multi_turn_batch_with_its_token_versions():
    """The async stream's checkpoint state (`generated.encode`, JSON) holds the trajectories, masks and
    per-token versions of an agent batch generated ahead; a resume reads back the same batch."""
    engines = ContinuingEngines(1, three_calls_then_answer)
    between_segments, _ = _each_segment_a_new_version(engines)
    batch_prompts = prompts(2)
    samples = agent_loop(engines, 16, between_segments)(batch_prompts, SAMPLING, "3.0")
    batch = GeneratedBatch(samples, torch.arange(4.0), {"reward/mean": 1.5}, None, 0)
    back = generated.decode(json.loads(json.dumps(generated.encode(batch, batch_prompts))), batch_prompts)
    assert back.samples.token_versions == samples.token_versions and back.samples.trajectories == samples.trajectories
    assert [m.tolist() for m in back.samples.loss_masks] == [m.tolist() for m in samples.loss_masks]
    assert all(torch.equal(a, b) for a, b in zip(back.samples.rollout_log_probs, samples.rollout_log_probs))
    assert back.scores.tolist() == [0.0, 1.0, 2.0, 3.0] and back.policy_version == 0


def answer_at_once_for_q1(text: str, turn: int) -> str:
    """q1's trajectories answer in their first turn; the others call a tool three times, then answer."""
    return "the answer" if "q1" in text else three_calls_then_answer(text, turn)


def _carry(engines, between_segments, oldest_allowed, more_prompts) -> CarryOver:
    """`rollout.over_sampling` 1 over the agent loop in segments of 16 tokens, as the trainer makes it."""
    loop = agent_loop(engines, 16, between_segments)
    return CarryOver(TrajectoriesInFlight(loop), loop, oldest_allowed, more_prompts, extra=1)


def test_over_sampling_carries_a_trajectory_between_its_turns_into_the_next_call():
    """One group per batch and one more in flight: q1's group (it answers at once) makes the first batch, not
    q0's (three tool turns), which goes on from its second turn in the next call beside q2's, started there, and
    makes that batch: the trajectories the loop gives without carrying, their turns sampled across both calls'
    weights, each token with its version."""
    q0, q1, q2 = prompts(3)
    engines = ContinuingEngines(2, answer_at_once_for_q1)
    between_segments, calls = _each_segment_a_new_version(engines)
    pulled = iter([[q1, q2]])
    carry = _carry(engines, between_segments, lambda: 0, lambda: next(pulled))

    first = carry([q0], SAMPLING, "1.0")
    assert first.prompts == [q1, q1] and first.index == ["1.0/1", "1.0/1"]
    assert all(t.ended == "answer" and t.turns == 1 for t in first.trajectories)
    assert carry.metrics == {"rollout/carried_groups": 1.0, "rollout/restarted_groups": 0.0}
    carried = carry.flight.trajectories.everyone()
    assert [t.group for t in carried] == ["1.0/0"] * 2 and all(t.trajectory.turns == 1 for t in carried)
    assert carry.spare == [q2]
    first_call = len(calls)  # the versions of the first call's segments: 0 .. first_call - 1

    second = carry([prompts(4)[3]], SAMPLING, "2.0")
    assert second.prompts == [q0, q0] and second.index == ["1.0/0", "1.0/0"]
    whole = agent_loop(ContinuingEngines(2, answer_at_once_for_q1))([q0], SAMPLING, "1.0")
    assert second.response_ids == whole.response_ids and second.trajectories == whole.trajectories
    assert [m.tolist() for m in second.loss_masks] == [m.tolist() for m in whole.loss_masks]
    for versions in second.token_versions:
        assert min(versions) < first_call <= max(versions), versions  # sampled in both calls
        assert versions == sorted(versions)  # each token the version of its segment, segments in order
    assert [t.group for t in carry.flight.trajectories.everyone()] == ["2.0/2"] * 2  # q2's, mid-conversation


def test_a_carried_trajectory_too_stale_for_the_next_batch_starts_over_from_its_prompt():
    q0, q1, q2 = prompts(3)
    engines = ContinuingEngines(2, answer_at_once_for_q1)
    between_segments, calls = _each_segment_a_new_version(engines)
    carry = _carry(engines, between_segments, lambda: len(calls), lambda: [q1, q2])
    carry([q0], SAMPLING, "1.0")  # q0's group carried after its first turn
    first_call = len(calls)

    batch = carry([prompts(4)[3]], SAMPLING, "2.0")
    assert carry.metrics["rollout/restarted_groups"] == 1.0
    assert batch.prompts == [q0, q0]  # again from its prompt, ahead of q2's, started after it
    whole = agent_loop(ContinuingEngines(2, answer_at_once_for_q1))([q0], SAMPLING, "1.0")
    assert batch.response_ids == whole.response_ids
    assert all(min(versions) >= first_call for versions in batch.token_versions)  # nothing of the stale turn
