"""The trainer half of the per-rank sync without processes: buckets hold their tensors exactly, in
the plan's dtype and in order, never exceed the limit (a larger tensor travels alone), and layouts
with train TP != rollout TP are refused."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import dims_of

from megarl.bridge.per_rank import PerRankSender, bucketed
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.protocol import unpack


def test_buckets_hold_their_tensors_in_order_in_the_plans_dtype():
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5, dtype=torch.float64))]
    [(flat, metadata)] = list(bucketed(iter(named), bucket_bytes=1 << 20, dtype=torch.bfloat16))
    got = unpack(flat, metadata)
    assert [name for name, _ in got] == ["a.weight", "b.bias"]
    for (_, expected), (_, tensor) in zip(named, got):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected.to(torch.bfloat16))


def test_buckets_stay_within_the_limit_and_a_larger_tensor_travels_alone():
    sizes = [10, 10, 30, 5, 50, 5]  # float32 elements; the limit is 20 elements
    named = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]
    buckets = list(bucketed(iter(named), bucket_bytes=80, dtype=torch.float32))
    names = [[slot.name for slot in metadata.slots] for _, metadata in buckets]
    assert names == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    for flat, metadata in buckets:
        assert flat.nbytes <= 80 or len(metadata.slots) == 1
        for name, tensor in unpack(flat, metadata):
            assert torch.equal(tensor, dict(named)[name])


def test_unequal_train_and_rollout_tp_is_refused():
    plan = build_plan(dims_of("qwen2"), LayoutPair(train_tp=2, train_pp=1, rollout_tp=1))
    with pytest.raises(ValueError, match="train TP == rollout TP"):
        PerRankSender(plan, lambda: iter(()), groups=None, transport=None)
