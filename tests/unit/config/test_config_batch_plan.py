"""The batch plan: the arithmetic on several layouts, and the arithmetic shown when a rule breaks."""

import pytest

from megarl.config.batch_plan import batch_problems, plan_batches
from megarl.config.loader import build_config
from megarl.config.plan_table import format_plan
from megarl.config.problems import ConfigError


def config_of(data: dict):
    problems = []
    config = build_config(data, problems)
    assert problems == []
    return config


def test_sixty_prompts_twelve_samples_on_six_gpus():
    config = config_of(
        {
            "data": {"train_batch_size": 60},
            "rollout": {"n": 12, "tensor_model_parallel_size": 2},
            "actor": {"ppo_mini_batch_size": 60, "micro_batch_size_per_gpu": 4, "max_tokens_per_micro_batch": None},
            "placement": {"gpus_per_node": 6},
        }
    )
    plan = plan_batches(config)
    assert (plan.prompts_per_step, plan.samples_per_prompt, plan.samples_per_step) == (60, 12, 720)
    assert (plan.rollout_engines, plan.samples_per_engine) == (3, 240)
    actor = plan.actor
    assert (actor.tensor_parallel, actor.pipeline_parallel, actor.data_parallel) == (1, 1, 6)
    assert actor.update.mini_batch_samples == 720
    assert actor.update.samples_per_rank == 120
    assert actor.update.grad_accumulation_steps == 30
    assert actor.update.optimizer_steps_per_step == 1
    assert (actor.samples_per_rank, actor.forward_micro_batches) == (120, 30)
    assert plan.critic is None and plan.ref is None


def test_mini_batches_and_epochs_multiply_into_optimizer_steps():
    # 16 prompts × 8 samples on 8 GPUs, actor TP 2 × PP 2 (DP 2): 4 mini-batches of 4 prompts, 2 epochs.
    config = config_of(
        {
            "data": {"train_batch_size": 16},
            "rollout": {"n": 8, "tensor_model_parallel_size": 4},
            "actor": {
                "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                "ppo_mini_batch_size": 4,
                "ppo_epochs": 2,
                "micro_batch_size_per_gpu": 2,
                "max_tokens_per_micro_batch": None,
            },
            "placement": {"gpus_per_node": 8},
        }
    )
    plan = plan_batches(config)
    assert (plan.rollout_engines, plan.samples_per_engine) == (2, 64)
    update = plan.actor.update
    assert plan.actor.data_parallel == 2
    assert (update.mini_batch_samples, update.samples_per_rank, update.grad_accumulation_steps) == (32, 16, 8)
    assert (update.mini_batches_per_epoch, update.optimizer_steps_per_step) == (4, 8)
    assert plan.actor.samples_per_rank == 64


def test_split_placement_with_critic_and_reference():
    # 2 nodes × 4 GPUs; 2 for vLLM (TP 1), 6 train. Critic TP 2 (DP 3), reference TP 1 (DP 6).
    config = config_of(
        {
            "data": {"train_batch_size": 12},
            "rollout": {"n": 1},
            "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True},
            "actor": {"ppo_mini_batch_size": 6, "micro_batch_size_per_gpu": 1},
            "critic": {
                "enable": True,
                "parallel": {"tensor_model_parallel_size": 2},
                "ppo_mini_batch_size": 12,
                "micro_batch_size_per_gpu": 2,
                "max_tokens_per_micro_batch": None,
            },
            "ref": {"micro_batch_size_per_gpu": 2, "max_tokens_per_micro_batch": None},
            "placement": {"mode": "split", "nnodes": 2, "gpus_per_node": 4, "rollout_gpus": 2},
        }
    )
    plan = plan_batches(config)
    assert (plan.world_size, plan.train_gpus, plan.rollout_gpus) == (8, 6, 2)
    assert (plan.rollout_engines, plan.samples_per_engine) == (2, 6)
    assert (
        plan.actor.data_parallel,
        plan.actor.update.samples_per_rank,
        plan.actor.update.optimizer_steps_per_step,
    ) == (6, 1, 2)
    assert (
        plan.critic.data_parallel,
        plan.critic.update.samples_per_rank,
        plan.critic.update.grad_accumulation_steps,
    ) == (3, 4, 2)
    assert plan.ref.update is None
    assert (plan.ref.data_parallel, plan.ref.samples_per_rank, plan.ref.forward_micro_batches) == (6, 2, 1)


@pytest.mark.parametrize(
    "nnodes, per_node, rollout_gpus, straddles",
    [
        (1, 3, 2, False),  # GPUs 1–2 of the one node: TP 2 need not divide 3
        (2, 3, 2, False),  # GPUs 4–5: the second node
        (2, 3, 4, True),  # GPUs 2–5: engine 0 on GPUs 2 (node 0) and 3 (node 1)
        (2, 4, 4, False),  # the whole second node
    ],
)
def test_a_split_engine_must_not_straddle_nodes(nnodes, per_node, rollout_gpus, straddles):
    """Split placement: the rollout has the last GPUs, engine k GPUs first + k·TP ...; rollout TP 2."""
    config = config_of(
        {
            "data": {"train_batch_size": 4},
            "rollout": {"n": 2, "tensor_model_parallel_size": 2},
            "actor": {"ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 1},
            "placement": {"mode": "split", "nnodes": nnodes, "gpus_per_node": per_node, "rollout_gpus": rollout_gpus},
        }
    )
    problems = [p for p in batch_problems(config) if p.key == "rollout.tensor_model_parallel_size"]
    assert [p.why for p in problems] == (
        [
            "split engines must not straddle nodes: engine 0 would span GPUs 2–3 (the rollout has the last 4 of "
            "2 node(s) × 3 GPUs), across two nodes"
        ]
        if straddles
        else []
    )


def test_plan_is_derived_not_written_back():
    data = {
        "data": {"train_batch_size": 60},
        "rollout": {"n": 12, "tensor_model_parallel_size": 2},
        "actor": {"ppo_mini_batch_size": 60},
        "placement": {"gpus_per_node": 6},
    }
    config = config_of(data)
    before = repr(config)
    plan_batches(config)
    assert repr(config) == before


def test_broken_rule_shows_the_arithmetic():
    config = config_of(
        {
            "data": {"train_batch_size": 16},
            "rollout": {"n": 8},
            "actor": {"parallel": {"tensor_model_parallel_size": 2}, "ppo_mini_batch_size": 16},
            "placement": {"gpus_per_node": 6},
        }
    )
    with pytest.raises(ConfigError) as raised:
        plan_batches(config)
    problems = {problem.key: problem for problem in raised.value.problems}
    assert problems["data.train_batch_size"].why == (
        "16 prompts × 8 samples = 128 samples do not split evenly over 6 GPUs ÷ rollout TP 1 = 6 engines "
        "(128 ÷ 6 = 21.33)"
    )
    problem = problems["actor.ppo_mini_batch_size"]
    assert problem.why == (
        "16 prompts × 8 samples = 128 samples per mini-batch do not split over actor DP 3 "
        "(6 GPUs ÷ (TP 2 × PP 1)): 128 ÷ 3 = 42.67"
    )
    # No divisor of 16 prompts times 8 samples is a multiple of 3: no mini-batch size can fit.
    assert problem.fix == "change the actor layout or rollout.n so that the DP size divides the samples"


def test_fix_suggests_mini_batches_that_fit():
    config = config_of(
        {
            "data": {"train_batch_size": 12},
            "rollout": {"n": 1},
            "actor": {"ppo_mini_batch_size": 2, "micro_batch_size_per_gpu": 1},
            "placement": {"gpus_per_node": 4},
        }
    )
    with pytest.raises(ConfigError) as raised:
        plan_batches(config)
    [problem] = raised.value.problems
    assert problem.key == "actor.ppo_mini_batch_size"
    assert "2 prompts × 1 samples = 2 samples per mini-batch do not split over actor DP 4" in problem.why
    assert problem.fix.endswith(": 4, 12")


@pytest.mark.parametrize(
    "mini, epochs, kl_in_reward, correction, expected",
    [
        (16, 1, False, "none", ()),
        # The correction and the mismatch metrics read the old log-probs inside the loss: the update's own serve them.
        (16, 1, False, "sequence", ()),
        (8, 1, False, "none", ("2 mini-batches × 1 epoch",)),
        (16, 2, False, "none", ("1 mini-batch × 2 epochs",)),
        (16, 1, True, "none", ("algorithm.use_kl_in_reward reads them before the update",)),
        (4, 3, True, "none", ("4 mini-batches × 3 epochs", "algorithm.use_kl_in_reward reads them before the update")),
    ],
)
def test_old_log_probs_need_a_pass_only_when_the_batch_is_reused_or_read_first(
    mini, epochs, kl_in_reward, correction, expected
):
    config = config_of(
        {
            "data": {"train_batch_size": 16},
            "actor": {
                "ppo_mini_batch_size": mini,
                "ppo_epochs": epochs,
                "micro_batch_size_per_gpu": 2,
                "rollout_correction": {"level": correction},
            },
            "algorithm": {"use_kl_in_reward": kl_in_reward},
            "placement": {"gpus_per_node": 2},
        }
    )
    assert plan_batches(config).old_log_prob_pass == expected


def test_packed_micro_batches_leave_the_micro_batch_count_to_the_data():
    # 6 samples per rank: micro_batch_size_per_gpu 4 would not divide them, but with a token budget
    # it cuts nothing (packed micro-batches hold as many samples as their tokens allow).
    config = config_of(
        {
            "data": {"train_batch_size": 6, "max_prompt_length": 100},
            "rollout": {"n": 2, "max_new_tokens": 64},
            "actor": {"ppo_mini_batch_size": 6, "micro_batch_size_per_gpu": 4, "max_tokens_per_micro_batch": 512},
            "placement": {"gpus_per_node": 2},
        }
    )
    plan = plan_batches(config)
    assert plan.actor.max_tokens_per_micro_batch == 512
    assert plan.actor.forward_micro_batches is None and plan.actor.update.grad_accumulation_steps is None
    assert "≤512t" in format_plan(plan) and "by tok" in format_plan(plan)


def test_auto_packs_to_the_token_slots_of_a_padded_micro_batch_and_null_keeps_padding():
    # S = 100 + 64 tokens; micro-batches of 4 samples: auto packs ≤ 4 × 164 = 656 tokens. 6 samples per rank
    # would not split into padded micro-batches of 4, and need not.
    data = {
        "data": {"train_batch_size": 6, "max_prompt_length": 100},
        "rollout": {"n": 2, "max_new_tokens": 64},
        "actor": {"ppo_mini_batch_size": 6, "micro_batch_size_per_gpu": 4},
        "placement": {"gpus_per_node": 2},
    }
    plan = plan_batches(config_of(data))
    assert plan.actor.max_tokens_per_micro_batch == 656 and plan.actor.update.grad_accumulation_steps is None
    assert "≤656t" in format_plan(plan)
    data["actor"]["max_tokens_per_micro_batch"] = None
    [problem] = batch_problems(config_of(data))
    assert (problem.key, problem.value) == ("actor.micro_batch_size_per_gpu", 4)


def test_auto_packs_to_the_multi_turn_sample_bound():
    # Multi-turn: a sample's response is up to rollout.multi_turn.max_total_tokens, not max_new_tokens.
    data = {
        "data": {"train_batch_size": 4, "max_prompt_length": 100},
        "rollout": {"n": 2, "max_new_tokens": 64, "multi_turn": {"enable": True, "max_total_tokens": 300}},
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 2},
        "placement": {"gpus_per_node": 2},
    }
    assert plan_batches(config_of(data)).actor.max_tokens_per_micro_batch == 2 * (100 + 300)


@pytest.mark.parametrize(("prompt", "budget"), [(100, 4 * 164), (101, None)])
def test_auto_stays_padded_where_context_parallelism_cannot_cut_the_budget(prompt, budget):
    # CP 2 cuts a micro-batch into 2 × CP = 4 chunks: 4 samples × 164 tokens = 656 split into them, 2 × 165 = 330 do not.
    micro = 4 if budget else 2
    data = {
        "data": {"train_batch_size": 4, "max_prompt_length": prompt},
        "rollout": {"n": 2, "max_new_tokens": 64},
        "model": {"transformer_impl": "transformer_engine"},
        "actor": {
            "ppo_mini_batch_size": 4,
            "micro_batch_size_per_gpu": micro,
            "parallel": {"context_parallel_size": 2},
        },
        "placement": {"gpus_per_node": 2},
    }
    plan = plan_batches(config_of(data))
    assert plan.actor.max_tokens_per_micro_batch == budget
    assert (plan.actor.update.grad_accumulation_steps is None) == (budget is not None)


def test_a_token_budget_below_the_longest_sample_names_the_key_and_the_minimum():
    config = config_of(
        {
            "data": {"train_batch_size": 8, "max_prompt_length": 100},
            "rollout": {"n": 2, "max_new_tokens": 64},
            "actor": {"ppo_mini_batch_size": 8, "max_tokens_per_micro_batch": 150},
            "critic": {"enable": True, "ppo_mini_batch_size": 8, "max_tokens_per_micro_batch": 0},
            "placement": {"gpus_per_node": 2},
        }
    )
    problems = {problem.key: problem for problem in batch_problems(config)}
    actor = problems["actor.max_tokens_per_micro_batch"]
    assert actor.value == 150
    assert "164 tokens (data.max_prompt_length 100 + response 64)" in actor.why
    assert actor.fix == "set actor.max_tokens_per_micro_batch to 164 or more, or null for padded micro-batches"
    assert problems["critic.max_tokens_per_micro_batch"].why == "must be a positive integer"


def test_sequence_parallel_is_planned_per_role_and_shown():
    config = config_of(
        {
            "data": {"train_batch_size": 4},
            "actor": {
                "ppo_mini_batch_size": 4,
                "use_kl_loss": True,
                "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
            },
            "ref": {"micro_batch_size_per_gpu": 4, "parallel": {"tensor_model_parallel_size": 2}},
            "placement": {"gpus_per_node": 2},
        }
    )
    plan = plan_batches(config)
    assert plan.actor.sequence_parallel and not plan.ref.sequence_parallel
    assert "sequence parallel: actor (TP 2); micro-batch rows padded to a multiple of TP" in format_plan(plan)
    off = config_of(
        {
            "data": {"train_batch_size": 4},
            "actor": {"ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 2},
            "placement": {"gpus_per_node": 2},
        }
    )
    assert "sequence parallel" not in format_plan(plan_batches(off))


def test_virtual_pipeline_is_planned_and_a_role_of_another_vpp_gets_its_own_group():
    data = {
        "data": {"train_batch_size": 4},
        "actor": {
            "ppo_mini_batch_size": 4,
            "micro_batch_size_per_gpu": 2,
            "max_tokens_per_micro_batch": None,
            "use_kl_loss": True,
            "parallel": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
        },
        "ref": {"micro_batch_size_per_gpu": 2, "parallel": {"pipeline_model_parallel_size": 2}},
        "placement": {"gpus_per_node": 2},
    }
    plan = plan_batches(config_of(data))
    assert (plan.actor.virtual_pipeline, plan.ref.virtual_pipeline) == (2, 1)
    assert plan.actor.update.grad_accumulation_steps == 2 and not plan.actor.own_group
    assert plan.ref.own_group, "megatron keeps one virtual pipeline size per process"
    shown = format_plan(plan)
    assert "virtual pipeline: actor (PP 2 × VPP 2: 4 chunks); megatron's interleaved 1F1B schedule" in shown
    assert "ref in a group of its own" in shown and "its layout differs from the actor's" in shown
    data["ref"]["parallel"]["virtual_pipeline_model_parallel_size"] = 2
    assert not plan_batches(config_of(data)).ref.own_group


def test_a_forward_token_budget_packs_only_the_forward_pass():
    data = {
        "data": {"train_batch_size": 6, "max_prompt_length": 100},
        "rollout": {"n": 2, "max_new_tokens": 64},
        "actor": {
            "ppo_mini_batch_size": 6,
            "micro_batch_size_per_gpu": 2,
            "max_tokens_per_micro_batch": None,
            "forward_max_tokens_per_micro_batch": 1024,
        },
        "placement": {"gpus_per_node": 2},
    }
    plan = plan_batches(config_of(data))
    assert plan.actor.forward_micro_batches is None and plan.actor.update.grad_accumulation_steps == 3
    assert plan.actor.max_tokens_per_micro_batch is None
    data["actor"]["forward_max_tokens_per_micro_batch"] = 100
    [problem] = batch_problems(config_of(data))
    assert (problem.key, problem.value) == ("actor.forward_max_tokens_per_micro_batch", 100)
    assert "a sample may have 164 tokens" in problem.why and "or null for the update's cut" in problem.fix
    data["actor"]["forward_max_tokens_per_micro_batch"] = 0
    [problem] = batch_problems(config_of(data))
    assert problem.key == "actor.forward_max_tokens_per_micro_batch" and "positive integer" in problem.why


def test_expert_layout_is_planned_shown_and_a_reference_with_another_one_runs_apart():
    experts = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}
    data = {
        "data": {"train_batch_size": 4},
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size_per_gpu": 2, "use_kl_loss": True, "parallel": experts},
        "ref": {"micro_batch_size_per_gpu": 2, "parallel": {"tensor_model_parallel_size": 2}},
        "placement": {"gpus_per_node": 4},
    }
    plan = plan_batches(config_of(data))
    assert plan.actor.grid == (2, 1, 1, 2, 1, 1) and plan.ref.grid == (2, 1, 1, 1, 2, 1)
    assert plan.ref.own_group, "megatron keeps one grid per process: another expert layout needs other processes"
    assert "experts: actor (expert TP 1 × EP 2 × expert DP 2) per pipeline stage" in format_plan(plan)
    same = config_of({**data, "ref": {"micro_batch_size_per_gpu": 2, "parallel": experts}})
    assert not plan_batches(same).ref.own_group
