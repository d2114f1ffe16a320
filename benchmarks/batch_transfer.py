"""Bytes that cross the Ray boundary between the driver and the Megatron groups in one training step:

    PYTHONPATH=. python benchmarks/batch_transfer.py

The trainer's own `_train_step` against recording stand-ins of the worker groups
(`tests/recorded_transfers.py`: each argument object counted once, as `WorkerGroup.call_each` stores
it; results only from the ranks that reply; pickled sizes, as Ray serializes tensors), on the
quickstart's sizes (16 prompts × 8 samples, prompts of 1–32 tokens, 1–2 new tokens, random and
seeded) and with up to 64 new tokens (issue 19's response length). PPO: the KL loss, a critic (GAE)
and 4 actor mini-batches (so the old log-probs need a pass of their own), the reference and critic
sharing the actor's layout (one group) or at TP 1 × DP 2 (groups of their own). The rollout's own
traffic (prompts to the engines, samples back) and the weight sync are not counted. Prints a
markdown table of the second step (the first is alike).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from recorded_transfers import recorded_trainer, run_step  # noqa: E402

QUICKSTART = REPO / "configs" / "quickstart.yaml"
PPO = [
    "actor.use_kl_loss=true",
    "critic.enable=true",
    "algorithm.adv_estimator=gae",
    "critic.ppo_mini_batch_size=16",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size_per_gpu=4",
]
SAME_LAYOUT = ["ref.parallel.tensor_model_parallel_size=2", "critic.parallel.tensor_model_parallel_size=2"]
OWN_GROUPS = ["ref.parallel.tensor_model_parallel_size=1", "critic.parallel.tensor_model_parallel_size=1"]
LONG = ["rollout.max_new_tokens=64"]
CASES = {
    "quickstart GRPO (on-policy)": [],
    "quickstart PPO: critic + ref + KL loss, one group": PPO + SAME_LAYOUT,
    "quickstart PPO: critic, ref in groups of their own (DP 2)": PPO + OWN_GROUPS,
    "quickstart PPO + KL in reward, one group": PPO + SAME_LAYOUT + ["algorithm.use_kl_in_reward=true"],
    "GRPO, ≤ 64 new tokens (on-policy)": LONG,
    "PPO, ≤ 64 new tokens, one group": PPO + SAME_LAYOUT + LONG,
}


def step_bytes(overrides: list[str]) -> tuple[int, int, Counter]:
    """Bytes sent to and received from the groups in step 2, and the sent bytes by field."""
    trainer = recorded_trainer(QUICKSTART, overrides)
    run_step(trainer, 1)
    marks = {id(group): len(group.workers.calls) for group in trainer.cluster.roles.groups.values()}
    run_step(trainer, 2)
    sent, received, by_field = 0, 0, Counter()
    for group in {id(group): group for group in trainer.cluster.roles.groups.values()}.values():
        for call in group.workers.calls[marks[id(group)] :]:
            sent += sum(call.sent.values())
            received += call.received
            by_field.update(call.sent)
    return sent, received, by_field


def main() -> None:
    print("| step | sent to the groups (KiB) | received (KiB) | largest payloads sent (KiB) |")
    print("|---|---|---|---|")
    for name, overrides in CASES.items():
        sent, received, by_field = step_bytes(overrides)
        largest = ", ".join(f"{field} {size / 1024:.1f}" for field, size in by_field.most_common(3))
        print(f"| {name} | {sent / 1024:.1f} | {received / 1024:.1f} | {largest} |")


if __name__ == "__main__":
    main()
