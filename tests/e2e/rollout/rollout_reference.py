"""HuggingFace references for the rollout tests, computed directly with transformers in fp32."""

from __future__ import annotations

import socket
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [70, 12, 33, 33, 60, 61, 62]]
TOLERANCE = 1e-4


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def load_hf(model_dir: Path, state_dict: dict[str, torch.Tensor] | None = None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


@torch.no_grad()
def hf_logprobs(model, sequence: list[int], temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """`[T - 1]`: log p(token t | tokens < t) under softmax(logits / temperature), truncated to the
    top_k most likely tokens when given."""
    logits = model(torch.tensor([sequence])).logits[0, :-1].float() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[1:])[:, None]).squeeze(-1)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    return out[0, len(prompt) :].tolist()


def response_logprobs_of(model, prompt: list[int], response: list[int], **kwargs) -> torch.Tensor:
    """HF log-probs of `response`'s tokens after `prompt`: `[len(response)]`."""
    return hf_logprobs(model, prompt + response, **kwargs)[len(prompt) - 1 :]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_through_shared_memory(engine, buckets) -> None:
    """One sync of `buckets` (`(flat, metadata)` pairs) into `engine` by the shared-memory transport:
    the engine starts loading from the sync's ring, the transport streams the buckets through its two
    slots, and this returns once the engine has loaded them."""
    from megarl.bridge import SharedRings
    from megarl.bridge.transports import SharedMemoryTransport

    transport = SharedMemoryTransport(readers=1)
    loaded = engine.receive(SharedRings({0: transport.begin()}))
    transport.send(buckets)
    loaded.result(timeout=60)


def lone_trainer(model_dir: Path, tensors: dict[str, torch.Tensor], rollout_tp: int, bucket_mb: float):
    """A TP-1, PP-1 trainer rank of `model_dir`'s model holding `tensors` (an HF checkpoint of its shape), for
    a sync into a rollout-TP-`rollout_tp` engine: the plan of `bucket_mb` buckets, its Megatron "shards" (here
    the whole parameters, cut from `tensors`) and its ranks as `ProcessGroups` has them (no experts split)."""
    from types import SimpleNamespace

    from megarl.bridge.convert import mapping_of
    from megarl.bridge.plan import LayoutPair, build_plan
    from megarl.models.hf_config import read_model_dims
    from megarl.models.layout import VOCAB_DIVISIBLE_BY, reader_of, tp_shard_from_hf

    plan = build_plan(read_model_dims(model_dir), LayoutPair(1, 1, rollout_tp), bucket_mb=bucket_mb)
    named = [
        (
            param.megatron_name,
            tp_shard_from_hf(
                mapping_of(param),
                reader_of(tensors),
                plan.dims,
                tp_size=1,
                tp_rank=0,
                vocab_divisible_by=VOCAB_DIVISIBLE_BY,
            ),
        )
        for param in plan.params
    ]
    ranks = SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, dp_rank=0, ep_rank=0, ep_size=1, etp_rank=0, etp_size=1, expert_dp_rank=0
    )
    return plan, named, ranks


def sync_over_group(
    engine, tp: int, model_dir: Path, tensors: dict[str, torch.Tensor], bucket_mb: float, timeout_s: float
):
    """One sync of `tensors` (an HF checkpoint of `model_dir`'s shape) into `engine` (TP `tp`) over a gloo sync
    group in which this process plays a `lone_trainer` (group rank 0) sending its shards, bucket by bucket, to
    the engine's workers, each of which assembles its own TP shard of them. Returns the plan."""
    from megarl.bridge import CollectivePlan, ShardSender
    from megarl.bridge.sync_group import create_weight_sync_group, listen_weight_sync_store

    plan, named, ranks = lone_trainer(model_dir, tensors, tp, bucket_mb)
    # Listening before the workers connect: a TCPStore client that finds no store backs off for up to a minute.
    store = listen_weight_sync_store("127.0.0.1", 1 + tp, timeout_s)
    joined = engine.init_weight_sync("127.0.0.1", store.port, world_size=1 + tp, timeout_s=timeout_s)
    group = create_weight_sync_group("127.0.0.1", store.port, 0, 1 + tp, timeout_s, store=store)
    joined.result(timeout=timeout_s)
    sender = ShardSender(plan, lambda: iter(named), ranks, group)
    engine.pause()
    try:
        loaded = engine.receive(CollectivePlan(plan))
        sender.send()
        loaded.result(timeout=timeout_s)
    finally:
        engine.resume()
    return plan


def sync_per_rank(engine, model_dir: Path, tensors: dict[str, torch.Tensor], bucket_mb: float, timeout_s: float):
    """One per-rank sync of `tensors` into a TP-1 `engine`: this process plays a `lone_trainer` streaming its
    shards, in the engine's per-rank names and shapes, through its own shared ring (`PerRankSender`), which
    the engine's one worker reads (`RankRings`). Returns the plan."""
    from megarl.bridge import RankRings
    from megarl.bridge.per_rank import PerRankSender
    from megarl.bridge.transports import SharedMemoryTransport

    plan, named, ranks = lone_trainer(model_dir, tensors, 1, bucket_mb)
    sender = PerRankSender(plan, lambda: iter(named), ranks, SharedMemoryTransport(readers=1))
    engine.pause()
    try:
        loaded = engine.receive(RankRings({0: [sender.begin()]}))
        sender.send()
        loaded.result(timeout=timeout_s)
    finally:
        engine.resume()
    return plan
