"""RoPE fusion on the Transformer Engine spec (`megarl.models.architectures.rope_fusion`) against the
installed megatron-core 0.16.1: megarl's TE config sets `apply_rope_fusion`, megatron's
`TransformerConfig` takes it when TE's fused RoPE functions exist, and megatron's RoPE then hands
each THD call to `fused_apply_rotary_pos_emb_thd` with the keywords that function takes.

Transformer Engine is CUDA-only: the fused functions megatron imports from
megatron/core/extensions/transformer_engine.py (None here) are monkeypatched module attributes of
megatron/core/models/common/embeddings/rope_utils.py, and that extension module is read as source.
The model run with a stand-in for TE's kernel: tests/distributed/workers/test_thd_micro_batches.py;
with the real one: tests/gpu/test_thd_cuda.py."""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention

from megarl.models import architectures
from megarl.models.hf_config import read_model_dims

pytestmark = pytest.mark.unit

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MODELS = {
    "llama": {"model_type": "llama", "rope_parameters": LLAMA3_ROPE},
    "llama-linear": {
        "model_type": "llama",
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    },
    "qwen2": {"model_type": "qwen2", "rope_theta": 1e6},
    "qwen3": {"model_type": "qwen3", "rope_theta": 1e6, "head_dim": 32},
}
"""Every architecture and RoPE scaling megarl builds (`hf_config.SUPPORTED_MODEL_TYPES`, `_rope`)."""


class _OneRankGroup:
    """The context-parallel group `SelfAttention.forward` passes (`pg_collection.cp`): megarl runs none."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _dims(fields):
    return read_model_dims(
        {
            "vocab_size": 100,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512,
            **fields,
        }
    )


def _te_config(monkeypatch, fields, fused_thd):
    monkeypatch.setattr(architectures, "_te_importable", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", fused_thd)
    return architectures.transformer_config(_dims(fields), tp_size=1, pp_size=1, transformer_impl="transformer_engine")


@pytest.mark.parametrize("fields", MODELS.values(), ids=MODELS.keys())
def test_te_config_has_rope_fusion_in_the_settings_the_fused_thd_kernel_supports(monkeypatch, fields):
    """TransformerConfig.__post_init__ (transformer/transformer_config.py) accepts the flag once a
    fused RoPE function exists; the THD wrapper passes TE no `interleaved` and no `mscale`, so megarl's
    config must rotate halves and have no YaRN concentration factor (1.0: SelfAttention.forward's
    `_yarn_get_concentration_factor_from_config`). The local spec keeps the unfused RoPE."""
    config = _te_config(monkeypatch, fields, lambda *args, **kwargs: None)
    assert config.apply_rope_fusion and not config.rotary_interleaved
    assert _yarn_get_concentration_factor_from_config(config) == 1.0
    local = architectures.transformer_config(_dims(fields), tp_size=1, pp_size=1)
    assert not local.apply_rope_fusion


def test_without_te_megatron_refuses_rope_fusion(monkeypatch):
    """Why the local spec (CPU, no TE) keeps the flag off: __post_init__ raises without the fused functions."""
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available. Please install TE >= 1.4"):
        _te_config(monkeypatch, MODELS["qwen2"], None)


def test_thd_rope_goes_to_the_fused_kernel_with_the_cu_seqlens(monkeypatch):
    """rope_utils.apply_rotary_pos_emb, as SelfAttention.forward calls it for THD (`cu_seqlens=`,
    `mscale=`, `cp_group=`): with the flag, one call `fused_apply_rotary_pos_emb_thd(t, cu_seqlens,
    freqs, cp_size=1, cp_rank=0)` and nothing else; without it, megatron's unfused THD RoPE."""
    calls = []

    def fused_thd(*args, **kwargs):
        calls.append((args, kwargs))
        return args[0]

    config = _te_config(monkeypatch, MODELS["qwen2"], fused_thd)
    t, freqs = torch.randn(7, 4, 32), torch.randn(5, 1, 1, 32)
    cu_seqlens = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    assert "cu_seqlens=cu_seqlens_q" in inspect.getsource(SelfAttention.forward)
    out = rope_utils.apply_rotary_pos_emb(
        t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=1.0, cp_group=_OneRankGroup()
    )
    [(args, kwargs)] = calls
    assert out is t and args[0] is t and args[1] is cu_seqlens and args[2] is freqs and len(args) == 3
    assert kwargs == {"cp_size": 1, "cp_rank": 0}
    wrapper = _te_extension_function("fused_apply_rotary_pos_emb_thd")
    assert [arg.arg for arg in wrapper.args.args] == ["t", "cu_seqlens", "freqs", "cp_size", "cp_rank"]

    local = architectures.transformer_config(_dims(MODELS["qwen2"]), tp_size=1, pp_size=1)
    rope_utils.apply_rotary_pos_emb(t, freqs, config=local, cu_seqlens=cu_seqlens, cp_group=_OneRankGroup())
    assert len(calls) == 1


def test_te_wrapper_runs_te_rope_fused_on_thd_without_interleaving():
    """extensions/transformer_engine.py `fused_apply_rotary_pos_emb_thd` calls TE's
    `apply_rotary_pos_emb(t, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens, ...)`
    (transformer_engine/pytorch/attention/rope.py) and never passes `interleaved` (TE's default,
    False): why megarl pins `rotary_interleaved=False`."""
    wrapper = _te_extension_function("fused_apply_rotary_pos_emb_thd")
    te_calls = [
        node
        for node in ast.walk(wrapper)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "apply_rotary_pos_emb"
    ]
    assert te_calls
    for call in te_calls:
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert keywords["tensor_format"] == "'thd'" and keywords["fused"] == "True"
        assert keywords["cu_seqlens"] == "cu_seqlens" and "interleaved" not in keywords


def test_the_unfused_thd_rope_reads_cu_seqlens_on_the_host():
    """The cost `rope_fusion`'s docstring names: rope_utils._apply_rotary_pos_emb_thd turns the
    sequence lengths into a Python list (a GPU sync) and loops over the sequences."""
    source = inspect.getsource(rope_utils._apply_rotary_pos_emb_thd)
    assert "(cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()" in source
    assert "for x in sequence_splits" in source


def _te_extension_function(name: str) -> ast.FunctionDef:
    path = Path(importlib.util.find_spec("megatron.core.extensions.transformer_engine").origin)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"megatron/core/extensions/transformer_engine.py has no {name}")
