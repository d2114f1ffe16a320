"""The trainer half of the per-rank sync without processes: the shared-memory buckets a rank writes
hold its tensors exactly (cast to the plan's dtype), the delivering rank groups every rank's handles
by TP rank, and layouts with train TP != rollout TP are refused."""

from __future__ import annotations

import pytest
import torch
from bridge_emulate import dims_of

from megarl.bridge.per_rank import PerRankSender, _by_rank, _write_bucket
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.workers.rollout.weight_sync_protocol import unpack


def test_a_bucket_holds_its_tensors_in_the_plans_dtype(tmp_path):
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5, dtype=torch.float64))]
    shared = []
    bucket = _write_bucket(named, torch.bfloat16, str(tmp_path), shared)
    assert shared == [bucket]
    got = unpack(bucket.open(torch.device("cpu")), bucket.metadata)
    assert [name for name, _ in got] == ["a.weight", "b.bias"]
    for (_, expected), (_, tensor) in zip(named, got):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected.to(torch.bfloat16))


def test_handles_are_grouped_by_tp_rank_across_stages():
    everyone = [(0, ["r0s0"], ["embed"]), (1, ["r1s0"], []), (0, ["r0s1"], ["head"]), (1, ["r1s1"], [])]
    by_rank, full = _by_rank(everyone, tp_size=2)
    assert by_rank == {0: ["r0s0", "r0s1"], 1: ["r1s0", "r1s1"]}
    assert full == ["embed", "head"]


def test_unequal_train_and_rollout_tp_is_refused():
    plan = build_plan(dims_of("qwen2"), LayoutPair(train_tp=2, train_pp=1, rollout_tp=1))
    with pytest.raises(ValueError, match="train TP == rollout TP"):
        PerRankSender(plan, lambda: iter(()), groups=None, deliver=None)
