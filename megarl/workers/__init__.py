"""Workers: plain classes (no Ray import) that hold models and do one job each.

The Megatron actor, critic and reference, and the rollout engines (`megarl.workers.rollout`).
Orchestration wraps them in Ray actors; tests drive them directly.
"""
