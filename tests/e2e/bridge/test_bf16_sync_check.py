"""The sync check in bf16, end to end: a bf16 Megatron actor at train TP 2 (two spawned ranks, params
and compute in bf16) sends its own shards in bf16 over the sync group into a bf16 rollout-TP-1 vLLM
engine, three times:

1. correctly: every tensor the engine's loader received is bit for bit the actor's (the exact check),
   and the probe log-prob gap is within the measured bf16 threshold (`LOGPROB_GAP_BY_DTYPE`);
2. with layer 0's gate and up halves swapped by the sender: the exact check names exactly those two
   tensors;
3. with one bf16 ulp of one element of layer 1's down_proj changed by the sender: the log-prob gap
   stays within the bf16 threshold (the gap alone cannot see it), the exact check names the tensor.

Both injections patch `shard_sync`'s sender functions in the training ranks, after the actor's reference
checksums come from its unchanged shards (`checksum.rank_checksums`)."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megarl.bridge.checksum import WeightChecksumError, check_checksums, combine, rank_checksums
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.sync import receiving
from megarl.bridge.sync_group import listen_weight_sync_store
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import model_in_dtype, wait_for_joins
from megarl.workers.sync_probe import probe_policy_batch

HOST = "127.0.0.1"
TIMEOUT_S = 300
DTYPE = "bfloat16"
LAYOUT = LayoutPair(train_tp=2, train_pp=1, rollout_tp=1)
BUCKET_MB = 0.25
INJECTIONS = (None, "swap_gate_up", "one_ulp")
GATE_UP = "decoder.layers.0.mlp.linear_fc1.weight"
DOWN = "decoder.layers.1.mlp.linear_fc2.weight"


def _plan(model_dir: str):
    return build_plan(read_model_dims(model_dir), LAYOUT, bucket_mb=BUCKET_MB, dtype=getattr(torch, DTYPE))


@contextlib.contextmanager
def _injected(kind: str | None):
    """The sender's `shard_block` / `piece_tensor` made wrong in one way (None: as they are)."""
    import dataclasses

    import megarl.bridge.shard_sync as shard_sync

    original_block, original_piece = shard_sync.shard_block, shard_sync.piece_tensor

    def wrong_block(piece, shard, dims):
        if kind == "swap_gate_up" and piece.param.megatron_name == GATE_UP:  # gate pieces cut from up, and back
            piece = dataclasses.replace(piece, hf_index=1 - piece.hf_index)
        return original_block(piece, shard, dims)

    def wrong_piece(schedule, piece, block):
        tensor = original_piece(schedule, piece, block)
        if kind == "one_ulp" and piece.param.megatron_name == DOWN and piece.tp_rank == 0:
            tensor = tensor.clone()
            tensor.view(torch.int16)[0, 0] += 1
        return tensor

    shard_sync.shard_block, shard_sync.piece_tensor = (
        (wrong_block, wrong_piece) if kind else (original_block, original_piece)
    )
    try:
        yield
    finally:
        shard_sync.shard_block, shard_sync.piece_tensor = original_block, original_piece


def _trainer(model_dir: str, port: int, world_size: int) -> list[dict]:
    """One bf16 training rank: its probe log-probs, then per injection a send and its shards' checksums."""
    from megatron.core.utils import unwrap_model

    from megarl.bridge import ShardSender, sender_rank
    from megarl.bridge.sync_group import create_weight_sync_group
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import compute_log_probs, global_named_parameters

    groups = initialize_model_parallel(LAYOUT.train_tp, LAYOUT.train_pp, seed=0)
    model = model_in_dtype(model_dir, groups, DTYPE)
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())
    plan = _plan(model_dir)
    named = lambda: global_named_parameters(unwrap_model(model), groups)  # noqa: E731
    group = create_weight_sync_group(
        HOST, port, sender_rank(LAYOUT, groups.pp_rank, groups.tp_rank), world_size, TIMEOUT_S
    )
    sender = ShardSender(plan, named, groups, group)
    probe = probe_token_ids(plan.dims.vocab_size)
    log_probs, _ = compute_log_probs(model, probe_policy_batch(probe), len(probe), plan.dims.vocab_size, groups)
    rounds = []
    for kind in INJECTIONS:
        with _injected(kind):
            sender.send()
        rounds.append(dict(actor=log_probs.float().tolist(), checksums=rank_checksums(plan, named(), groups, DTYPE)))
    return rounds


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """Per injection: (the actor's checksums, the engine worker's, the actor's and engine's probe log-probs)."""
    model_dir = str(
        make_tiny_model(
            tmp_path_factory.mktemp("bf16_sync"),
            "qwen2",
            hidden_size=256,
            intermediate_size=384,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            initializer_range=0.2,
        )
    )
    world_size = LAYOUT.train_tp + LAYOUT.rollout_tp
    # This process hosts the group's store before any rank starts: the engine's worker would otherwise
    # connect before trainer rank 0 (spawned, importing Megatron) listens, and back off for up to a minute.
    store = listen_weight_sync_store(HOST, world_size, TIMEOUT_S)
    port = store.port
    plan, probe = _plan(model_dir), probe_token_ids(100)
    with ThreadPoolExecutor(max_workers=1) as pool:
        trainers = pool.submit(
            run_distributed, _trainer, LAYOUT.train_tp, model_dir, port, world_size, timeout_s=TIMEOUT_S
        )
        engine = make_rollout_engine("vllm", EngineArgs(model_dir, dtype=DTYPE, max_model_len=64))
        try:
            joined = engine.init_weight_sync(HOST, port, world_size, TIMEOUT_S, rank_offset=LAYOUT.train_tp)
            wait_for_joins([joined], trainers, TIMEOUT_S)
            after = []
            for _ in INJECTIONS:
                with receiving(engine, plan, TIMEOUT_S):
                    pass
                after.append((engine.loaded_checksums(), torch.stack(engine.prompt_logprobs(probe))))
            ranks = trainers.result(timeout=TIMEOUT_S)
        finally:
            engine.shutdown()
    return {
        kind: (combine(rank[i]["checksums"] for rank in ranks), loaded, torch.tensor(ranks[0][i]["actor"]), lp)
        for i, (kind, (loaded, lp)) in enumerate(zip(INJECTIONS, after))
    }


def test_a_correct_bf16_sync_passes_both_checks(synced):
    expected, loaded, actor, engine = synced[None]
    assert loaded[0].dtype == DTYPE
    metrics = check_checksums(expected, loaded, dtype=DTYPE, layout=LAYOUT, engine="the engine")
    # The TP-1 worker loads its per-rank tensors: norms whole, the rest as blocks (here the whole tensor).
    assert metrics["sync/checksum_tensors"] == len(expected) == len(loaded[0].full.keys() | loaded[0].partial.keys())
    threshold = LOGPROB_GAP_BY_DTYPE[(DTYPE, DTYPE)]
    gap = check_sync(list(engine), actor, threshold=threshold, layout=LAYOUT)["sync/logprob_max_abs_diff"]
    assert 0 < gap <= threshold  # bf16 rounding differs between the two stacks, never by more


def test_swapped_gate_up_halves_are_named(synced):
    expected, loaded, _, _ = synced["swap_gate_up"]
    with pytest.raises(WeightChecksumError) as error:
        check_checksums(expected, loaded, dtype=DTYPE, layout=LAYOUT, engine="the engine")
    message = str(error.value)
    assert "2 of" in message and "train TP=2/PP=1 → rollout TP=1" in message
    # The worker loads gate_up_proj as its per-rank block: named by the blocks' sum.
    assert "model.layers.0.mlp.gate_proj.weight: its TP blocks summed over the workers" in message
    assert "model.layers.0.mlp.up_proj.weight: its TP blocks summed over the workers" in message


def test_one_ulp_is_named_where_the_gap_sees_nothing(synced):
    expected, loaded, actor, engine = synced["one_ulp"]
    check_sync(list(engine), actor, threshold=LOGPROB_GAP_BY_DTYPE[(DTYPE, DTYPE)], layout=LAYOUT)  # passes
    with pytest.raises(WeightChecksumError, match=r"1 of \d+ tensors: model\.layers\.1\.mlp\.down_proj\.weight: "):
        check_checksums(expected, loaded, dtype=DTYPE, layout=LAYOUT, engine="the engine")
