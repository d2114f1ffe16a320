"""A training step stages its batch once on each Megatron group it calls; later calls send only what is
new there, and the old and reference log-probs stay in the actor's group unless the driver reads them.

The trainer's own `_train_step` runs against recording stand-ins of the worker groups
(`tests/recorded_transfers.py`: `WorkerGroup.call_each`'s one copy per argument object, as
`stored_once` puts it; `PolicyWorker`'s staging methods around arithmetic roles)."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from recorded_transfers import (
    StandInWorker,
    old_log_probs_of,
    recorded_trainer,
    ref_log_probs_of,
    run_step,
    run_step_on,
    samples_of,
)

from megarl.algorithms.kl import apply_kl_penalty
from megarl.config.rollout import response_length
from megarl.trainer import rollout_batch as rb
from megarl.workers.batch import PolicyBatch

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
BASE = ("prompts", "prompt_mask", "responses", "response_mask")
SEVERAL_MINI_BATCHES = ("actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=4")
"""The old log-probs need a pass of their own."""
KL_LOSS = ("actor.use_kl_loss=true",)
CRITIC = ("critic.enable=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=16")
OWN_GROUPS = (
    "ref.parallel.tensor_model_parallel_size=1",
    "critic.parallel.tensor_model_parallel_size=1",
    "ref.max_tokens_per_micro_batch=68",
)
"""The reference and the critic at TP 1 × DP 2 beside the actor's TP 2: groups of their own."""


def distinct_groups(trainer):
    return list({id(group): (role, group) for role, group in trainer.cluster.roles.groups.items()}.values())


def step_calls(group, step_index: int):
    """The calls of one step (each step ends with `drop_staged`)."""
    steps, current = [], []
    for call in group.workers.calls:
        current.append(call)
        if call.method == "drop_staged":
            steps.append(current)
            current = []
    assert not current, "a step left its batch staged"
    return steps[step_index]


def sent(calls) -> Counter:
    return Counter(name for call in calls for name in call.fields_sent)


def run(*overrides: str, steps: int = 2):
    trainer = recorded_trainer(QUICKSTART, list(overrides))
    metrics = [run_step(trainer, step) for step in range(1, steps + 1)]
    return trainer, metrics


def assert_batch_staged_once_per_group(trainer, steps: int = 2):
    for step_index in range(steps):
        for role, group in distinct_groups(trainer):
            calls = step_calls(group, step_index)
            assert [c.method for c in calls].count("stage_batch") == 1, role
            # Once per DP part: the tokens and masks travel with the stage and never again.
            assert all(sent(calls)[name] == group.dp_size for name in BASE), (role, sent(calls))
            assert all(not set(c.fields_sent) & set(BASE) for c in calls if c.method != "stage_batch")
            assert all(rank.staged is None for rank in group.workers.ranks)  # dropped at the step's end


def test_grpo_keeps_the_old_log_probs_in_the_actor_group():
    trainer, _ = run(*SEVERAL_MINI_BATCHES, "actor.parallel.tensor_model_parallel_size=1")  # DP 2
    assert trainer.plan.old_log_prob_pass
    assert_batch_staged_once_per_group(trainer)
    [(_, actor)] = distinct_groups(trainer)
    calls = step_calls(actor, 0)
    assert [c.method for c in calls] == [
        "stage_batch",
        "call_staged:compute_log_prob",
        "call_staged:update_actor",
        "drop_staged",
    ]
    old_pass, update = calls[1], calls[2]
    assert old_pass.kept == "old_log_probs" and old_pass.received == 0
    assert update.fields_sent == ["advantages", "advantages"]  # one part per DP replica, nothing else
    assert "old_log_probs" not in sent(actor.workers.calls)
    # The engines' log-probs travel with the stage, once per DP part, for the mismatch metrics.
    assert sent(calls)["rollout_log_probs"] == actor.dp_size == 2


def test_ppo_in_the_actor_group_sends_advantages_and_returns_and_receives_only_the_values():
    trainer, metrics = run(
        *SEVERAL_MINI_BATCHES,
        *KL_LOSS,
        *CRITIC,
        "ref.parallel.tensor_model_parallel_size=2",
        "critic.parallel.tensor_model_parallel_size=2",
    )
    assert not trainer.cluster.roles.own_groups
    assert_batch_staged_once_per_group(trainer)
    [(_, group)] = distinct_groups(trainer)
    calls = {c.method: c for c in step_calls(group, 1)}
    assert calls["call_staged:compute_log_prob"].received == calls["call_staged:compute_ref_log_prob"].received == 0
    assert calls["call_staged:compute_values"].received > 0  # GAE reads them in the driver
    assert sorted(calls["call_staged:update_critic"].fields_sent) == ["advantages", "returns"]
    assert calls["call_staged:update_actor"].fields_sent == []
    assert not {"old_log_probs", "ref_log_probs", "values"} & set(sent(group.workers.calls))
    assert metrics[-1]["actor/loss"] == metrics[-1]["critic/vf_loss"] == 2.0


def test_a_reference_of_its_own_hands_its_log_probs_to_the_actor_through_the_driver():
    trainer, _ = run(*SEVERAL_MINI_BATCHES, *KL_LOSS, *CRITIC, *OWN_GROUPS, "actor.rollout_correction.level=token")
    assert set(trainer.cluster.roles.own_groups) == {"ref", "critic"}
    assert_batch_staged_once_per_group(trainer)
    groups = trainer.cluster.roles.groups
    ref_calls = {c.method: c for c in step_calls(groups["ref"], 0)}
    assert ref_calls["call_staged:compute_ref_log_prob"].received > 0
    actor_calls = step_calls(groups["actor"], 0)
    # [B, R] once (DP 1), with the actor's next call after the reference's pass: its update.
    assert [c.fields_sent for c in actor_calls if c.method == "call_staged:update_actor"] == [
        ["ref_log_probs", "advantages"]
    ]
    assert "old_log_probs" not in sent(actor_calls) and sent(actor_calls)["rollout_log_probs"] == 1
    # The critic gets the tokens, then only the returns; the reference only the tokens: no actor fields.
    assert sent(step_calls(groups["critic"], 0)) == Counter(dict.fromkeys((*BASE, "returns"), 2))
    assert sent(step_calls(groups["ref"], 0)) == Counter(dict.fromkeys(BASE, 2))


def test_the_kl_penalty_in_the_reward_fetches_both_log_probs_in_row_order():
    trainer, metrics = run(
        *SEVERAL_MINI_BATCHES,
        "algorithm.use_kl_in_reward=true",
        "ref.max_tokens_per_micro_batch=68",
        "actor.max_tokens_per_micro_batch=68",
        "actor.parallel.tensor_model_parallel_size=1",
        "ref.parallel.tensor_model_parallel_size=1",
    )
    [(_, group)] = distinct_groups(trainer)
    assert group.dp_size == 2 and trainer.cluster.roles.packed_roles == {"actor", "ref"}
    calls = [c.method for c in step_calls(group, 1)]
    assert calls.count("staged_field") == 2  # the old and the reference log-probs, once each
    samples, scores = samples_of(trainer.config, trainer.plan, seed=2)
    batch = rb.policy_batch(samples, response_length(trainer.config.rollout))
    _, kl = apply_kl_penalty(
        rb.token_level_scores(scores, batch.response_mask),
        old_log_probs_of(batch),
        ref_log_probs_of(batch),
        batch.response_mask,
        trainer.kl_ctrl.value,
        trainer.config.algorithm.kl_penalty,
    )
    assert metrics[-1]["actor/reward_kl_penalty"] == pytest.approx(kl.item(), rel=1e-6)


def tiny_batch(**fields) -> PolicyBatch:
    return PolicyBatch(
        prompts=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        responses=torch.ones(2, 3, dtype=torch.long),
        response_mask=torch.ones(2, 3, dtype=torch.bool),
        **fields,
    )


def test_a_call_that_needs_a_field_nobody_staged_names_it():
    worker = StandInWorker(actor_reads=("advantages", "old_log_probs"))
    with pytest.raises(ValueError, match="no batch is staged"):
        worker.call_staged("update_actor", {}, None, None, 1)
    worker.stage_batch(tiny_batch())
    with pytest.raises(ValueError, match=r"\['advantages', 'old_log_probs'\]"):
        worker.call_staged("update_actor", {}, None, None, 1)
    with pytest.raises(ValueError, match="PolicyBatch.ref_log_probs is not staged"):
        worker.staged_field("ref_log_probs")
    trainer = recorded_trainer(QUICKSTART, [])
    with pytest.raises(ValueError, match="PolicyBatch.old_log_probs is neither in the driver nor kept"):
        trainer.cluster.roles.stage(tiny_batch()).fetch("old_log_probs")


def test_overlong_filtering_sends_the_actor_a_loss_mask_without_the_truncated_samples():
    trainer = recorded_trainer(QUICKSTART, ["algorithm.overlong.filter_truncated=true"])
    samples, scores = samples_of(trainer.config, trainer.plan, seed=1)
    cut = torch.arange(len(samples)) % 3 == 0
    samples.finish_reasons = ["length" if c else "stop" for c in cut.tolist()]
    metrics = run_step_on(trainer, 1, samples, scores)
    [(_, actor)] = distinct_groups(trainer)
    assert sent(step_calls(actor, 0))["loss_mask"] == actor.dp_size  # once per DP part, to the actor's group
    assert metrics["actor/overlong_filtered"] == pytest.approx(cut.float().mean().item())
    kept_tokens = sum(len(ids) for ids, c in zip(samples.response_ids, cut.tolist()) if not c)
    assert metrics["actor/tokens"] == kept_tokens  # the update counted the uncut samples' tokens only
    unfiltered = recorded_trainer(QUICKSTART, [])
    metrics = run_step_on(unfiltered, 1, samples, scores)
    assert metrics["actor/tokens"] == sum(len(ids) for ids in samples.response_ids) > kept_tokens
    assert "actor/overlong_filtered" not in metrics
