"""The exact sync check without processes (`megarl.bridge.checksum`): the trainer ranks' partial
checksums of their Megatron shards add up to the checksum of each HF tensor, and so do a per-rank
vLLM worker's; the engine's record of a correct sync (the bridge's own buckets) matches in fp32 and
bf16; a sender-side wrong mapping, a transposed or shifted tensor, a lost tensor and a lossy cast
are each caught and named exactly, in bf16 too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bridge_emulate import (
    dims_of,
    emulated_buckets,
    megatron_shards,
    naive_gate_up_merge_into,
    random_hf_tensors,
    stage_ranks,
)

import megarl.bridge.convert as convert
from megarl.bridge.checksum import (
    LoadedChecksums,
    VllmRankLayout,
    WeightChecksumError,
    actor_checksums,
    check_checksums,
    combine,
    recorded,
    tensor_checksum,
)
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.protocol import unpack

DTYPES = ("float32", "bfloat16")


def trainer_checksums(plan, shards, dtype):
    """What `combine` of every trainer rank's `actor_checksums` gives (every rank of every stage, DP
    replicas included: only the copies the sync sends count)."""
    return combine(
        actor_checksums(
            plan,
            rank_shards(plan, shards, rank),
            SimpleNamespace(pp_rank=pp, tp=None, etp=None, **rank),
            dtype=getattr(torch, dtype),
        )
        for rank in stage_ranks(plan.layout)
        for pp in range(plan.layout.train_pp)
    )


def rank_shards(plan, shards, rank):
    """A rank's shards by plan name: its TP shard of the dense weights, its expert-TP shard of the
    experts its EP rank holds."""
    per_ep = plan.dims.num_experts // plan.layout.train_ep if plan.dims.num_experts else 0
    return {
        p.megatron_name: shards[p.megatron_name][rank["etp_rank"] if p.expert >= 0 else rank["tp_rank"]]
        for p in plan.params
        if p.expert < 0 or p.expert // per_ep == rank["ep_rank"]
    }


def engine_record(plan, shards, dtype) -> LoadedChecksums:
    """One worker's record of loading the bridge's buckets (full HF tensors), as the worker extension makes it."""
    record = LoadedChecksums(dtype)
    tensors = [pair for flat, metadata in emulated_buckets(plan, shards) for pair in unpack(flat, metadata)]
    assert len(list(recorded(tensors, record))) == len(tensors)  # passed through, unchanged
    return record


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("qwen2", LayoutPair(2, 2, 1)),
        ("llama", LayoutPair(2, 1, 1)),
        ("qwen3", LayoutPair(1, 1, 1)),
        ("qwen3_moe", LayoutPair(2, 1, 1)),
        ("qwen3_moe", LayoutPair(2, 2, 1, train_ep=2)),
        ("qwen3_moe", LayoutPair(1, 1, 1, train_ep=4, train_etp=2)),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_checksums_add_up_to_the_hf_tensors(arch, layout, dtype):
    """Every rank of the trainer (DP and expert-DP replicas too) adds its share of the copies the sync
    sends, experts by the EP rank holding them, cut over its expert-TP ranks."""
    dims = dims_of(arch, num_hidden_layers=2)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, layout)
    expected = {name: tensor_checksum(tensor, getattr(torch, dtype)) for name, tensor in hf.items()}
    assert trainer_checksums(plan, megatron_shards(plan, hf), dtype) == expected
    record = engine_record(plan, megatron_shards(plan, hf), dtype)
    check_checksums(expected, [record], dtype=dtype, layout=plan.layout, engine="e")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_rank_vllm_tensors_add_up_to_the_hf_tensors(arch, dtype):
    """Workers of a TP-2 engine fed the per-rank sync's tensors (`convert.to_vllm_rank`, the vocabulary
    `convert.to_vllm_vocab_rank` of the full tensor)."""
    dims = dims_of(arch, num_hidden_layers=2)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(2, 1, 2))
    shards = megatron_shards(plan, hf)
    records = []
    for rank in range(2):
        record = LoadedChecksums(dtype)
        tensors = [
            (p.hf_names[0], convert.to_vllm_vocab_rank(hf[p.hf_names[0]], dims, 2, rank))
            if p.kind == "vocab"
            else convert.to_vllm_rank(p, shards[p.megatron_name][rank], dims, 2)
            for p in plan.params
        ]
        list(recorded(tensors, record, VllmRankLayout(dims, 2, rank)))
        records.append(record)
    assert records[0].partial and records[0].full  # blocks of linear layers and the vocabulary; norms whole
    expected = {name: tensor_checksum(tensor, getattr(torch, dtype)) for name, tensor in hf.items()}
    check_checksums(expected, records, dtype=dtype, layout=plan.layout, engine="e")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wrong_gate_up_merge_on_the_sender_is_named(dtype, monkeypatch):
    dims = dims_of("qwen2", num_hidden_layers=2)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(2, 1, 1))
    shards = megatron_shards(plan, hf)
    expected = trainer_checksums(plan, shards, dtype)
    monkeypatch.setattr(convert, "merge_tp_shards_into", naive_gate_up_merge_into)
    with pytest.raises(WeightChecksumError) as error:
        check_checksums(
            expected, [engine_record(plan, shards, dtype)], dtype=dtype, layout=plan.layout, engine="engine 0"
        )
    message = str(error.value)
    assert "4 of" in message and "train TP=2/PP=1 → rollout TP=1" in message and "engine 0" in message
    for layer in range(2):
        for part in ("gate_proj", "up_proj"):
            assert f"model.layers.{layer}.mlp.{part}.weight: rollout worker 0 loaded checksum" in message
    assert "q_proj" not in message and "down_proj" not in message


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_shifted_lost_and_lossy_tensors_are_named(dtype):
    dims = dims_of("qwen2", num_hidden_layers=2)
    hf = random_hf_tensors(dims)
    plan = build_plan(dims, LayoutPair(1, 1, 1))
    expected = trainer_checksums(plan, megatron_shards(plan, hf), dtype)
    square = "model.layers.0.self_attn.o_proj.weight"  # [256, 256]: a transpose keeps the shape
    wrong = dict(hf)
    wrong[square] = hf[square].t().contiguous()
    wrong["model.layers.1.mlp.down_proj.weight"] = hf["model.layers.1.mlp.down_proj.weight"].roll(1, dims=1)
    del wrong["model.norm.weight"]
    # A wrong cast: bf16 precision by truncating the fp32 bits instead of rounding to nearest.
    norm = hf["model.layers.1.input_layernorm.weight"]
    wrong["model.layers.1.input_layernorm.weight"] = (norm.view(torch.int32) & -65536).view(torch.float32)
    record = LoadedChecksums(dtype)
    list(recorded(wrong.items(), record))
    with pytest.raises(WeightChecksumError) as error:
        check_checksums(expected, [record], dtype=dtype, layout=plan.layout, engine="engine 0")
    message = str(error.value)
    for name in (square, "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight"):
        assert f"{name}: rollout worker 0 loaded checksum" in message
    assert "model.norm.weight: loaded by no worker" in message
    assert "4 of" in message


def test_one_bf16_ulp_and_a_swap_of_two_elements_change_the_checksum():
    tensor = torch.randn(64, 32).to(torch.bfloat16)
    nudged = tensor.clone()
    nudged.view(torch.int16)[3, 5] += 1
    swapped = tensor.clone()
    swapped[0, 0], swapped[0, 1] = tensor[0, 1], tensor[0, 0]
    assert tensor[0, 0] != tensor[0, 1]
    base = tensor_checksum(tensor, torch.bfloat16)
    assert tensor_checksum(nudged, torch.bfloat16) != base
    assert tensor_checksum(swapped, torch.bfloat16) != base
    assert tensor_checksum(tensor.float(), torch.bfloat16) == base  # the cast to the engine's dtype is exact here


def test_an_engine_in_another_dtype_than_the_check_is_refused():
    with pytest.raises(WeightChecksumError, match="runs in float32, but the actor's checksums were taken in bfloat16"):
        check_checksums({}, [LoadedChecksums("float32")], dtype="bfloat16", layout=LayoutPair(1, 1, 1), engine="e")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_error_shared_by_every_element_changes_the_checksum_of_a_power_of_two_sized_tensor(dtype):
    """Every value doubled (the bits of each element moved by the same exponent step) or every bit pattern
    moved by one. With weights affine in the index (2i + 1), Σ_i w(i) = n² is 0 mod 2^32 for n = 2^16
    elements (256 × 256), so both went unseen; real weight matrices have such sizes (e.g. 4096 × 4096)."""
    tensor = torch.randn(256, 256).to(dtype)
    base = tensor_checksum(tensor, dtype)
    doubled = tensor * 2
    moved = tensor.clone()
    moved.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).add_(1)
    assert tensor_checksum(doubled, dtype) != base
    assert tensor_checksum(moved, dtype) != base


def test_the_checksum_is_the_hash_weighted_sum_and_blocks_add_up_to_it():
    """`tensor_checksum` is Σ_{r,c} u(r)·v(c)·bits[r, c] mod 2^32 written out in Python integers, and the
    checksums of a row block and of two column blocks, each at its own HF rows and columns, add up to
    the whole tensor's; a transposed square matrix changes it (u and v are different hashes)."""
    from megarl.bridge.checksum import MOD, block_checksum, column_weights, row_weights

    tensor = torch.randn(6, 10)
    bits = tensor.view(torch.int32).tolist()
    u, v = row_weights(torch.arange(6)).tolist(), [w % MOD for w in column_weights(torch.arange(10)).tolist()]
    written_out = sum(u[r] * v[c] * (bits[r][c] % MOD) for r in range(6) for c in range(10)) % MOD
    assert tensor_checksum(tensor, torch.float32) == written_out
    top = block_checksum(tensor[:2], torch.float32, torch.arange(2))
    left = block_checksum(tensor[2:, :4], torch.float32, torch.arange(2, 6))
    right = block_checksum(tensor[2:, 4:], torch.float32, torch.arange(2, 6), first_column=4)
    assert (top + left + right) % MOD == written_out
    assert len(set(u)) == 6 and len(set(v)) == 10 and all(0 < w < MOD and w % 2 for w in u + v)
    square = torch.randn(8, 8)
    assert tensor_checksum(square.T.contiguous(), torch.float32) != tensor_checksum(square, torch.float32)
