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
def hf_logprobs(
    model, sequence: list[int], temperature: float = 1.0, top_k: int | None = None
) -> torch.Tensor:
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
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
        pad_token_id=0, top_k=None, top_p=None, temperature=None,
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
    from megarl.bridge.transports import SharedMemoryTransport

    transport = SharedMemoryTransport(readers=1)
    loaded = engine.load_shared_buckets(transport.begin())
    transport.send(buckets)
    loaded.result(timeout=60)
