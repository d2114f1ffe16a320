"""Worker settings reject bad values with messages that name them, and map onto megatron's fields."""

import pytest

from megarl.config.roles import OptimizerConfig, RecomputeConfig
from megarl.workers.megatron_train import check_divides, lr_decay_end, recompute_transformer_fields


def test_the_lr_decay_ends_past_the_warm_up_and_only_a_constant_lr_goes_without_its_end():
    with pytest.raises(ValueError, match="lr_decay_style='linear' needs lr_decay_steps"):
        lr_decay_end(OptimizerConfig(lr_decay_style="linear"), None)
    cosine = OptimizerConfig(lr_warmup_steps=2, lr_decay_style="cosine")
    assert lr_decay_end(cosine, 10) == 10
    # megatron's scheduler wants the end past the warm-up, also when the run ends inside it.
    assert lr_decay_end(cosine, 2) == 3
    assert lr_decay_end(OptimizerConfig(lr_warmup_steps=4), None) == 5


def test_optimizer_cpu_offload_maps_onto_megatrons_hybrid_optimizer_fields():
    from types import SimpleNamespace

    import torch

    from megarl.parallel import cpu_runtime
    from megarl.workers.megatron_train import megatron_optimizer_config

    cpu_runtime.install()  # as every process that builds megatron's optimizer has it (no Transformer Engine here)
    model = SimpleNamespace(bf16=True, params_dtype=torch.bfloat16)
    config = megatron_optimizer_config(
        OptimizerConfig(use_distributed_optimizer=True, cpu_offload=True, cpu_offload_fraction=0.5), model
    )
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction) == (True, 0.5)
    # Megatron-LM's arguments pair the offload with the precision-aware optimizer; megarl does the same.
    assert config.use_precision_aware_optimizer and config.use_distributed_optimizer
    off = megatron_optimizer_config(OptimizerConfig(use_distributed_optimizer=True), model)
    assert (off.optimizer_cpu_offload, off.optimizer_offload_fraction, off.use_precision_aware_optimizer) == (
        False,
        0.0,
        False,
    )


def test_a_recompute_section_becomes_transformer_config_fields():
    assert recompute_transformer_fields(RecomputeConfig()) == {}
    assert recompute_transformer_fields(RecomputeConfig("full", "block", 2)) == dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2
    )
    # selective: the attention core, the part the memory estimate drops for it.
    assert recompute_transformer_fields(RecomputeConfig("selective")) == dict(
        recompute_granularity="selective", recompute_modules=["core_attn"]
    )
    # full without num_layers is the config's error (naming actor.recompute.num_layers): the catalogue's
    # recompute-full-without-layers.


def test_check_divides_names_the_setting():
    check_divides(8, 4, "micro_batch_size", "mini_batch_size")
    with pytest.raises(ValueError, match=r"micro_batch_size=3 must divide the 8 mini_batch_size \(8 % 3 != 0\)"):
        check_divides(8, 3, "micro_batch_size", "mini_batch_size")


def test_the_policy_loss_reads_the_actor_section_and_checks_it_before_training():
    from megarl.algorithms.rollout_correction import RolloutCorrection
    from megarl.config.roles import ActorConfig, RolloutCorrectionConfig
    from megarl.workers.actor import PolicyLoss

    with pytest.raises(ValueError, match="actor.policy_loss='ppo' is not one of"):
        PolicyLoss(ActorConfig(policy_loss="ppo"))
    with pytest.raises(ValueError, match="actor.loss_agg_mode='mean' is not one of"):
        PolicyLoss(ActorConfig(loss_agg_mode="mean"))
    kl_and_correction = ActorConfig(
        use_kl_loss=True, kl_loss_coef=0.1, rollout_correction=RolloutCorrectionConfig(level="token")
    )
    loss = PolicyLoss(kl_and_correction)
    assert loss.required_fields == ("advantages", "rollout_log_probs", "ref_log_probs")
    assert loss.correction == RolloutCorrection(level="token", mode="truncate", low=0.0, high=2.0)
    assert PolicyLoss(ActorConfig(), report_mismatch=True).required_fields == ("advantages", "rollout_log_probs")
    assert PolicyLoss(ActorConfig()).required_fields == ("advantages",)
    # The KL loss weighs nothing without use_kl_loss (kl_loss_coef's default 0.001 is then unused).
    assert (PolicyLoss(ActorConfig()).kl_loss_coef, PolicyLoss(ActorConfig()).correction) == (0.0, None)
