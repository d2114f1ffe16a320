"""Rollout functions: what the trainer calls to turn prompts into training samples.

    samples = single_turn(engines, prompts, sampling, group_prefix)      # one response per sample
    samples = AgentLoop(engines, tools, parser, observations, decode, multi_turn)(prompts, sampling, group_prefix)
    samples = partial_single_turn(engines, segment, between_segments, prompts, sampling, group_prefix)  # async
    batch = CarryOver(RowsInFlight(engines, segment, between_segments), ...)(prompts, sampling, group_prefix)  # carried
    agent = AgentLoop(..., segment=segment, between_segments=between_segments)  # async: turns in segments

Both return `Samples` with a per-token `loss_masks` (False on tool observations) and, multi-turn, each
sample's `Trajectory`. The engines they drive (vLLM, HF) live in `megarl.workers.rollout`; DAPO's
dynamic sampling runs on top of either in the trainer's rollout phase (`megarl.trainer.rollout`).
"""

from megarl.rollout.multi_turn import AgentLoop
from megarl.rollout.observation import ObservationEncoder
from megarl.rollout.samples import Samples, Trajectory, flatten_rollouts
from megarl.rollout.single_turn import generate_contexts, offset_seed, single_turn

__all__ = [
    "AgentLoop",
    "ObservationEncoder",
    "Samples",
    "Trajectory",
    "flatten_rollouts",
    "generate_contexts",
    "offset_seed",
    "single_turn",
]
