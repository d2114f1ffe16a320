"""Which Megatron roles get worker groups of their own, what each group hosts, and how calls are routed."""

from pathlib import Path

import pytest
import torch
from recorded_transfers import RecordingWorkers, old_log_probs_of, ref_log_probs_of

from megarl.cluster.ray_node import device_bundles
from megarl.cluster.roles import MegatronGroup, Roles, worker_specs
from megarl.config.batch_plan import plan_batches
from megarl.config.loader import load_config
from megarl.config.plan_table import format_plan
from megarl.workers.batch import PolicyBatch
from megarl.workers.checkpoint_files import part_dir, step_dir_name
from megarl.workers.packing import TokenBudget

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
# The quickstart's actor: TP 2 × PP 1 on 2 device slots, colocated with the engines.
BASE = ["prompts", "prompt_mask", "responses", "response_mask"]
KL = ("actor.use_kl_loss=true",)
CRITIC = ("critic.enable=true", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=16")


def plan_of(*overrides: str):
    config = load_config(QUICKSTART, list(overrides))
    return config, plan_batches(config)


@pytest.mark.parametrize(
    ("overrides", "own"),
    [
        (
            KL + CRITIC + ("ref.parallel.tensor_model_parallel_size=2", "critic.parallel.tensor_model_parallel_size=2"),
            [],
        ),
        (KL + ("ref.parallel.tensor_model_parallel_size=1",), ["ref"]),
        (KL + ("ref.parallel.tensor_model_parallel_size=2", "ref.colocate_with_actor=false"), ["ref"]),
        (
            CRITIC + ("critic.parallel.tensor_model_parallel_size=1", "critic.parallel.pipeline_model_parallel_size=2"),
            ["critic"],
        ),
        (KL + CRITIC + ("ref.parallel.tensor_model_parallel_size=1",), ["critic", "ref"]),
    ],
)
def test_a_role_gets_its_own_group_when_its_layout_differs_or_ref_is_not_colocated(overrides, own):
    config, plan = plan_of(*overrides)
    assert [role.role for role in plan.own_groups] == own
    specs = worker_specs(config, plan, total_steps=10)
    assert list(specs) == ["policy", *own]
    policy = specs["policy"]
    assert (policy.tp, policy.pp) == (2, 1) and policy.actor is not None
    assert policy.use_reference == (plan.ref is not None and "ref" not in own)
    assert (policy.critic is not None) == (plan.critic is not None and "critic" not in own)
    for name in own:
        spec, role = specs[name], getattr(plan, name)
        assert spec.actor is None and spec.reward_model_path is None
        assert (spec.tp, spec.pp) == (role.tensor_parallel, role.pipeline_parallel)
        assert spec.use_reference == (name == "ref") and (spec.critic is not None) == (name == "critic")
    # Every process on a device slot has a CPU there: the actor's, each own group's, the engine's.
    assert device_bundles(plan) == (2, 2 + len(own))


def test_token_budgets_reach_the_workers_and_none_keeps_padded_micro_batches():
    config, plan = plan_of(
        *KL,
        *CRITIC,
        "actor.max_tokens_per_micro_batch=64",
        "ref.max_tokens_per_micro_batch=40",
        "critic.max_tokens_per_micro_batch=null",
    )
    specs = worker_specs(config, plan, total_steps=10)
    policy = specs["policy"]
    assert policy.actor.micro_batch_size == TokenBudget(64, "actor.max_tokens_per_micro_batch")
    assert policy.ref_micro_batch == TokenBudget(40, "ref.max_tokens_per_micro_batch")
    # The critic (null) keeps padded micro-batches; the reward model always does.
    assert specs["critic"].critic.micro_batch_size == config.critic.micro_batch_size_per_gpu
    assert policy.ref_micro_batch_size == config.ref.micro_batch_size_per_gpu


def test_sequence_parallel_reaches_each_role_that_sets_it():
    config, plan = plan_of(
        *KL,
        *CRITIC,
        "actor.parallel.sequence_parallel=true",
        "critic.parallel.tensor_model_parallel_size=2",
        "critic.parallel.sequence_parallel=true",
        "ref.parallel.tensor_model_parallel_size=2",
    )
    policy = worker_specs(config, plan, total_steps=10)["policy"]
    assert policy.actor.section.parallel.sequence_parallel and policy.critic.section.parallel.sequence_parallel
    assert not policy.ref_sequence_parallel
    config, plan = plan_of(
        *KL,
        "ref.parallel.tensor_model_parallel_size=2",
        "ref.colocate_with_actor=false",
        "ref.parallel.sequence_parallel=true",
    )
    specs = worker_specs(config, plan, total_steps=10)
    assert specs["ref"].ref_sequence_parallel and not specs["policy"].actor.section.parallel.sequence_parallel


def test_router_replay_reaches_the_actor_and_the_reference_in_either_group():
    for own_group in (False, True):
        config, plan = plan_of(*KL, "actor.moe.router_replay=true", f"ref.colocate_with_actor={not own_group}")
        specs = worker_specs(config, plan, total_steps=10)
        assert specs["policy"].actor.section.moe.router_replay
        assert specs["ref" if own_group else "policy"].ref_router_replay
    config, plan = plan_of(*KL)
    assert not worker_specs(config, plan, total_steps=10)["policy"].ref_router_replay


def test_the_default_cut_packs_the_token_slots_of_a_padded_micro_batch_and_null_pads():
    from megarl.cluster.roles import packs_by_tokens

    # The quickstart: 32 samples per micro-batch of 32 prompt + 2 response tokens.
    config, plan = plan_of(*KL)
    policy = worker_specs(config, plan, total_steps=10)["policy"]
    assert policy.actor.micro_batch_size == TokenBudget(32 * 34, "actor.max_tokens_per_micro_batch")
    assert policy.actor.forward_micro_batch == policy.actor.micro_batch_size  # the forward pass follows the update
    assert policy.ref_micro_batch == TokenBudget(8 * 34, "ref.max_tokens_per_micro_batch")
    assert packs_by_tokens(config.actor, config) and packs_by_tokens(config.ref, config)
    config, plan = plan_of(*KL, "actor.max_tokens_per_micro_batch=null", "ref.max_tokens_per_micro_batch=null")
    policy = worker_specs(config, plan, total_steps=10)["policy"]
    assert (policy.actor.micro_batch_size, policy.actor.forward_micro_batch, policy.ref_micro_batch) == (32, 32, 8)
    assert not packs_by_tokens(config.actor, config) and not packs_by_tokens(config.ref, config)


def test_forward_token_budgets_reach_the_forward_passes_only():
    from types import SimpleNamespace

    from megarl.cluster.roles import packs_by_tokens
    from megarl.workers.policy_worker import PolicyWorker

    config, plan = plan_of(
        *CRITIC,
        "critic.parallel.tensor_model_parallel_size=2",
        "actor.max_tokens_per_micro_batch=null",
        "ref.max_tokens_per_micro_batch=null",
        "actor.forward_max_tokens_per_micro_batch=4096",
        "critic.forward_max_tokens_per_micro_batch=2048",
    )
    policy = worker_specs(config, plan, total_steps=10)["policy"]
    assert policy.actor.forward_micro_batch == TokenBudget(4096, "actor.forward_max_tokens_per_micro_batch")
    assert policy.critic.forward_micro_batch == TokenBudget(2048, "critic.forward_max_tokens_per_micro_batch")
    assert policy.actor.micro_batch_size == config.actor.micro_batch_size_per_gpu  # the update keeps its cut
    assert packs_by_tokens(config.actor, config) and not packs_by_tokens(config.ref, config)
    # The worker's forward passes take the forward cut (its update the update's: `update_actor`).
    seen = []

    def record(name):
        return lambda batch, *, micro_batch_size: seen.append((name, micro_batch_size))

    worker = SimpleNamespace(
        spec=policy,
        actor=SimpleNamespace(compute_log_prob=record("log_prob")),
        critic=SimpleNamespace(compute_values=record("values")),
    )
    PolicyWorker.compute_log_prob(worker, None)
    PolicyWorker.compute_values(worker, None)
    assert seen == [("log_prob", policy.actor.forward_micro_batch), ("values", policy.critic.forward_micro_batch)]
    # Unset: the forward pass cuts as the update does.
    config, plan = plan_of(
        *CRITIC, "critic.parallel.tensor_model_parallel_size=2", "actor.max_tokens_per_micro_batch=64"
    )
    policy = worker_specs(config, plan, total_steps=10)["policy"]
    assert (
        policy.actor.forward_micro_batch
        == policy.actor.micro_batch_size
        == TokenBudget(64, "actor.max_tokens_per_micro_batch")
    )
    assert policy.critic.forward_micro_batch == policy.critic.micro_batch_size


def test_split_placement_counts_only_the_megatron_processes_per_training_slot():
    _config, plan = plan_of(
        *KL,
        "ref.colocate_with_actor=false",
        "placement.mode=split",
        "placement.gpus_per_node=3",
        "placement.rollout_gpus=1",
    )
    assert device_bundles(plan) == (3, 2) and plan.processes_per_train_gpu == 2


def test_the_printed_plan_states_the_processes_of_each_role():
    _, plan = plan_of(
        *KL, *CRITIC, "ref.parallel.tensor_model_parallel_size=1", "critic.parallel.tensor_model_parallel_size=2"
    )
    lines = format_plan(plan).splitlines()
    assert "processes: actor, critic in the actor's group (2 processes, one per training GPU)" in lines
    assert (
        "           ref in a group of its own (2 processes on the same GPUs, TP 1 × PP 1 × DP 2: "
        "its layout differs from the actor's)"
    ) in lines
    assert "           3 processes per training GPU: 2 Megatron, 1 rollout engine" in lines


def grids(tp: int, dp: int) -> list[dict[str, int]]:
    return [dict(rank=r, tp_rank=r % tp, pp_rank=0, dp_rank=r // tp, dp_size=dp) for r in range(tp * dp)]


def batch_of(responses: torch.Tensor, response_mask: torch.Tensor) -> PolicyBatch:
    rows = len(responses)
    return PolicyBatch(
        prompts=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
        responses=responses,
        response_mask=response_mask,
    )


def staged_rows(group: MegatronGroup) -> list[list[int]]:
    """The first response token of each row each DP replica's leader holds."""
    return [
        rank.staged.responses[:, 0].tolist() for rank, g in zip(group.workers.ranks, group.grids) if g["tp_rank"] == 0
    ]


def test_calls_go_to_their_roles_group_and_are_scattered_by_its_dp_size():
    actor = MegatronGroup(RecordingWorkers(2, actor_reads=()), grids(tp=2, dp=1))
    ref = MegatronGroup(RecordingWorkers(2, actor_reads=()), grids(tp=1, dp=2))
    roles = Roles({"actor": actor, "ref": ref}, rollout=None, placement=None, sync_transport="collective", routes=None)
    rows = torch.arange(8)
    staged = roles.stage(batch_of(rows[:, None], torch.ones(8, 1, dtype=torch.bool)))
    assert torch.equal(staged.gather("compute_ref_log_prob"), ref_log_probs_of(staged.batch))
    assert torch.equal(staged.gather("compute_log_prob", output=0), old_log_probs_of(staged.batch))
    assert staged_rows(ref) == [[0, 1, 2, 3], [4, 5, 6, 7]] and staged_rows(actor) == [list(range(8))]
    # Only each DP replica's leader sends its rows back; the TP 2 ranks of the actor read one stored batch.
    assert [c.method for c in actor.workers.calls] == ["stage_batch", "call_staged:compute_log_prob"]
    assert actor.workers.calls[1].replies == 1 and ref.workers.calls[1].replies == 2
    assert actor.workers.calls[0].fields_sent == list(BASE)
    assert roles.own_groups == {"ref": ref}


def test_a_packed_role_gets_rows_balanced_by_tokens_and_returns_them_in_order():
    ref = MegatronGroup(RecordingWorkers(2, actor_reads=()), grids(tp=1, dp=2))
    roles = Roles(
        {"actor": ref, "ref": ref},
        rollout=None,
        placement=None,
        sync_transport="collective",
        routes=None,
        packed_roles=frozenset({"ref"}),
    )
    # Rows 0-3 are long (8 response tokens), rows 4-7 short (1): consecutive blocks would give one rank all
    # the long ones.
    rows = torch.arange(8)
    lengths = torch.tensor([8, 8, 8, 8, 1, 1, 1, 1])
    batch = batch_of(rows[:, None].expand(8, 8).clone(), torch.arange(8)[None, :] < lengths[:, None])
    staged = roles.stage(batch)
    assert torch.equal(staged.gather("compute_ref_log_prob"), ref_log_probs_of(batch))
    assert staged_rows(ref) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_engines_started_before_a_failed_start_up_run_their_own_shutdown(monkeypatch):
    """A start-up that fails after the engines started (the weight sync's connection, the transport's
    placement check) has no `Roles` for `Trainer.fit` to shut down: the engines' own clean-up must still
    run (a TP > 1 engine's workers hold /dev/shm segments that a kill leaves behind, issue 36)."""
    from types import SimpleNamespace

    from megarl.cluster import roles
    from megarl.cluster.timing import STARTUP_PHASES, PhaseTimer

    config, plan = plan_of()
    calls = []
    engines = SimpleNamespace(shutdown=lambda timeout_s: calls.append(("engines.shutdown", timeout_s)))
    monkeypatch.setattr(roles, "create_placement_group", lambda *args: "pg")
    monkeypatch.setattr(
        roles.MegatronGroup,
        "start",
        staticmethod(
            lambda name, *args, **kwargs: SimpleNamespace(
                workers=SimpleNamespace(node_ids=lambda: ["node"] * 2), grids=grids(2, 1)
            )
        ),
    )
    monkeypatch.setattr(roles, "offload_before_engines", lambda *args: None)
    monkeypatch.setattr(roles, "start_rollout", lambda *args: engines)

    def no_connection(*args):
        raise RuntimeError("the sync group did not form")

    monkeypatch.setattr(roles, "_connect", no_connection)
    with pytest.raises(RuntimeError, match="the sync group did not form"):
        roles.start_roles(config, plan, 2, {}, "cpu", PhaseTimer(phases=STARTUP_PHASES))
    assert calls == [("engines.shutdown", roles.ENGINE_SHUTDOWN_TIMEOUT_S)]


class CallLog:
    """A group's workers that record each `call_all` in one log shared by the groups."""

    def __init__(self, name: str, log: list, answer=None):
        self.name, self.log, self.answer = name, log, answer

    def call_all(self, method: str, *args) -> list:
        self.log.append((self.name, method, *args))
        return [self.answer]


def test_a_critic_of_its_own_saves_its_part_before_the_step_commits_and_loads_it_on_resume(tmp_path):
    """(The trainer's side of the critic's resume; the critic's restored state repeating its next update
    exactly is tests/distributed/workers/test_megatron_workers.py's.)"""
    log = []
    actor = MegatronGroup(CallLog("policy", log, answer={"step": 3}), grids(tp=2, dp=1))
    critic = MegatronGroup(CallLog("critic", log), grids(tp=1, dp=1))
    ref = MegatronGroup(CallLog("ref", log), grids(tp=1, dp=2))
    roles = Roles(
        {"actor": actor, "critic": critic, "ref": ref},
        rollout=None,
        placement=None,
        sync_transport="collective",
        routes=None,
    )
    root, extra = str(tmp_path / "checkpoints"), {"step": 3}
    roles.save_checkpoint(root, 3, extra)
    step_dir = tmp_path / "checkpoints" / step_dir_name(3)
    # The part first: a complete step dir implies complete parts. The frozen reference has no state to save.
    assert log == [
        ("critic", "save_checkpoint", str(part_dir(step_dir, "critic").parent), 3, extra),
        ("policy", "save_checkpoint", root, 3, extra),
    ]
    log.clear()
    assert roles.load_checkpoint(str(step_dir)) == {"step": 3}
    assert log == [
        ("critic", "load_checkpoint", str(part_dir(step_dir, "critic"))),
        ("policy", "load_checkpoint", str(step_dir)),
    ]
