"""`trainer.rollout_mode: async` (`AsyncRolloutStream`), driven as `Trainer` drives it, with in-process
engines that hold a weight version and record what they did: no Ray, no model.

The training of step k waits until the stream has generated as far ahead as the bound lets it (the
batch of step k + η), so how far it runs ahead is observable without timing anything; the engines
assert the bound on every generation, and that no weight load or validation lands in one.
"""

import json
import threading

import pytest
import torch

from megarl.cluster.timing import PhaseTimer
from megarl.data import Prompt
from megarl.rollout import Samples
from megarl.trainer import generated
from megarl.trainer.async_stream import AsyncRolloutStream, sample_lag_metrics
from megarl.trainer.generated import GeneratedBatch

WAIT_S = 60  # a bound for conditions that must come; reached only when the stream is broken
PROMPTS = [Prompt(f"p{k}", (100 + k,), str(k), {}, "test") for k in range(4)]


def _batch(step: int, version: int) -> GeneratedBatch:
    """Two samples that name the step and weight version they were made for."""
    samples = Samples(
        prompts=[PROMPTS[step % 4]] * 2,
        response_ids=[[step, version], [step]],
        rollout_log_probs=[torch.tensor([-0.5, -1.0]), torch.tensor([-2.0])],
        loss_masks=[torch.tensor([True, True]), torch.tensor([True])],
        finish_reasons=["stop", "length"],
        index=[f"{step}.0/0", f"{step}.0/0"],
        trajectories=[None, None],
        token_versions=[None, None],
    )
    return GeneratedBatch(samples, torch.tensor([1.0, 0.0]), {"reward/mean": 0.5}, None, version)


class Engines:
    """Weights of a version; `generate` checks the staleness bound of what it is asked to make."""

    def __init__(self, gen_timer: PhaseTimer, max_staleness: int):
        self.weights = 0
        self.gen_timer = gen_timer
        self.max_staleness = max_staleness
        self.generating = threading.Event()
        self.log: list[tuple] = []
        self.fail_at: int | None = None
        self.hold_at: int | None = None
        self.release = threading.Event()
        """The generation of step `hold_at` holds until it is set (an engine mid-generation)."""

    def generate(self, step: int, policy_version: int) -> GeneratedBatch:
        assert policy_version == self.weights, (step, policy_version, self.weights)  # the version they really hold
        # The batch is trained by step `step` (the actor then holds step - 1): never more than the bound stale.
        assert step - 1 - policy_version <= self.max_staleness, (step, policy_version)
        self.generating.set()
        with self.gen_timer("rollout"):
            self.log.append(("gen", step, self.weights))
            if step == self.hold_at:
                assert self.release.wait(WAIT_S)
            if step == self.fail_at:
                with self.gen_timer("reward"):
                    self.generating.clear()
                    raise ValueError("the reward function raised")
        self.generating.clear()
        return _batch(step, policy_version)

    def to_rollout(self, step: int) -> dict[str, float]:
        assert not self.generating.is_set(), f"sync of step {step} while a generation runs"
        self.weights = step
        self.log.append(("sync", step))
        return {"sync/weight_version": float(step)}


def _stream(max_staleness: int, steps: int, version: int = 0) -> tuple[AsyncRolloutStream, Engines, PhaseTimer]:
    timer, gen_timer = PhaseTimer(), PhaseTimer()
    engines = Engines(gen_timer, max_staleness)
    engines.weights = version
    return (
        AsyncRolloutStream(
            engines.generate, gen_timer, timer, max_staleness=max_staleness, last_step=steps, version=version
        ),
        engines,
        timer,
    )


def _train(stream: AsyncRolloutStream, engines: Engines, timer: PhaseTimer, steps, save_at: int | None = None):
    """The trainer's calls (`Trainer._train_step`, `_maybe_save`, `_maybe_validate`); each training waits until
    the stream has generated every batch the bound allows now. Returns the batches and, with `save_at`, the
    stream's state saved at that step."""
    taken, state = [], None
    for step in steps:
        with timer("step"):
            batch = stream.take(step)
            stream.start_next(step)
            ahead = min(step + stream.lead, stream.last_step)  # the actor holds step - 1 until the sync
            with stream.cond:
                assert stream.cond.wait_for(lambda a=ahead, s=step: a in stream.ready or a <= s or stream.error, WAIT_S)
            engines.log.append(("train", step, batch.policy_version))
            if step == save_at:
                stream.settle()
                state = json.loads(json.dumps(stream.state_dict(PROMPTS)))  # as extra.json holds it
            stream.sync(step, engines.to_rollout)
            with stream.paused():  # validation uses the engines
                assert not engines.generating.is_set()
        taken.append(batch)
    return taken, state


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_batches_run_ahead_as_far_as_the_bound_allows_and_never_further(max_staleness):
    stream, engines, timer = _stream(max_staleness, steps=6)
    batches, _ = _train(stream, engines, timer, range(1, 7))
    # Step g's batch is generated with the newest weights the bound lets it wait for: those of step g - 1 - η.
    lags = [min(step - 1, max_staleness) for step in range(1, 7)]
    assert [b.metrics["rollout/policy_version_lag/max"] for b in batches] == lags
    assert [b.policy_version for b in batches] == [step - 1 - lag for step, lag in zip(range(1, 7), lags)]
    assert [e[1] for e in engines.log if e[0] == "gen"] == list(range(1, 7))  # each batch once, in order
    assert all(b.metrics["rollout/stale_dropped_samples"] == 0 for b in batches)
    assert all(b.metrics["timing/rollout"] >= 0 for b in batches)  # the thread's own timer, popped per batch
    stream.close()
    assert stream.thread is None


def test_with_room_for_carried_groups_a_batch_starts_a_version_fresher_than_the_bound():
    """`rollout.over_sampling` (carried_room 1) at max_staleness 2: the thread runs as far ahead as a bound of 1
    allows, so that a group carried from one batch into the next is at most 2 versions stale when trained."""
    timer, gen_timer = PhaseTimer(), PhaseTimer()
    engines = Engines(gen_timer, max_staleness=2)
    stream = AsyncRolloutStream(
        engines.generate, gen_timer, timer, max_staleness=2, last_step=6, version=0, carried_room=1
    )
    batches, _ = _train(stream, engines, timer, range(1, 7))
    assert [b.policy_version for b in batches] == [0, 0, 1, 2, 3, 4]
    stream.close()


def test_a_checkpoint_keeps_the_batches_ahead_and_a_resume_trains_on_them():
    stream, engines, timer = _stream(2, steps=6)
    reference, state = _train(stream, engines, timer, range(1, 7), save_at=3)
    stream.close()
    assert sorted(state["ready"]) == ["4", "5"]  # generated beside step 3 with step 2's and 2's weights, ...
    assert [state["ready"][s]["policy_version"] for s in ("4", "5")] == [1, 2]

    resumed, engines, timer = _stream(2, steps=6, version=3)
    resumed.load_state_dict(state, PROMPTS)
    after, _ = _train(resumed, engines, timer, range(4, 7))
    assert [e[1] for e in engines.log if e[0] == "gen"] == [6]  # steps 4 and 5 came from the checkpoint
    assert [b.policy_version for b in after] == [1, 2, 3]
    for ours, theirs in zip(after[:2], reference[3:5]):
        assert ours.samples.response_ids == theirs.samples.response_ids
    resumed.close()


def test_a_batch_over_the_bound_is_dropped_and_generated_again_never_trained_on():
    stream, engines, timer = _stream(2, steps=6)
    _, state = _train(stream, engines, timer, range(1, 4), save_at=3)
    stream.close()
    resumed, engines, timer = _stream(0, steps=6, version=3)  # resumed with a tighter bound
    resumed.load_state_dict(state, PROMPTS)
    batches, _ = _train(resumed, engines, timer, range(4, 7))
    # Step 4's batch (version 1) is 2 stale, step 5's (version 2) 2 too: both made again with the weights now.
    assert [b.policy_version for b in batches] == [3, 4, 5]
    assert [b.metrics["rollout/policy_version_lag/max"] for b in batches] == [0.0, 0.0, 0.0]
    assert [b.metrics["rollout/stale_dropped_samples"] for b in batches] == [2.0, 2.0, 0.0]
    assert [e[1:] for e in engines.log if e[0] == "gen"] == [(4, 3), (5, 4), (6, 5)]
    resumed.close()


def test_a_one_step_off_checkpoint_resumes_into_async():
    stream, engines, timer = _stream(1, steps=4, version=2)
    stream.load_state_dict({"ahead": json.loads(json.dumps(generated.encode(_batch(3, 1), PROMPTS)))}, PROMPTS)
    batches, _ = _train(stream, engines, timer, range(3, 5))
    assert [b.policy_version for b in batches] == [1, 2] and [e[1] for e in engines.log if e[0] == "gen"] == [4]
    stream.close()


def test_a_failed_generation_raises_in_the_main_thread_naming_its_phase_and_step():
    stream, engines, timer = _stream(1, steps=4)
    engines.fail_at = 3
    with pytest.raises(ValueError, match="the reward function raised") as raised:
        _train(stream, engines, timer, range(1, 5))
    assert "raised generating the batch of step 3 ahead (trainer.rollout_mode: async)" in raised.value.__notes__
    assert timer.failed_in == ["step", "rollout", "reward"]
    assert ("sync", 2) not in engines.log  # raised where step 2's sync waited for the generation
    stream.close()


def test_close_waits_for_the_generation_in_flight_and_drops_what_was_made():
    stream, engines, _ = _stream(2, steps=4)
    engines.hold_at = 2  # the engines hang in step 2's generation until they are stopped
    stream.take(1)
    with stream.cond:
        assert stream.cond.wait_for(lambda: stream.generating, WAIT_S)
    engines.release.set()  # the engines stopped: the generation ends
    stream.close()
    assert stream.thread is None and stream.ready == {} and stream.error is None


def _segmented(stream_box: list, hold_step: int):
    """A generation in three segments that calls `between_segments` before each (as `partial_single_turn`
    does); the batch of `hold_step` reaches its second segment only once the main thread wants the engines."""

    def generate(step: int, version: int) -> GeneratedBatch:
        stream, versions = stream_box[0], []
        for segment in range(3):
            if step == hold_step and segment == 1:
                with stream.cond:
                    assert stream.cond.wait_for(lambda: stream.held, WAIT_S)
            versions.append(stream.between_segments())
        batch = _batch(step, version)
        batch.samples.token_versions = [versions[:2], versions[2:]]  # a token per segment
        return batch

    return generate


def _segmented_stream(hold_step: int, version: int = 0) -> AsyncRolloutStream:
    box: list = []
    box.append(
        AsyncRolloutStream(
            _segmented(box, hold_step), PhaseTimer(), PhaseTimer(), max_staleness=1, last_step=3, version=version
        )
    )
    return box[0]


def test_a_weight_load_lands_between_two_segments_and_the_tokens_keep_their_versions():
    stream = _segmented_stream(hold_step=2)
    assert stream.take(1).samples.token_versions == [[0, 0], [0]]
    loaded_in_flight = []
    stream.sync(1, lambda step: loaded_in_flight.append(stream.in_flight) or {})
    assert loaded_in_flight == [2]  # the load did not wait for step 2's batch to end
    batch = stream.take(2)
    assert batch.policy_version == 0 and batch.samples.token_versions == [[0, 1], [1]]
    assert batch.metrics["rollout/policy_version_lag/max"] == 1  # its oldest token's
    assert batch.metrics["rollout/policy_version_lag/mean"] == 0.5  # per sample: its oldest token's, 1 and 0
    assert batch.metrics["rollout/token_version_lag/mean"] == pytest.approx(1 / 3)
    assert batch.metrics["rollout/partial_samples"] == 1
    stream.close()


def test_a_checkpoint_mid_generation_loses_the_batch_in_flight_and_the_resume_says_so(capsys):
    stream = _segmented_stream(hold_step=2)
    stream.take(1)
    stream.settle()  # step 1's checkpoint: the batch of step 2 is held between two segments
    state = json.loads(json.dumps(stream.state_dict(PROMPTS)))
    assert state == {"ready": {}, "in_flight": 2}
    stream.sync(1, lambda step: {})
    stream.close()

    resumed = _segmented_stream(hold_step=0, version=1)
    resumed.load_state_dict(state, PROMPTS)
    assert "the batch of step 2 was in flight and is lost" in capsys.readouterr().out
    assert resumed.take(2).samples.token_versions == [[1, 1], [1]]  # generated again, from the weights now
    resumed.close()


def test_the_bound_holds_on_the_oldest_token_of_a_partial_rollout():
    stream, engines, timer = _stream(1, steps=4, version=2)
    engines.weights = 2
    old = _batch(3, 2)
    old.samples.token_versions = [[0, 2], [2]]  # started under version 0: 2 versions stale at step 3
    stream.load_state_dict({"ready": {"3": generated.encode(old, PROMPTS)}}, PROMPTS)
    batches, _ = _train(stream, engines, timer, range(3, 5))
    assert batches[0].metrics["rollout/stale_dropped_samples"] == 2 and batches[0].policy_version == 2
    stream.close()


def test_a_sample_carried_from_an_earlier_call_lags_by_its_oldest_token_not_by_the_batchs_start():
    """`rollout.over_sampling`: a batch started with weights 3 holds a sample carried from a call made with
    weights 1; trained at step 5 (the actor at 4) it is 3 versions stale, the fresh one 1."""
    batch = _batch(5, 3)
    batch.samples.token_versions = [[1, 2, 3], [3, 3]]
    assert sample_lag_metrics(batch, 5) == {
        "rollout/policy_version_lag/mean": 2.0,
        "rollout/policy_version_lag/max": 3.0,
    }
