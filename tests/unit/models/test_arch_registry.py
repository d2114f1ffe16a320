"""The architecture registry is the single source of what differs between architectures: every
registered `model_type` is covered here without being named, and an architecture module dropped into
the package is found and used by the loader's reader, the layout, the sync plan and the counts."""

import json
import math
import re
import sys

import pytest
import torch
from safetensors.torch import load_file

from megarl.bridge.plan import LayoutPair, build_plan
from megarl.cli.main import main
from megarl.config.memory import total_parameters
from megarl.models import arch as registry
from megarl.models import layout
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model

ARCHS = registry.supported_model_types()


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(model_type, checkpoint dir) of every registered architecture, 4 layers, tied embeddings for
    one in two so both output-layer cases are covered."""
    tied = ARCHS.index(request.param) % 2 == 1
    directory = tmp_path_factory.mktemp("arch") / request.param
    return request.param, make_tiny_model(directory, request.param, num_hidden_layers=4, tie_word_embeddings=tied)


def test_the_registry_holds_the_dense_architectures():
    assert {"llama", "qwen2", "qwen3"} <= set(ARCHS)
    assert all(registry.architecture(t).model_type == t for t in ARCHS)


def test_tiny_checkpoint_holds_exactly_the_declared_tensors(tiny):
    model_type, model_dir = tiny
    dims = read_model_dims(model_dir)
    assert dims.model_type == model_type
    tensors = load_file(model_dir / "model.safetensors")
    assert {name: tuple(t.shape) for name, t in tensors.items()} == layout.hf_param_shapes(dims)
    declared = registry.architecture(model_type).hf_layer_shapes(dims)
    mapped = [name for param in registry.architecture(model_type).layer_params(dims) for name in param.hf]
    assert sorted(mapped) == sorted(declared), "the tensor table covers each HF layer tensor exactly once"


def test_parameter_count_agrees_with_the_checkpoint(tiny):
    _, model_dir = tiny
    tensors = load_file(model_dir / "model.safetensors")
    assert total_parameters(read_model_dims(model_dir)) == sum(t.numel() for t in tensors.values())


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (2, 4)])
def test_tiny_model_round_trips_through_megatron_shards(tiny, tp, pp):
    """HF → every Megatron parameter's TP shards (the loader's slicing) → HF (the exporter's merge),
    over the sync plan's list of parameters: bit for bit, every tensor once."""
    _, model_dir = tiny
    dims = read_model_dims(model_dir)
    hf = load_file(model_dir / "model.safetensors")
    restored = {}
    for param in build_plan(dims, LayoutPair(tp, pp, 1)).params:
        mapping = layout.param_mapping(param.megatron_name, dims)
        shards = layout.tp_shards_from_hf(mapping, hf, dims, tp_size=tp, vocab_divisible_by=128)
        for name, tensor in layout.merge_tp_shards(mapping, shards, dims):
            assert name not in restored
            restored[name] = tensor
    assert restored.keys() == hf.keys()
    assert all(torch.equal(restored[name], hf[name]) for name in hf)


def test_unknown_model_type_names_the_key_and_the_supported_list(tmp_path, capsys):
    with pytest.raises(
        ValueError, match=re.escape(f"config.json: model_type='gpt2' is not supported; megarl builds {list(ARCHS)}")
    ):
        read_model_dims({"model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported"):
        registry.architecture("gpt2")
    with pytest.raises(ValueError, match=r"make_tiny_model: arch='gpt2' is not one of"):
        make_tiny_model(tmp_path / "gpt2", "gpt2")
    with pytest.raises(SystemExit):
        main(["init-tiny-model", "--out", str(tmp_path / "m"), "--arch", "gpt2"])
    usage = capsys.readouterr().err
    assert "invalid choice: 'gpt2'" in usage and all(repr(t) in usage for t in ARCHS), usage


def test_a_new_architecture_module_is_all_it_takes(tmp_path, monkeypatch):
    """One file in the package registers a model_type that the config reader, the layout and the
    sync plan then use: nothing else names architectures."""
    (tmp_path / "fake_dense.py").write_text(
        "from megarl.models.arch.dense import DenseDecoder\n"
        "ARCHITECTURE = DenseDecoder('fake_dense', qkv_bias=True, qk_layernorm=True, hf_config_class='Qwen3Config')\n"
    )
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(tmp_path)])
    registry._registry.cache_clear()
    try:
        assert "fake_dense" in registry.supported_model_types()
        llama_dir = make_tiny_model(tmp_path / "base", "llama")
        config = json.loads((llama_dir / "config.json").read_text())
        dims = read_model_dims({**config, "model_type": "fake_dense"})
        assert (dims.model_type, dims.qkv_bias, dims.qk_layernorm) == ("fake_dense", True, True)
        shapes = layout.hf_param_shapes(dims)
        assert shapes["model.layers.1.self_attn.q_norm.weight"] == (dims.head_dim,)
        plan = build_plan(dims, LayoutPair(2, 1, 1))
        assert sum(p.numel for p in plan.params) == sum(math.prod(s) for s in shapes.values())
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in {p.megatron_name for p in plan.params}
    finally:
        sys.modules.pop("megarl.models.arch.fake_dense", None)
        monkeypatch.undo()
        registry._registry.cache_clear()
