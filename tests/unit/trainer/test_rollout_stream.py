"""The rollout stream's order and weight versions (`trainer.rollout_mode`), driven as `Trainer` drives it,
with in-process engines that record what they did: no Ray, no model.

The engines hold a weight version (the sync sets it) and generate a batch that names the version it
was made with; the events make the overlap of one_step_off observable without timing anything: the
next step's generation must start before the training of this step ends, and a sync must never land
while a generation runs.
"""

import json
import threading

import pytest
import torch

from megarl.cluster.timing import PhaseTimer
from megarl.data import Prompt
from megarl.rollout import Samples
from megarl.rollout.samples import Trajectory
from megarl.trainer import generated
from megarl.trainer.generated import GeneratedBatch
from megarl.trainer.rollout_stream import RolloutStream

WAIT_S = 60  # a bound for events that must come; reached only when the stream is broken
PROMPTS = [Prompt(f"p{k}", (100 + k,), str(k), {"level": k}, "test") for k in range(4)]


def _batch(step: int, version: int) -> GeneratedBatch:
    samples = Samples(
        prompts=[PROMPTS[step % 4], PROMPTS[(step + 1) % 4]],
        response_ids=[[step, version], [7]],
        rollout_log_probs=[torch.tensor([-0.1, -1 / 3]), torch.tensor([-2.0])],
        loss_masks=[torch.tensor([True, False]), torch.tensor([True])],
        finish_reasons=["stop", "length"],
        index=[f"{step}.0/0", f"{step}.0/1"],
        trajectories=[
            Trajectory(
                messages=[{"role": "assistant", "content": "x", "tool_calls": []}],
                final_turn=[7],
                ended="answer",
                tool_latency_s=[0.25],
            ),
            None,
        ],
        token_versions=[[version - 1, version], None],
    )
    return GeneratedBatch(samples, torch.tensor([1.0, 1 / 3]), {"reward/mean": 2 / 3}, None, version)


class Engines:
    """Weights of a version; `generate` records the version it read and when it ran."""

    def __init__(self, gen_timer: PhaseTimer, gate: bool):
        self.weights = 0
        self.gen_timer = gen_timer
        self.generating = False
        self.log: list[tuple] = []
        self.started = {step: threading.Event() for step in range(1, 10)}
        self.trained = {step: threading.Event() for step in range(10)}
        self.trained[0].set()  # nothing trains before step 1
        self.gate = gate
        """one_step_off: step k+1's generation ends only once step k trained (and k's training waits for
        k+1's generation to start): both can only happen when they overlap."""
        self.fail_at: int | None = None

    def generate(self, step: int, policy_version: int) -> GeneratedBatch:
        assert policy_version == self.weights, (step, policy_version, self.weights)  # the version they really hold
        self.generating = True
        self.started[step].set()
        with self.gen_timer("rollout"):
            self.log.append(("gen", step, self.weights))
            if self.gate:
                assert self.trained[step - 1].wait(WAIT_S), (
                    f"step {step}'s generation ended before step {step - 1} trained"
                )
            if step == self.fail_at:
                with self.gen_timer("reward"):
                    raise ValueError("the reward function raised")
        self.generating = False
        return _batch(step, policy_version)

    def to_rollout(self, step: int) -> dict[str, float]:
        assert not self.generating, f"sync of step {step} while a generation runs"
        self.weights = step
        self.log.append(("sync", step))
        return {"sync/weight_version": float(step)}


def _stream(lookahead: int, steps: int, version: int = 0) -> tuple[RolloutStream, Engines, PhaseTimer]:
    timer = PhaseTimer()
    gen_timer = PhaseTimer() if lookahead else timer
    engines = Engines(gen_timer, gate=bool(lookahead))
    return (
        RolloutStream(engines.generate, gen_timer, timer, lookahead=lookahead, last_step=steps, version=version),
        engines,
        timer,
    )


def _train(
    stream: RolloutStream, engines: Engines, timer: PhaseTimer, steps, *, one_step_off: bool
) -> list[GeneratedBatch]:
    """The trainer's calls (`Trainer._train_step` and its loop), the training being a log entry."""
    taken = []
    for step in steps:
        with timer("step"):
            batch = stream.take(step)
            stream.start_next(step)
            if one_step_off and step < stream.last_step:  # the next generation runs beside this training
                assert engines.started[step + 1].wait(WAIT_S), f"step {step + 1}'s generation did not start"
            engines.log.append(("train", step, batch.policy_version))
            engines.trained[step].set()
            stream.sync(step, engines.to_rollout)
        taken.append(batch)
    return taken


def test_one_step_off_generates_the_next_batch_with_weights_one_version_old():
    stream, engines, timer = _stream(lookahead=1, steps=4)
    batches = _train(stream, engines, timer, range(1, 5), one_step_off=True)
    # gen(b1, w0); [train(b1) ∥ gen(b2, w0)]; sync w1; [train(b2) ∥ gen(b3, w1)]; sync w2; ...
    assert [e for e in engines.log if e[0] == "gen"] == [("gen", 1, 0), ("gen", 2, 0), ("gen", 3, 1), ("gen", 4, 2)]
    assert [e for e in engines.log if e[0] == "train"] == [
        ("train", 1, 0),
        ("train", 2, 0),
        ("train", 3, 1),
        ("train", 4, 2),
    ]
    assert [b.metrics["rollout/policy_version_lag/max"] for b in batches] == [0.0, 1.0, 1.0, 1.0]
    assert [b.metrics["rollout/policy_version_lag/mean"] for b in batches] == [0.0, 1.0, 1.0, 1.0]
    assert all(b.metrics["timing/rollout"] >= 0 for b in batches)  # the thread's own timer, popped per batch
    assert stream.thread is None and stream.ahead is None  # nothing generated past the last step


def test_sync_generates_each_batch_with_the_weights_just_trained():
    stream, engines, timer = _stream(lookahead=0, steps=3)
    batches = _train(stream, engines, timer, range(1, 4), one_step_off=False)
    assert [e for e in engines.log if e[0] != "sync"] == [
        ("gen", 1, 0),
        ("train", 1, 0),
        ("gen", 2, 1),
        ("train", 2, 1),
        ("gen", 3, 2),
        ("train", 3, 2),
    ]
    assert [b.metrics["rollout/policy_version_lag/max"] for b in batches] == [0.0, 0.0, 0.0]
    assert "timing/rollout" in timer.pop()  # sync: the generation is a phase of the trainer's step


def test_a_failed_generation_raises_in_the_main_thread_naming_its_phase_and_step():
    stream, engines, timer = _stream(lookahead=1, steps=4)
    engines.fail_at = 3
    with pytest.raises(ValueError, match="the reward function raised") as raised:
        _train(stream, engines, timer, range(1, 5), one_step_off=True)
    assert "raised generating the batch of step 3 ahead (trainer.rollout_mode: one_step_off)" in raised.value.__notes__
    # Raised where step 2 waits for it before its sync: the CLI names the generation's innermost phase.
    assert timer.failed_in == ["step", "rollout", "reward"]
    assert ("sync", 2) not in engines.log  # the weights were not loaded over the failed generation


def test_a_resume_trains_on_the_batch_the_checkpoint_kept_and_continues_as_the_run():
    stream, engines, timer = _stream(lookahead=1, steps=4)
    reference = _train(stream, engines, timer, range(1, 5), one_step_off=True)

    stream, engines, timer = _stream(lookahead=1, steps=4)
    state = json.loads(json.dumps(_train_until_save(stream, engines, timer, 2)))  # as extra.json holds it
    resumed, engines, timer = _stream(lookahead=1, steps=4, version=2)
    engines.weights = 2  # the resume synced the checkpoint's weights into new engines
    resumed.load_state_dict(state, PROMPTS)
    after = _train(resumed, engines, timer, range(3, 5), one_step_off=True)
    assert [e for e in engines.log if e[0] == "gen"] == [("gen", 4, 2)]  # step 3's batch was not generated again
    for ours, theirs in zip(after, reference[2:]):
        assert ours.policy_version == theirs.policy_version
        assert ours.metrics["rollout/policy_version_lag/max"] == theirs.metrics["rollout/policy_version_lag/max"] == 1
        assert ours.samples.response_ids == theirs.samples.response_ids


def _train_until_save(stream: RolloutStream, engines: Engines, timer: PhaseTimer, save_step: int) -> dict:
    """Steps 1 .. save_step, the stream's state saved as `Trainer._maybe_save` saves it at `save_step`
    (after the training, before the sync)."""
    _train(stream, engines, timer, range(1, save_step), one_step_off=True)
    stream.take(save_step)
    stream.start_next(save_step)
    engines.trained[save_step].set()
    stream.settle()
    state = stream.state_dict(PROMPTS)
    assert state["ahead"]["policy_version"] == save_step - 1  # generated beside step save_step, one version old
    return state


def test_a_checkpoint_without_a_batch_ahead_generates_the_first_one_now():
    stream, engines, timer = _stream(lookahead=1, steps=3, version=1)
    engines.weights = 1
    engines.trained[1].set()
    stream.load_state_dict(None, PROMPTS)  # a sync run's checkpoint
    batches = _train(stream, engines, timer, range(2, 4), one_step_off=True)
    assert [b.metrics["rollout/policy_version_lag/max"] for b in batches] == [0.0, 1.0]


def test_close_waits_for_the_generation_in_flight_and_drops_it():
    stream, engines, _timer = _stream(lookahead=1, steps=3)
    stream.take(1)
    stream.start_next(1)  # step 2 waits for step 1's training, which never comes: the run failed
    assert engines.started[2].wait(WAIT_S)
    engines.trained[1].set()  # the engines stopped: the generation ends
    stream.close()
    assert stream.thread is None and stream.ahead is None and stream.error is None


def test_the_json_form_of_a_batch_is_exact():
    batch = _batch(3, 2)
    batch.baselines = torch.tensor([0.5, 1 / 7])
    back = generated.decode(json.loads(json.dumps(generated.encode(batch, PROMPTS))), PROMPTS)
    assert all(a is b for a, b in zip(back.samples.prompts, batch.samples.prompts))
    for name in ("response_ids", "finish_reasons", "index", "trajectories", "token_versions"):
        assert getattr(back.samples, name) == getattr(batch.samples, name), name
    for ours, theirs in [
        *zip(back.samples.rollout_log_probs, batch.samples.rollout_log_probs),
        *zip(back.samples.loss_masks, batch.samples.loss_masks),
        (back.scores, batch.scores),
        (back.baselines, batch.baselines),
    ]:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert (back.metrics, back.policy_version) == (batch.metrics, batch.policy_version)
