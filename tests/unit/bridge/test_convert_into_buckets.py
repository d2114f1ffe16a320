"""The bridge writes every parameter straight into its bucket: `to_hf_into` into views of a flat
buffer, and with TP > 1 the qkv and gate/up shards land in place, piece by piece (`shard_pieces`, as
`collect._receive_into` receives them). Both must rebuild the checkpoint's tensors exactly; a shard
of the wrong shape must be refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import dims_of, megatron_shards, random_hf_tensors

from megarl.bridge.convert import check_hf_shapes, mapping_of, to_hf_into
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.models.layout import ROW_BLOCK_KINDS, shard_pieces


def _bucket_views(bucket):
    """A NaN-filled flat buffer and one view per slot, by HF name."""
    flat = torch.full((bucket.metadata.numel,), float("nan"))
    return flat, {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in bucket.metadata.slots}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_to_hf_into_the_bucket_rebuilds_the_checkpoint(arch, tp):
    dims = dims_of(arch)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(tp, 1, 1), bucket_mb=0.5)
    shards = megatron_shards(plan, hf)
    for bucket in plan.buckets:
        flat, views = _bucket_views(bucket)
        for param in bucket.params:
            own = shards[param.megatron_name] if param.needs_tp_gather else shards[param.megatron_name][:1]
            to_hf_into(param, own, dims, [views[name] for name in param.hf_names])
        assert not flat.isnan().any()  # every slot written
        for name, view in views.items():
            assert torch.equal(view, hf[name]), name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shard_pieces_fill_their_rows(arch, tp):
    dims = dims_of(arch)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(tp, 1, 1))
    shards = megatron_shards(plan, hf)
    placed = 0
    for param in plan.params:
        if param.kind not in ROW_BLOCK_KINDS:
            continue
        outs = [torch.full(shape, float("nan")) for shape in param.hf_shapes]
        for rank, shard in enumerate(shards[param.megatron_name]):
            for out, (piece, rows) in zip(outs, shard_pieces(mapping_of(param), shard, dims, rank)):
                out[rows].view(piece.shape).copy_(piece.contiguous())  # as sent: contiguous
        for name, out in zip(param.hf_names, outs):
            assert torch.equal(out, hf[name]), name
        placed += 1
    assert placed == 2 * dims.num_layers + (dims.num_layers if dims.qkv_bias else 0)


def test_a_shard_of_the_wrong_shape_is_refused_before_writing():
    dims = dims_of("qwen2")
    plan = build_plan(dims, LayoutPair(2, 1, 1))
    param = next(p for p in plan.params if p.megatron_name.endswith("mlp.linear_fc1.weight"))
    shard = megatron_shards(plan, random_hf_tensors(dims))[param.megatron_name][0]
    wrong = shard[:-2]
    with pytest.raises(ValueError, match="linear_fc1.weight.*config.json says"):
        check_hf_shapes(param, [tuple(wrong.shape)] * 2, dims)
    outs = [torch.full(shape, float("nan")) for shape in param.hf_shapes]
    with pytest.raises(ValueError, match="config.json says"):
        to_hf_into(param, [wrong, wrong], dims, outs)
    assert all(out.isnan().all() for out in outs)
