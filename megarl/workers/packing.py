"""The packing planner: which samples share a packed micro-batch under a token budget, and which DP
rank gets which samples so that ranks carry about the same number of tokens.

Pure functions of per-sample token counts (prompt + response, padding excluded);
`megarl.workers.micro_batches` turns a plan into model inputs. Both plans are deterministic (ties
broken by sample index), so every rank of a model-parallel group, given the same lengths, draws the
same plan without talking to the others.

    plan = pack_by_tokens([30, 12, 50, 7], TokenBudget(64, "actor.max_tokens_per_micro_batch"))
    # [[1, 2], [0, 3]]: 62 and 37 tokens, each at most 64
    pack_rows([30, 12, 50, 7], TokenBudget(128, "actor.max_tokens_per_micro_batch"), row_width=64)
    # [[[1, 2], [0, 3]]]: one micro-batch of two 64-token rows
    balance_over_ranks([30, 12, 50, 7], num_ranks=2)
    # [[2, 3], [0, 1]]: two samples per rank, 57 and 42 tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenBudget:
    """Micro-batches cut by tokens instead of samples: samples are packed, without padding between
    them, into rows of a micro-batch holding at most `max_tokens` token slots."""

    max_tokens: int
    """Most token slots (rows × row width, the rows' end padding included) of one packed micro-batch."""
    setting: str
    """The config key the budget comes from (e.g. "actor.max_tokens_per_micro_batch"), named in errors."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"{self.setting}={self.max_tokens} must be >= 1 (tokens per micro-batch)")


def check_fits(lengths: Sequence[int], budget: TokenBudget) -> None:
    """ValueError naming `budget.setting` if a sample has more tokens than the budget."""
    too_long = [i for i, length in enumerate(lengths) if length > budget.max_tokens]
    if too_long:
        raise ValueError(
            f"{budget.setting}={budget.max_tokens} is smaller than {len(too_long)} sample(s) (sample "
            f"{too_long[0]} has {lengths[too_long[0]]} prompt + response tokens); a sample is never split "
            f"across micro-batches: set {budget.setting} to at least {max(lengths)}, the longest sample"
        )


def pack_by_tokens(lengths: Sequence[int], budget: TokenBudget) -> list[list[int]]:
    """Sample indices of each packed micro-batch: every sample in exactly one, each micro-batch's
    lengths summing to at most `budget.max_tokens`.

    First-fit decreasing (longest sample first, into the first micro-batch with room): at most
    11/9 of the fewest possible micro-batches plus one. Indices inside a micro-batch ascend.
    """
    check_fits(lengths, budget)
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((k for k, load in enumerate(loads) if load + lengths[index] <= budget.max_tokens), None)
        if target is None:
            bins.append([index])
            loads.append(lengths[index])
        else:
            bins[target].append(index)
            loads[target] += lengths[index]
    return [sorted(indices) for indices in bins]


def pack_rows(lengths: Sequence[int], budget: TokenBudget, row_width: int) -> list[list[list[int]]]:
    """Sample indices of each row of each packed micro-batch: rows of at most
    `min(row_width, budget.max_tokens)` tokens (`pack_by_tokens`), `budget.max_tokens // that`
    rows per micro-batch. Rows as wide as the padded batch keep the attention of a packed row (dense
    over the row on megatron's local spec) no wider than the padded layout's."""
    check_fits(lengths, budget)
    width = min(row_width, budget.max_tokens)
    if any(length > width for length in lengths):
        raise ValueError(f"pack_rows: row_width={row_width} is narrower than a sample of {max(lengths)} tokens")
    rows = pack_by_tokens(lengths, TokenBudget(width, budget.setting))
    per_micro_batch = budget.max_tokens // width
    return [rows[start : start + per_micro_batch] for start in range(0, len(rows), per_micro_batch)]


def balance_over_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Sample indices of each DP rank: the same number of samples per rank (as the mini-batch
    arithmetic needs), tokens spread evenly (longest sample first, to the rank with the fewest tokens
    that still has room). Indices inside a rank ascend."""
    if num_ranks < 1 or len(lengths) % num_ranks != 0:
        raise ValueError(
            f"cannot give {len(lengths)} samples to {num_ranks} DP ranks in equal numbers; the batch size must "
            "be a multiple of the DP size"
        )
    per_rank = len(lengths) // num_ranks
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        open_ranks = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        target = min(open_ranks, key=lambda r: (loads[r], r))
        ranks[target].append(index)
        loads[target] += lengths[index]
    return [sorted(indices) for indices in ranks]
