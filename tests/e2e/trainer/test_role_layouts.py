"""A reference and a critic whose (TP, PP) differ from the actor's run in worker groups of their own.

One PPO run serves both: the quickstart's actor (TP 2 × DP 1) with the reference at TP 1 × DP 2 and
the critic at PP 2 × DP 1, three processes per device slot plus the colocated engine. The reference
packs its micro-batches (`ref.max_tokens_per_micro_batch`): its rows reach its two DP ranks balanced
by tokens and come back in order, and its log-probs still match the actor's padded ones.

A resume of that critic was a second job here; its two halves are checked apart now: the trainer's (the
part saved before the step commits, loaded on resume) in tests/unit/cluster/test_role_groups.py, the
critic's restored state repeating its next update exactly in tests/distributed/workers/test_megatron_workers.py
(a PP 2 critic among its layouts).
"""

import math

import pytest

from megarl import Trainer
from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.workers.checkpoint_files import part_dir

from .conftest import QUICKSTART, overrides, read_metrics

STEPS = 2
LAYOUTS = {
    "ref.parallel.tensor_model_parallel_size": 1,
    "ref.max_tokens_per_micro_batch": 68,  # two rows of the quickstart's 32 + 2 tokens
    # The actor and the critic padded ("auto" would pack them too): only the reference packs.
    "actor.max_tokens_per_micro_batch": "null",
    "critic.max_tokens_per_micro_batch": "null",
    "critic.enable": "true",
    "algorithm.adv_estimator": "gae",
    "algorithm.lam": 0.95,
    "critic.parallel.tensor_model_parallel_size": 1,
    "critic.parallel.pipeline_model_parallel_size": 2,
    "critic.ppo_mini_batch_size": 16,
    "critic.micro_batch_size_per_gpu": 32,
    # The KL loss reads the reference; with the absolute-difference estimator actor/kl is the token
    # mean of |actor log-prob - ref log-prob|, taken before the step's one optimizer step.
    "actor.use_kl_loss": "true",
    "actor.kl_loss_type": "abs",
    "rollout.sync.verify_every": 5,
    "checkpoint.export_hf": "false",
}
FP32_LOGPROB_TOLERANCE = 1e-5
"""Actor (TP 2) and reference (TP 1) hold the same fp32 weights: their log-probs differ only by the
order of the TP reductions (~1e-7); samples scattered to the wrong rows would differ by ~1."""


@pytest.fixture(scope="module")
def split_layout_run(assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("layouts")
    args = overrides(assets, run_dir, **LAYOUTS, **{"trainer.total_steps": STEPS, "checkpoint.save_freq": 1})
    trainer = Trainer.from_config(QUICKSTART, args)
    trainer.fit()
    return run_dir, trainer, read_metrics(trainer.run_dir / "metrics.jsonl")


def test_reference_with_its_own_layout_matches_the_actor_before_any_update(split_layout_run):
    _, trainer, metrics = split_layout_run
    roles, plan = trainer.cluster.roles, trainer.plan
    assert set(roles.own_groups) == {"ref", "critic"}
    ref = roles.groups["ref"]
    assert ref.dp_size == plan.ref.data_parallel == 2 and {g["tp_rank"] for g in ref.grids} == {0}
    assert roles.groups["actor"].dp_size == plan.actor.data_parallel == 1
    assert roles.packed_roles == {"ref"}
    assert metrics[0]["actor/kl"] < FP32_LOGPROB_TOLERANCE
    # After updates the actor moves away from the frozen reference.
    assert metrics[-1]["actor/kl"] > 100 * FP32_LOGPROB_TOLERANCE


def test_critic_with_its_own_layout_trains_and_saves_its_part(split_layout_run):
    run_dir, trainer, metrics = split_layout_run
    critic = trainer.cluster.roles.groups["critic"]
    assert critic.dp_size == trainer.plan.critic.data_parallel == 1 and {g["pp_rank"] for g in critic.grids} == {0, 1}
    losses = [m["critic/vf_loss"] for m in metrics]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == STEPS
    assert all(m["critic/grad_norm"] > 0 for m in metrics)
    # Saved at steps 1 and 2: each actor checkpoint with the critic's part beside it.
    checkpoints = CheckpointManager(run_dir / "checkpoints").complete()
    assert [c.step for c in checkpoints] == [1, 2] and all(c.manifest.roles == ["actor"] for c in checkpoints)
    parts = CheckpointManager(run_dir / "checkpoints" / "critic").complete()
    assert [(p.path, p.manifest.roles) for p in parts] == [
        (part_dir(c.path, "critic"), ["critic"]) for c in checkpoints
    ]
    assert all(p.manifest.layout["pp"] == 2 for p in parts)
