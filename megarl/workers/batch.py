"""The batch every Megatron worker reads, and how an optimizer step is cut into pieces.

Layout: row `i` is a sample = its prompt, **left-padded** to `P`, followed by its response,
**right-padded** to `R` (as the rollout returns them). The real tokens of a row are therefore one
contiguous run inside `input_ids = [prompts | responses]` (`[B, P + R]`), and:

- the token predicted at column `P + t` (response token `t`) is read from the logits at column
  `P + t - 1`, the same columns for every row;
- attention needs the causal mask plus "key is prompt padding": the left padding
  sits *before* real tokens, so causality alone would let real tokens attend to it. Response padding
  is in every real token's future, so causality already hides it: `response_mask` never enters
  attention and may also drop real tokens from the loss (a loss mask, not a length);
- RoPE (megatron's GPTModel uses positions `0..S-1` for RoPE, whatever `position_ids` says) sees every
  real token of a row shifted by the same number of pad columns; attention scores depend only on
  position differences, so the result equals the unpadded sequence's (to float rounding).

`megarl.workers.micro_batches` builds the model inputs from this layout (padded rows) or packs the
real tokens of several samples into one row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PolicyBatch:
    """One data-parallel rank's samples (all ranks of its TP × PP group hold the same copy)."""

    prompts: Tensor
    """`[B, P]` int64 token ids, left-padded (any id in padded columns)."""
    prompt_mask: Tensor
    """`[B, P]` bool, True on real prompt tokens (a suffix of each row)."""
    responses: Tensor
    """`[B, R]` int64 token ids, right-padded (any id in padded columns)."""
    response_mask: Tensor
    """`[B, R]` bool, True on response tokens that count in losses and metrics (False on padding)."""
    old_log_probs: Tensor | None = None
    """`[B, R]` float: log-probs of `responses` under the policy that sampled them (actor update)."""
    rollout_log_probs: Tensor | None = None
    """`[B, R]` float: log-probs the rollout engine reported while sampling (truncated IS)."""
    ref_log_probs: Tensor | None = None
    """`[B, R]` float: log-probs under the reference model (KL loss)."""
    advantages: Tensor | None = None
    """`[B, R]` float: per-token advantages (actor update)."""
    values: Tensor | None = None
    """`[B, R]` float: the critic's values at rollout time (clipped value loss)."""
    returns: Tensor | None = None
    """`[B, R]` float: value targets (critic update)."""
    loss_mask: Tensor | None = None
    """`[B, R]` bool: the tokens the actor update's loss counts when fewer than `response_mask` (DAPO's
    overlong filtering drops truncated samples: `megarl.algorithms.dapo.filtered_loss_mask`); None:
    `response_mask`. The forward passes ignore it."""
    routed_experts: Tensor | None = None
    """`[B, P + R, L, k]` int16: the experts the rollout engine routed each token of `input_ids` to, in
    each of the model's `L` layers (its top-k expert ids, in any order); -1 on the tokens it routed none
    (padding, and each sample's last token, which the engine never fed back). The actor's and the
    reference's forward passes route through them (`actor.moe.router_replay`, `megarl.workers.router_replay`).
    None: the engines returned no routing (a dense model, or replay off)."""

    def __post_init__(self) -> None:
        rows = self.prompts.shape[0]
        for field in dataclasses.fields(self):
            tensor = getattr(self, field.name)
            if tensor is not None and tensor.shape[0] != rows:
                raise ValueError(
                    f"PolicyBatch.{field.name} has {tensor.shape[0]} rows but prompts has {rows}; "
                    "every field holds one row per sample"
                )
        if self.prompt_mask.shape != self.prompts.shape or self.response_mask.shape != self.responses.shape:
            raise ValueError(
                f"PolicyBatch masks must match their tokens: prompts {tuple(self.prompts.shape)} vs "
                f"prompt_mask {tuple(self.prompt_mask.shape)}, responses {tuple(self.responses.shape)} vs "
                f"response_mask {tuple(self.response_mask.shape)}"
            )

    def __len__(self) -> int:
        return self.prompts.shape[0]

    @property
    def prompt_length(self) -> int:
        """`P`, the padded prompt width."""
        return self.prompts.shape[1]

    @property
    def response_length(self) -> int:
        """`R`, the padded response width."""
        return self.responses.shape[1]

    @property
    def input_ids(self) -> Tensor:
        """`[B, P + R]` prompts then responses."""
        return torch.cat([self.prompts, self.responses], dim=1)

    def select(self, rows: Tensor | slice) -> PolicyBatch:
        """The batch of the given rows (index tensor or slice), every field sliced alike."""
        return PolicyBatch(
            **{
                field.name: None if (tensor := getattr(self, field.name)) is None else tensor[rows]
                for field in dataclasses.fields(self)
            }
        )

    def to(self, device: torch.device) -> PolicyBatch:
        """The batch with every tensor on `device`."""
        return PolicyBatch(
            **{
                field.name: None if (tensor := getattr(self, field.name)) is None else tensor.to(device)
                for field in dataclasses.fields(self)
            }
        )

    def require(self, fields: tuple[str, ...], purpose: str) -> None:
        """ValueError naming the fields among `fields` that are None (needed for `purpose`)."""
        missing = [name for name in fields if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{purpose} needs PolicyBatch fields {missing}; set them before calling it")

    def split(self, num_parts: int) -> list[PolicyBatch]:
        """`num_parts` consecutive batches of equal size (`len(self)` must divide evenly)."""
        if num_parts <= 0 or len(self) % num_parts != 0:
            raise ValueError(f"cannot cut a batch of {len(self)} samples into {num_parts} equal parts")
        size = len(self) // num_parts
        return [self.select(slice(k * size, (k + 1) * size)) for k in range(num_parts)]


def mini_batches(batch: PolicyBatch, num_mini_batches: int, *, shuffle_seed: int | None) -> list[PolicyBatch]:
    """Cut one epoch of `batch` into `num_mini_batches` equal mini-batches (one optimizer step each).

    With `shuffle_seed`, rows are permuted first by a generator seeded with it, so every rank of a
    model-parallel group (same batch, same seed) draws the same permutation. The permutation is drawn
    on the CPU (the generator's device) and indexes a batch on any device alike.
    """
    if shuffle_seed is None:
        return batch.split(num_mini_batches)
    generator = torch.Generator().manual_seed(shuffle_seed)
    return batch.select(torch.randperm(len(batch), generator=generator)).split(num_mini_batches)
