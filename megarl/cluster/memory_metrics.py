"""The hand-over's memory metrics, `memory/<role>/<phase>/<stat>`: whose memory, at which moment of the
step, counted how (`megarl.cluster.handover` records them; the trainer logs and documents them with the
rest, `megarl.trainer.metrics`)."""

MEMORY_ROLES = ("actor", "critic", "ref", "rollout")
"""Whose memory `memory/<role>/...` is: a Megatron group by the first role it hosts (the actor's group
also holds the reference and critic that share its layout), or the rollout engines."""
MEMORY_PHASES: dict[str, str] = {
    "generated": "after the rollout: engines awake, Megatron state offloaded as configured",
    "asleep": "after the engines' sleep (KV cache and weights freed)",
    "onloaded": "after the Megatron state came back, before the log-prob passes",
    "trained": "after the updates (and the checkpoint), everything the trainer uses still resident",
    "training_offloaded": "after gradients and optimizer state left the devices as configured",
    "weights_awake": "after the engines' weights came back, before the sync",
    "params_offloaded": "after the sync, with the Megatron parameters offloaded as configured",
    "awake": "after the engines' KV cache came back: ready to generate",
}
"""The hand-over's phases in step order (`megarl.cluster.handover`) -> the moment measured. A group reads
"generated" and "trained" in its next call, right before it acts: the Megatron groups' "generated" comes
after the engines slept and the engines' "trained" after the training state left (what `device_used_gib`,
the whole GPU's, sees of the other side)."""
MEMORY_STATS: dict[str, str] = {
    "allocated_gib": "CUDA: GiB in live tensors of the role's processes (torch's allocator; the highest rank)",
    "reserved_gib": "CUDA: GiB torch's allocator holds from the device, in use or cached (the highest rank)",
    "device_used_gib": "CUDA: GiB used on the role's GPU by every process on it (vLLM's pool included)",
    "rss_gib": "CPU: resident GiB of the role's process and the processes it started (the highest rank)",
}
"""Stat of a `memory/<role>/<phase>/<stat>` metric -> what it counts (`megarl.workers.memory_stats`)."""


def memory_metric(role: str, phase: str, stat: str) -> str:
    """The name of one memory metric: `memory/actor/onloaded/rss_gib`."""
    return f"memory/{role}/{phase}/{stat}"
