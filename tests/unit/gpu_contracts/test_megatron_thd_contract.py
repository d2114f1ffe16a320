"""megarl's THD micro-batches (`megarl.workers.thd`, `MicroBatch.packed_seq_params`, `run_model`)
against the installed megatron-core 0.16.1: the call and the dataclass fit, and every module from
`GPTModel.forward` down to Transformer Engine's attention takes `packed_seq_params` and passes it on.
Transformer Engine is CUDA-only, so `TEDotProductAttention.forward` is read as source here; the run
with a stand-in for it is tests/distributed/workers/test_thd_micro_batches.py, with the real one
tests/gpu/test_thd_cuda.py."""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
from call_sites import assert_fits, call_sites, dataclass_fields
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

pytestmark = pytest.mark.unit


def test_run_model_passes_packed_seq_params_as_gpt_model_forward_takes_it():
    """megatron/core/models/gpt/gpt_model.py `GPTModel.forward(input_ids, position_ids,
    attention_mask, ..., packed_seq_params=None, ..., padding_mask=None)`."""
    sites = call_sites("workers/megatron_train.py", "model")
    assert [site.keywords for site in sites] == [("packed_seq_params", "padding_mask")]
    assert_fits(sites, GPTModel.forward, bound=True)


def test_packed_seq_params_keywords_are_fields():
    """megatron/core/packed_seq_params.py `PackedSeqParams`: qkv_format, cu_seqlens_q/kv, max_seqlen_q/kv."""
    sites = call_sites("workers/micro_batches.py", "PackedSeqParams")
    for site in sites:
        unknown = sorted(set(site.keywords) - dataclass_fields(PackedSeqParams))
        assert not unknown, f"{site.where}: PackedSeqParams has no fields {unknown}"


@pytest.mark.parametrize(
    "forward",
    [
        TransformerBlock.forward,  # megatron/core/transformer/transformer_block.py
        TransformerLayer._forward_attention,  # megatron/core/transformer/transformer_layer.py
        SelfAttention.forward,  # megatron/core/transformer/attention.py (Attention.forward)
    ],
)
def test_every_module_on_the_way_takes_packed_seq_params(forward):
    assert "packed_seq_params" in inspect.signature(forward).parameters, forward.__qualname__


def test_self_attention_squeezes_the_batch_and_applies_rope_per_thd_sequence():
    """Attention.forward, for `qkv_format == "thd"`: q/k/v lose the batch dimension (`[t, heads,
    dim]`, what TE's THD kernels take) and RoPE gets `cu_seqlens` (rope_utils.apply_rotary_pos_emb →
    TE's fused THD RoPE on megarl's TE spec, test_megatron_rope_fusion_contract.py, else
    `_apply_rotary_pos_emb_thd`: positions restart at each sequence)."""
    source = inspect.getsource(SelfAttention.forward)
    assert "query = query.squeeze(1)" in source and "key = key.squeeze(1)" in source
    assert "cu_seqlens=cu_seqlens_q" in source and "cu_seqlens=cu_seqlens_kv" in source
    assert "packed_seq_params=packed_seq_params" in source  # handed to core attention


def _te_core_attention_forward() -> ast.FunctionDef:
    path = Path(importlib.util.find_spec("megatron.core.extensions.transformer_engine").origin)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "TEDotProductAttention":
            return next(item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "forward")
    raise AssertionError("megatron/core/extensions/transformer_engine.py has no TEDotProductAttention")


def test_te_core_attention_takes_packed_seq_params_and_hands_its_fields_to_te():
    """extensions/transformer_engine.py `TEDotProductAttention.forward(query, key, value,
    attention_mask, attn_mask_type, attention_bias=None, packed_seq_params=None, ...)`: the
    `PackedSeqParams` fields go to TE's `DotProductAttention.forward` as keywords."""
    forward = _te_core_attention_forward()
    assert [arg.arg for arg in forward.args.args][:8] == [
        "self",
        "query",
        "key",
        "value",
        "attention_mask",
        "attn_mask_type",
        "attention_bias",
        "packed_seq_params",
    ]
    source = ast.unparse(forward)
    assert "packed_seq_kwargs = {key: getattr(packed_seq_params, key) for key in self.kept_packed_seq_params}" in source
    assert "super().forward(query, key, value, attention_mask, **_fa_kwargs)" in source
