"""The per-GPU memory estimate on the real-model recipes (pure arithmetic, no download)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.config.memory import (
    GIB,
    estimate_memory,
    rank_parameters,
    resident_during_rollout,
    rollout_budget_problems,
    state_bytes,
    total_parameters,
)
from megarl.config.memory_table import memory_report
from megarl.config.model_facts import load_model_dims
from megarl.config.roles import ParallelConfig
from megarl.config.validate import validate
from megarl.models.hf_config import read_model_dims

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LLAMA_70B = read_model_dims(
    dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
)
"""Llama-3.1-70B's published config.json."""


def _recipe(name: str, *overrides: str):
    return load_config(CONFIGS / name, list(overrides))


def test_qwen2_5_7b_parameter_count_is_the_published_one():
    # Qwen2.5-7B: 7.61 B parameters (model card).
    assert total_parameters(load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]) == pytest.approx(7.61e9, rel=0.01)


def test_llama_70b_parameter_count_is_the_published_one():
    assert total_parameters(LLAMA_70B) == pytest.approx(70.6e9, rel=0.01)


def test_7b_recipe_with_tp2_fits_on_80_gb():
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    estimate = estimate_memory(config, load_model_dims(config.model.path)[0], train_gpus=8)
    assert estimate.fits, memory_report(config, 80)[0]
    actor = estimate.roles[0]
    # bf16 weights: 2 bytes per parameter of a TP-2 shard (half the layers' weights, half the vocabulary).
    assert actor.parameters == pytest.approx(7.61e9 / 2 * 2, rel=0.02)


def test_70b_with_tp1_does_not_fit_on_80_gb():
    config = _recipe(
        "grpo_qwen2.5-7b_gsm8k.yaml",
        "actor.parallel.tensor_model_parallel_size=1",
        "ref.parallel.tensor_model_parallel_size=1",
    )
    estimate = estimate_memory(config, LLAMA_70B, train_gpus=8)
    assert not estimate.fits
    assert estimate.roles[0].parameters > 80 * GIB  # the bf16 weights alone exceed the GPU


def test_70b_fits_with_enough_model_parallelism_and_offload():
    config = _recipe(
        "grpo_qwen2.5-7b_gsm8k.yaml",
        "actor.parallel.tensor_model_parallel_size=8",
        "actor.parallel.pipeline_model_parallel_size=4",
        "ref.parallel.tensor_model_parallel_size=8",
        "ref.parallel.pipeline_model_parallel_size=4",
        "placement.nnodes=4",
        "ref.offload_params=true",
        "actor.offload.params=true",
        "rollout.gpu_memory_utilization=0.5",
    )
    assert estimate_memory(config, LLAMA_70B, train_gpus=32).fits


def test_distributed_optimizer_divides_only_the_optimizer_state_by_dp():
    shape = load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]
    tp2 = ParallelConfig(tensor_model_parallel_size=2)
    single = state_bytes(shape, tp2, 1, "bfloat16", distributed_optimizer=True, trained=True)
    sharded = state_bytes(shape, tp2, 4, "bfloat16", distributed_optimizer=True, trained=True)
    assert sharded[:2] == single[:2]
    assert sharded[2] == pytest.approx(single[2] / 4, abs=1)
    # bf16: fp32 main copy + two fp32 moments = 12 bytes per parameter, params 2 bytes.
    assert single[2] == 6 * single[0]


def test_optimizer_cpu_offload_leaves_the_rest_of_the_optimizer_state_on_the_gpu():
    full = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    shape = load_model_dims(full.model.path)[0]

    def offloaded(fraction):
        optim = dataclasses.replace(full.actor.optim, cpu_offload=True, cpu_offload_fraction=fraction)
        offload = dataclasses.replace(full.actor.offload, optimizer=False)  # validate refuses both
        return dataclasses.replace(full, actor=dataclasses.replace(full.actor, optim=optim, offload=offload))

    base = estimate_memory(full, shape, train_gpus=8)
    actor = base.roles[0]
    for fraction in (1.0, 0.25):
        estimate = estimate_memory(offloaded(fraction), shape, train_gpus=8)
        moved = estimate.roles[0]
        assert moved.optimizer == pytest.approx(actor.optimizer * (1 - fraction), abs=1)
        assert (moved.parameters, moved.gradients, moved.activations) == (
            actor.parameters,
            actor.gradients,
            actor.activations,
        )
        assert f"actor.optim.cpu_offload: {fraction:.0%} of the optimizer state in host memory" in estimate.runs


def test_recompute_shrinks_activations():
    full = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    none = dataclasses.replace(
        full,
        actor=dataclasses.replace(
            full.actor, recompute=dataclasses.replace(full.actor.recompute, granularity="none", num_layers=None)
        ),
    )
    shape = load_model_dims(full.model.path)[0]
    with_recompute = estimate_memory(full, shape, train_gpus=8).roles[0].activations
    without = estimate_memory(none, shape, train_gpus=8).roles[0].activations
    assert with_recompute < without / 2


def test_interleaved_schedule_keeps_more_activations_and_the_same_state():
    """PP 4 × VPP 2: the first stage keeps L · (1 + 3/8) layers' activations instead of L (megatron's warm-up of
    2(PP - 1) + (VPP - 1) PP chunk passes); parameters, gradients and optimizer are those of PP 4."""
    shape = load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")

    def actor_at(vpp):
        parallel = ParallelConfig(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=vpp
        )
        recompute = dataclasses.replace(config.actor.recompute, granularity="none", num_layers=None)
        actor = dataclasses.replace(config.actor, parallel=parallel, recompute=recompute)
        return estimate_memory(dataclasses.replace(config, actor=actor), shape, train_gpus=8).roles[0]

    off, on = actor_at(None), actor_at(2)
    assert on.activations == pytest.approx(off.activations * 11 / 8, rel=1e-6)
    assert (on.parameters, on.gradients, on.optimizer) == (off.parameters, off.gradients, off.optimizer)


def test_validate_prints_the_estimate(capsys):
    from megarl.cli.main import main

    assert main(["validate", str(CONFIGS / "grpo_qwen2.5-7b_gsm8k.yaml"), "--no-file-checks"]) == 0
    out = capsys.readouterr().out
    assert "# memory estimate" in out and "of 80 GiB: fits" not in out  # the verdict states the margin
    [verdict] = [line for line in out.splitlines() if line.startswith("peak ")]
    assert verdict.endswith("(keeps 2): fits") and "+ 2.0 GiB of CUDA contexts and NCCL buffers" in verdict
    assert "warning: the memory estimate" not in out
    # On 40 GiB, with the grad buffer kept on the GPU, the engines' 0.6 cannot be free beside the actor and
    # reference: refused, naming what fits.
    assert (
        main(
            [
                "validate",
                "--no-file-checks",
                "--gpu-memory-gib",
                "40",
                str(CONFIGS / "grpo_qwen2.5-7b_gsm8k.yaml"),
                "actor.offload.grads=false",
            ]
        )
        == 2
    )
    assert "rollout.gpu_memory_utilization = 0.6" in capsys.readouterr().err
    assert (
        main(
            [
                "validate",
                "--no-file-checks",
                "--gpu-memory-gib",
                "40",
                str(CONFIGS / "grpo_qwen2.5-7b_gsm8k.yaml"),
                "rollout.gpu_memory_utilization=0.25",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "(keeps 2): does not fit" in out
    assert "warning: the memory estimate above does not fit a 40 GiB GPU" in out
    assert out.rstrip().endswith("grpo_qwen2.5-7b_gsm8k.yaml: OK, but see the memory warning above")


def test_the_engines_budget_must_fit_beside_what_megatron_keeps_resident():
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml", "rollout.gpu_memory_utilization=0.9")
    estimate = estimate_memory(config, load_model_dims(config.model.path)[0], train_gpus=8)
    resident = resident_during_rollout(config, estimate.roles)
    most = int((80 * GIB - resident) / (80 * GIB) * 100) / 100
    (problem,) = rollout_budget_problems(config, 80)
    assert problem.key == "rollout.gpu_memory_utilization" and f"use at most {most:.2f}" in problem.fix
    assert not rollout_budget_problems(
        _recipe("grpo_qwen2.5-7b_gsm8k.yaml", f"rollout.gpu_memory_utilization={most}"), 80
    )
    # Offloading the parameters and gradients too leaves room for more.
    offloaded = _recipe(
        "grpo_qwen2.5-7b_gsm8k.yaml",
        "rollout.gpu_memory_utilization=0.9",
        "actor.offload.params=true",
        "actor.offload.grads=true",
        "ref.offload_params=true",
    )
    assert not rollout_budget_problems(offloaded, 80)
    # Engines on GPUs of their own take what they are given.
    split = _recipe(
        "grpo_qwen2.5-7b_gsm8k.yaml",
        "rollout.gpu_memory_utilization=0.9",
        "placement.mode=split",
        "placement.rollout_gpus=4",
    )
    assert not rollout_budget_problems(split, 80)


@pytest.mark.parametrize("dtype, param_bytes, optimizer_bytes", [("float32", 4, 8), ("bfloat16", 2, 12)])
def test_gradients_are_fp32_and_the_main_copy_exists_only_for_bf16(dtype, param_bytes, optimizer_bytes):
    """What megatron_train runs: DDP's grad buffer in fp32 (grad_reduce_in_fp32) whatever the
    parameter dtype; Adam's fp32 moments, plus fp32 main parameters for bf16 ones."""
    shape = load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]
    params = rank_parameters(shape, 2, 1)
    got = state_bytes(
        shape, ParallelConfig(tensor_model_parallel_size=2), 4, dtype, distributed_optimizer=False, trained=True
    )
    assert got == (params * param_bytes, params * 4, params * optimizer_bytes)


def test_optimizer_offload_frees_memory_only_with_bf16_parameters():
    """With fp32 parameters megatron's optimizer updates the model's own: nothing separate moves."""
    peaks = {}
    for dtype in ("bfloat16", "float32"):
        for offload in ("true", "false"):
            config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml", f"model.dtype={dtype}", f"actor.offload.optimizer={offload}")
            estimate = estimate_memory(config, load_model_dims(config.model.path)[0], train_gpus=8, gpu_memory_gib=200)
            peaks[dtype, offload] = estimate.peak_bytes, estimate.peak_phase
    assert peaks["bfloat16", "true"][0] < peaks["bfloat16", "false"][0]
    assert peaks["float32", "true"] == peaks["float32", "false"]


def test_report_says_what_runs():
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml", "rollout.gpu_memory_utilization=0.5")
    report, _ = memory_report(config, 80)
    assert "precision: bfloat16 parameters, fp32 main grads, fp32 main parameters + Adam moments" in report
    assert "offload during rollout: actor.offload.grads, actor.offload.optimizer" in report
    assert "vLLM takes gpu_memory_utilization 0.5 of each shared GPU (40.0 GiB)" in report
    fp32, _ = memory_report(_recipe("grpo_qwen2.5-7b_gsm8k.yaml", "model.dtype=float32"), 80)
    assert "precision: fp32 parameters, grads and Adam moments, no main copy" in fp32
    assert "offload during rollout: actor.offload.grads\n" in fp32  # offload.optimizer has nothing to move in fp32


def test_a_packed_micro_batch_is_sized_as_the_rows_its_budget_holds():
    """max_tokens_per_micro_batch = 3 rows of S: the activations of 3 padded samples, whatever
    micro_batch_size_per_gpu says."""
    from megarl.config.loader import build_config

    def actor_activations(actor: dict) -> int:
        problems = []
        config = build_config(
            {"data": {"max_prompt_length": 100}, "rollout": {"max_new_tokens": 28}, "actor": actor}, problems
        )
        assert problems == []
        shape = read_model_dims(
            dict(
                model_type="llama",
                vocab_size=100,
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                rms_norm_eps=1e-6,
                rope_theta=10000.0,
            )
        )
        [actor_memory, *_] = estimate_memory(config, shape, train_gpus=1).roles
        return actor_memory.activations

    padded = actor_activations({"micro_batch_size_per_gpu": 3, "max_tokens_per_micro_batch": None})
    assert actor_activations({"micro_batch_size_per_gpu": 8, "max_tokens_per_micro_batch": 3 * 128 + 5}) == padded
    # The default ("auto": the token slots of a padded micro-batch) costs what the padded one does.
    assert actor_activations({"micro_batch_size_per_gpu": 3}) == padded
    assert actor_activations({"micro_batch_size_per_gpu": 4}) > padded


def test_the_7b_recipe_keeps_its_margin_and_would_not_without_the_grads_offload():
    """Issue 32, item 1: after the update and before the KV-cache wake the 7B recipe's GPUs must not be
    full. Its rollout phase (vLLM's 48 GiB beside what the actor and reference keep) plus two processes'
    CUDA contexts and NCCL buffers keeps more than the margin; with the grad buffer left on the GPU it
    would keep 1.6 GiB, less than the margin."""
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    dims, _ = load_model_dims(config.model.path)
    with_offload = estimate_memory(config, dims, train_gpus=8, processes_per_train_gpu=2)
    assert with_offload.runtime_bytes == 2 * GIB and with_offload.fits and with_offload.spare_bytes > 10 * GIB
    grads_kept = _recipe("grpo_qwen2.5-7b_gsm8k.yaml", "actor.offload.grads=false")
    without = estimate_memory(grads_kept, dims, train_gpus=8, processes_per_train_gpu=2)
    assert not without.fits and 0 < without.spare_bytes < without.margin_bytes


QWEN3_30B_A3B = read_model_dims(
    dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        num_experts=128,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )
)
"""Qwen3-30B-A3B's published config.json."""


def test_expert_parallelism_splits_the_experts_and_their_optimizer_state_shards_over_expert_dp():
    experts = 48 * 128 * 3 * 2048 * 768  # 29.0 B of the 30.5 B parameters
    assert total_parameters(QWEN3_30B_A3B) == pytest.approx(30.5e9, rel=0.01)
    ep8 = ParallelConfig(expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    params, grads, optimizer = state_bytes(QWEN3_30B_A3B, ep8, 16, "bfloat16", distributed_optimizer=True, trained=True)
    rank = rank_parameters(QWEN3_30B_A3B, 1, 1)
    assert params == 2 * (rank - experts * 7 // 8), "an EP-8 rank holds 16 of the 128 experts of every layer"
    assert grads == 4 * params // 2
    # 12 B per parameter (fp32 main + Adam): the dense 1.5 B over DP 16, the 3.6 B experts over expert DP 16 / 8 = 2.
    dense = rank - experts
    assert optimizer == pytest.approx(12 * dense / 16 + 12 * (experts / 8) / 2, rel=1e-6)
    tp2 = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=8)  # experts cut over TP 2 too
    assert state_bytes(QWEN3_30B_A3B, tp2, 8, "bfloat16", distributed_optimizer=True, trained=True)[0] == pytest.approx(
        params / 2, rel=0.01
    )


def _actor_activations(config, shape, impl="transformer_engine", **parallel):
    actor = dataclasses.replace(
        config.actor,
        parallel=ParallelConfig(tensor_model_parallel_size=2, **parallel),
        recompute=dataclasses.replace(config.actor.recompute, granularity="none", num_layers=None),
    )
    model = dataclasses.replace(config.model, transformer_impl=impl)
    return estimate_memory(dataclasses.replace(config, actor=actor, model=model), shape, train_gpus=8).roles[0]


def test_context_parallel_splits_each_sequences_activations_and_keeps_the_optimizer_shard():
    """CP 2 at TP 2 on 8 GPUs: each rank holds half of every sequence's activations and logits; DP drops to 2 but
    megatron's distributed optimizer shards over DP × CP = 4, as DP 4 does without CP."""
    shape = load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    off, on = _actor_activations(config, shape), _actor_activations(config, shape, context_parallel_size=2)
    assert on.activations * 2 == off.activations
    assert (on.parameters, on.gradients, on.optimizer) == (off.parameters, off.gradients, off.optimizer)


def test_sequence_parallel_splits_the_norm_and_linear_inputs_and_te_keeps_no_softmax():
    """Per token and layer: sequence parallelism keeps 4h / TP instead of 4h; Transformer Engine's attention keeps
    no a·S / TP softmax probabilities, the local spec's does."""
    shape = load_model_dims("Qwen/Qwen2.5-7B-Instruct")[0]
    config = _recipe("grpo_qwen2.5-7b_gsm8k.yaml")
    seq_len = config.data.max_prompt_length + config.rollout.max_new_tokens
    tokens = config.actor.micro_batch_size_per_gpu * seq_len
    per_layer_token_bytes = shape.num_layers * tokens * 2  # bfloat16
    te = _actor_activations(config, shape).activations
    sp = _actor_activations(config, shape, sequence_parallel=True).activations
    local = _actor_activations(config, shape, impl="local").activations
    assert te - sp == per_layer_token_bytes * (4 * shape.hidden_size - 4 * shape.hidden_size // 2)
    assert local - te == per_layer_token_bytes * (shape.num_attention_heads * seq_len // 2)


def test_the_32k_recipe_validates_and_sequence_and_context_parallelism_cut_its_activations():
    """configs/grpo_qwen3-8b_32k.yaml (Qwen3-8B, 33 792-token samples, 2 × 8 GPUs, TP 4 × SP × CP 2) validates, and
    its actor's activations per GPU are those its header states: SP and CP together a third of neither's."""
    config = _recipe("grpo_qwen3-8b_32k.yaml")
    assert validate(config, check_files=False) == []
    shape = load_model_dims(config.model.path)[0]

    def activations_gib(sp: bool, cp: int) -> float:
        parallel = dataclasses.replace(config.actor.parallel, sequence_parallel=sp, context_parallel_size=cp)
        actor = dataclasses.replace(config.actor, parallel=parallel)
        return (
            estimate_memory(dataclasses.replace(config, actor=actor), shape, train_gpus=16).roles[0].activations / GIB
        )

    both, cp_only, sp_only, neither = (
        activations_gib(*case) for case in ((True, 2), (False, 2), (True, 1), (False, 1))
    )
    assert [round(gib, 1) for gib in (both, cp_only, sp_only, neither)] == [7.6, 11.5, 15.3, 23.0]
    assert both < neither / 3


def test_the_qwen3_30b_a3b_recipe_fits_two_nodes_with_its_experts_split_over_ep():
    """Issue 29, item 6: the MoE recipe fits 2 × 8 H100 (colocated: the actor and the engines on all 16) by its
    memory estimate, which counts a rank's 16 of 128 experts per layer (EP 8); the known-models table's shape
    is the published config's."""
    config = _recipe("grpo_qwen3-30b-a3b_math.yaml")
    shape = load_model_dims(config.model.path)[0]
    assert shape == QWEN3_30B_A3B
    assert config.placement.mode == "colocated"
    estimate = estimate_memory(config, shape, train_gpus=16)
    assert estimate.fits and estimate.spare_bytes > estimate.margin_bytes
    whole = dataclasses.replace(config.actor.parallel, expert_model_parallel_size=1)
    assert state_bytes(shape, config.actor.parallel, 8, "bfloat16", distributed_optimizer=True, trained=True)[0] < (
        state_bytes(shape, whole, 8, "bfloat16", distributed_optimizer=True, trained=True)[0] / 4
    ), "EP 8 keeps an eighth of the experts' weights on a rank"
