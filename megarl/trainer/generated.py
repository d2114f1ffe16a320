"""One step's generated batch, as the rollout stream hands it to the trainer, and its JSON form for a
checkpoint (`trainer.rollout_mode: one_step_off` saves the batch generated ahead with the step it was
generated beside, so that a resume trains on that very batch: `megarl.trainer.rollout_stream`).

The JSON form is exact: token ids are integers, and a float32 log-prob or score is a Python float
(an exact double) whose `repr` JSON writes and reads back bit for bit. A prompt is written as its
position in the run's prompt list (the data loader's, which the resume checks is the saved run's),
not as its text and columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from megarl.data import Prompt
from megarl.rollout import Samples
from megarl.rollout.samples import Trajectory


@dataclass
class GeneratedBatch:
    """What the rollout phase made for one training step."""

    samples: Samples
    scores: Tensor
    """`[N]` float32 sequence-level rewards (the reward function's, DAPO's overlong shaping included)."""
    metrics: dict[str, float]
    """The rollout phase's metrics (`reward/*`, `dapo/*`) and its `timing/rollout`, `timing/reward`."""
    baselines: Tensor | None
    """ReMax: `[N]` the greedy baseline rewards; else None."""
    policy_version: int
    """The weight version the engines generated with: the training step whose weights they held (0: the
    initial model)."""


def encode(batch: GeneratedBatch, prompts: Sequence[Prompt]) -> dict:
    """The batch as JSON-serialisable values; `prompts`: the run's prompt list, which holds every prompt
    of the batch (the data loader's `prompts`)."""
    position = {id(prompt): i for i, prompt in enumerate(prompts)}
    samples = batch.samples
    return {
        "prompts": [position[id(prompt)] for prompt in samples.prompts],
        "response_ids": samples.response_ids,
        "rollout_log_probs": [t.tolist() for t in samples.rollout_log_probs],
        "loss_masks": [t.tolist() for t in samples.loss_masks],
        "finish_reasons": samples.finish_reasons,
        "index": samples.index,
        "trajectories": [None if t is None else asdict(t) for t in samples.trajectories],
        "token_versions": samples.token_versions,
        "routed_experts": None if samples.routed_experts is None else [t.tolist() for t in samples.routed_experts],
        "scores": batch.scores.tolist(),
        "metrics": batch.metrics,
        "baselines": None if batch.baselines is None else batch.baselines.tolist(),
        "policy_version": batch.policy_version,
    }


def decode(state: dict, prompts: Sequence[Prompt]) -> GeneratedBatch:
    """The batch `encode` wrote, its prompts taken from `prompts` (the same list as at the save)."""
    samples = Samples(
        prompts=[prompts[i] for i in state["prompts"]],
        response_ids=[list(ids) for ids in state["response_ids"]],
        rollout_log_probs=[torch.tensor(values, dtype=torch.float32) for values in state["rollout_log_probs"]],
        loss_masks=[torch.tensor(values, dtype=torch.bool) for values in state["loss_masks"]],
        finish_reasons=list(state["finish_reasons"]),
        index=list(state["index"]),
        trajectories=[None if t is None else Trajectory(**t) for t in state["trajectories"]],
        token_versions=list(
            state.get("token_versions") or [None] * len(state["index"])
        ),  # none before partial rollouts
        routed_experts=None
        if state.get("routed_experts") is None  # none without router replay
        else [torch.tensor(values, dtype=torch.int16) for values in state["routed_experts"]],
    )
    baselines = state["baselines"]
    return GeneratedBatch(
        samples,
        torch.tensor(state["scores"], dtype=torch.float32),
        dict(state["metrics"]),
        None if baselines is None else torch.tensor(baselines),
        state["policy_version"],
    )
