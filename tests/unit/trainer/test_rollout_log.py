"""rollouts.jsonl: one sample's trajectory every `rollout.multi_turn.log_freq` steps, and on resume the
records of the steps after the checkpoint dropped (the crashed run wrote them; the resumed run writes
them anew). `Trainer._open_rollout_log` and `Trainer._log_trajectory` run as they are, on a stand-in
for the Trainer that holds only what they read (`multi_turn`, `run_dir`, `rollout_log`)."""

import json
from types import SimpleNamespace

import torch

from megarl.config.rollout import MultiTurnConfig
from megarl.data import Prompt
from megarl.rollout import Trajectory
from megarl.trainer.trainer import ROLLOUTS_FILE, Trainer


def run_steps(trainer, start: int, last: int, run: str) -> None:
    """Steps start+1 .. last of one run, each logging a trajectory that names its run and step."""
    with Trainer._open_rollout_log(trainer, start) as trainer.rollout_log:
        for step in range(start + 1, last + 1):
            trajectory = Trajectory(
                messages=[{"role": "assistant", "content": f"{run} step {step}", "tool_calls": []}], ended="answer"
            )
            samples = SimpleNamespace(
                prompts=[Prompt(f"prompt {step}", (1,), None, {}, "test")], trajectories=[trajectory]
            )
            Trainer._log_trajectory(trainer, step, samples, torch.tensor([float(step), -1.0]))


def records(trainer) -> list[tuple[int, str]]:
    lines = (trainer.run_dir / ROLLOUTS_FILE).read_text().splitlines()
    return [(record["step"], record["messages"][0]["content"]) for record in map(json.loads, lines)]


def stand_in(tmp_path, log_freq: int):
    return SimpleNamespace(
        multi_turn=MultiTurnConfig(enable=True, log_freq=log_freq), run_dir=tmp_path, rollout_log=None
    )


def test_every_kth_step_is_written_and_a_resume_drops_the_records_after_its_checkpoint(tmp_path):
    trainer = stand_in(tmp_path, log_freq=3)
    run_steps(trainer, 0, 7, "first")
    assert records(trainer) == [(3, "first step 3"), (6, "first step 6")]
    record = json.loads((tmp_path / ROLLOUTS_FILE).read_text().splitlines()[0])
    assert record == {
        "step": 3,
        "prompt": "prompt 3",
        "ended": "answer",
        "reward": 3.0,
        "messages": [{"role": "assistant", "content": "first step 3", "tool_calls": []}],
    }

    run_steps(trainer, 4, 9, "resumed")  # the checkpoint of step 4: step 6's record is the first run's, dropped
    assert records(trainer) == [(3, "first step 3"), (6, "resumed step 6"), (9, "resumed step 9")]

    run_steps(trainer, 0, 3, "new")  # a run from step 0 in the same directory starts the file over
    assert records(trainer) == [(3, "new step 3")]


def test_log_freq_0_writes_no_trajectory(tmp_path):
    trainer = stand_in(tmp_path, log_freq=0)
    run_steps(trainer, 0, 4, "first")
    assert (tmp_path / ROLLOUTS_FILE).read_text() == ""
