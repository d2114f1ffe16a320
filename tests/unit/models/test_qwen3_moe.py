"""Qwen3-MoE's architecture module: config.json → dims (and what it refuses), the TransformerConfig MoE
fields, the layer spec, the expert tensor table and the total / active counts. The registry-wide
tests (test_arch_registry) cover its tiny checkpoint's tensors, parameter count and TP round trip;
tests/distributed/models/test_qwen3_moe_parity.py its logits against transformers'."""

import pytest
import torch

from megarl.models.arch import architecture
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model

# Qwen3-30B-A3B's config.json (the fields megarl reads).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
}


def test_dims_of_qwen3_30b_a3b():
    dims = read_model_dims(QWEN3_30B_A3B)
    assert (dims.num_experts, dims.num_experts_per_tok, dims.moe_ffn_hidden_size) == (128, 8, 768)
    assert dims.norm_topk_prob and dims.qk_layernorm and dims.router_aux_loss_coef == 0.001


def test_total_and_active_parameters_of_qwen3_30b_a3b():
    """Qwen3-30B-A3B is 30.5B parameters in all, 3.3B active (its model card, which truncates 3.35B)."""
    dims = read_model_dims(QWEN3_30B_A3B)
    arch = architecture("qwen3_moe")
    embeddings = 2 * dims.vocab_size * dims.hidden_size + dims.hidden_size
    total = dims.num_layers * arch.layer_parameters(dims, 1) + embeddings
    active = dims.num_layers * arch.active_layer_parameters(dims) + embeddings
    assert round(total / 1e9, 1) == 30.5 and 3.3 <= active / 1e9 < 3.4


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
        ({"mlp_only_layers": [0, 3]}, "mlp_only_layers=\\[0, 3\\] is not supported"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok=200 exceeds num_experts=128"),
        ({"num_experts": 0}, "num_experts=0 must be a positive integer"),
    ],
)
def test_unsupported_moe_configs_name_the_key(fields, message):
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        read_model_dims({**QWEN3_30B_A3B, **fields})


def test_transformers_5_num_local_experts_is_read():
    """transformers 5 saves `num_experts` as `num_local_experts` (its attribute map)."""
    config = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 64}
    assert read_model_dims(config).num_experts == 64


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_transformer_config_routes_as_qwen3_moe(norm_topk_prob):
    from megarl.models.architectures import transformer_config

    dims = read_model_dims({**QWEN3_30B_A3B, "norm_topk_prob": norm_topk_prob})
    config = transformer_config(dims, tp_size=1, pp_size=1)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 768)
    # Renormalised top-k = softmax over the top-k logits (pre_softmax False); else softmax, then top-k.
    assert config.moe_router_score_function == "softmax" and config.moe_router_pre_softmax is not norm_topk_prob
    assert config.moe_router_dtype == "fp32" and config.moe_token_dispatcher_type == "alltoall"
    assert config.moe_aux_loss_coeff == 0.001


def test_router_loss_settings_replace_the_checkpoint_default_and_a_dense_model_refuses_them():
    from megarl.config.roles import MoeConfig
    from megarl.models.architectures import transformer_config
    from megarl.workers.megatron_train import moe_transformer_fields

    dims = read_model_dims(QWEN3_30B_A3B)
    settings = moe_transformer_fields(MoeConfig(aux_loss_coeff=0.0, z_loss_coeff=1e-3))
    config = transformer_config(dims, tp_size=1, pp_size=1, ep_size=4, etp_size=1, **settings)
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (0.0, 1e-3)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (4, 1)
    assert moe_transformer_fields(MoeConfig()) == {}, "unset: the checkpoint's coefficient, no z-loss"
    dense = read_model_dims({**QWEN3_30B_A3B, "model_type": "qwen3", "num_experts": None})
    with pytest.raises(ValueError, match=r"\['moe_z_loss_coeff'\] for a dense model"):
        transformer_config(dense, tp_size=1, pp_size=1, moe_z_loss_coeff=1e-3)
    with pytest.raises(ValueError, match="cannot be overridden"):
        transformer_config(dims, tp_size=1, pp_size=1, moe_router_topk=2)


def test_megatron_routing_equals_hf_routing():
    """megatron-core's router function with these settings picks HF's experts with HF's weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for norm in (True, False):
        probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=not norm)
        hf = torch.softmax(logits, dim=-1)
        top, index = torch.topk(hf, 2, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        expected = torch.zeros_like(hf).scatter(1, index, top)
        torch.testing.assert_close(probs, expected)
        assert torch.equal(routing_map, expected > 0)


def test_layer_spec_has_sequential_mlp_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megarl.models.architectures import layer_spec

    spec = layer_spec(read_model_dims(QWEN3_30B_A3B), "local")
    assert spec.submodules.mlp.module is MoELayer
    assert spec.submodules.mlp.submodules.experts.module is SequentialMLP


def test_expert_table(tmp_path):
    dims = read_model_dims(make_tiny_model(tmp_path / "moe", "qwen3_moe"))
    params = {p.megatron: p for p in architecture("qwen3_moe").layer_params(dims)}
    assert params["mlp.router.weight"].hf == ("mlp.gate.weight",)
    fc1 = params["mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.hf == ("mlp.experts.5.gate_proj.weight", "mlp.experts.5.up_proj.weight") and fc1.kind == "gate_up"
    assert params["mlp.experts.local_experts.7.linear_fc2.weight"].hf == ("mlp.experts.7.down_proj.weight",)
    assert (dims.num_experts, dims.num_experts_per_tok) == (8, 2), "the tiny model: 8 experts, top-2"


def test_dense_architectures_refuse_expert_keys():
    with pytest.raises(ValueError, match="num_experts=8 for model_type='qwen3' .*model_type 'qwen3_moe'"):
        read_model_dims({**QWEN3_30B_A3B, "model_type": "qwen3", "num_experts": 8})


def test_expert_parallel_layouts_the_model_cannot_be_cut_into():
    from megarl.models.hf_config import check_parallel_layout

    dims = read_model_dims(QWEN3_30B_A3B)
    check_parallel_layout(dims, tp_size=4, pp_size=4, ep_size=8)
    with pytest.raises(ValueError, match="expert parallel size 3 does not divide num_experts=128"):
        check_parallel_layout(dims, tp_size=1, pp_size=1, ep_size=3)
    dense = read_model_dims({**QWEN3_30B_A3B, "model_type": "qwen3", "num_experts": None})
    with pytest.raises(ValueError, match="expert parallel size 2 for a dense model .*expert_model_parallel_size to 1"):
        check_parallel_layout(dense, tp_size=1, pp_size=1, ep_size=2)


def test_transformer_engines_grouped_gemm_experts_map_to_the_same_hf_tensors():
    """The TE spec's TEGroupedMLP holds a stage's local experts as `linear_fc1.weight{e}` of one grouped
    linear; they are the local spec's `local_experts.{e}` (global expert offset + e)."""
    from megarl.models.layout import expert_offset, is_expert, param_mapping

    dims = read_model_dims(QWEN3_30B_A3B)
    assert architecture("qwen3_moe").layer_spec_options(dims, "transformer_engine")["moe_grouped_gemm"]
    assert not architecture("qwen3_moe").layer_spec_options(dims, "local")["moe_grouped_gemm"]
    offset = expert_offset(dims, ep_size=8, ep_rank=2)
    grouped = param_mapping("decoder.layers.3.mlp.experts.linear_fc1.weight5", dims, expert_offset=offset)
    assert grouped.hf_names == (
        "model.layers.3.mlp.experts.37.gate_proj.weight",
        "model.layers.3.mlp.experts.37.up_proj.weight",
    )
    assert grouped.kind == "gate_up" and grouped.megatron_name.endswith("linear_fc1.weight5")
    assert param_mapping("decoder.layers.0.mlp.experts.linear_fc2.weight15", dims).hf_names == (
        "model.layers.0.mlp.experts.15.down_proj.weight",
    )
    assert is_expert("decoder.layers.0.mlp.experts.linear_fc2.weight15")
    assert not is_expert("decoder.layers.0.mlp.linear_fc2.weight")


def test_local_expert_names_map_to_global_experts():
    from megarl.models.layout import expert_offset, is_expert, param_mapping

    dims = read_model_dims(QWEN3_30B_A3B)
    offset = expert_offset(dims, ep_size=4, ep_rank=3)
    assert offset == 96
    name = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"
    assert is_expert(name) and not is_expert("decoder.layers.1.mlp.router.weight")
    assert param_mapping(name, dims, layer_offset=24, expert_offset=offset).hf_names == (
        "model.layers.25.mlp.experts.101.down_proj.weight",
    )
