"""The packing planner: every sample packed exactly once under the budget, deterministic plans, a
clear error for a sample longer than the budget, DP ranks balanced by tokens with equal sample counts."""

import random

import pytest

from megarl.workers.packing import TokenBudget, balance_over_ranks, pack_by_tokens, pack_rows

BUDGET = TokenBudget(64, "actor.max_tokens_per_micro_batch")


def _variable_lengths(count: int, seed: int) -> list[int]:
    """Prompt (4..16) + response (8..64) tokens, the variable-length workload's spread."""
    rng = random.Random(seed)
    return [rng.randint(4, 16) + rng.randint(8, 64) for _ in range(count)]


@pytest.mark.parametrize("seed", range(5))
def test_every_sample_is_packed_once_under_the_budget(seed):
    lengths = _variable_lengths(64, seed)
    budget = TokenBudget(160, "actor.max_tokens_per_micro_batch")
    plan = pack_by_tokens(lengths, budget)
    assert sorted(i for indices in plan for i in indices) == list(range(64))
    assert all(sum(lengths[i] for i in indices) <= 160 for indices in plan)
    assert all(indices == sorted(indices) for indices in plan)
    # First fit: a later micro-batch's samples did not fit into any earlier one, so any two loads
    # together exceed the budget (no two micro-batches could have been merged).
    loads = [sum(lengths[i] for i in indices) for indices in plan]
    assert all(a + b > 160 for k, a in enumerate(loads) for b in loads[k + 1 :])
    assert plan == pack_by_tokens(lengths, budget)


def test_the_docstring_example_and_one_sample_per_row_at_the_tightest_budget():
    assert pack_by_tokens([30, 12, 50, 7], BUDGET) == [[1, 2], [0, 3]]
    assert pack_by_tokens([5, 5, 5], TokenBudget(5, "critic.max_tokens_per_micro_batch")) == [[0], [1], [2]]
    assert pack_by_tokens([], BUDGET) == []


def test_a_sample_longer_than_the_budget_names_the_setting_and_the_fix():
    with pytest.raises(ValueError) as error:
        pack_by_tokens([10, 70, 65, 3], BUDGET)
    message = str(error.value)
    assert "actor.max_tokens_per_micro_batch=64" in message
    assert "2 sample(s) (sample 1 has 70" in message
    assert "at least 70" in message


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(ValueError, match=r"ref.max_tokens_per_micro_batch=0 must be >= 1"):
        TokenBudget(0, "ref.max_tokens_per_micro_batch")


@pytest.mark.parametrize("seed", range(5))
def test_ranks_get_equal_sample_counts_and_nearly_equal_tokens(seed):
    lengths = _variable_lengths(64, seed)
    plan = balance_over_ranks(lengths, 4)
    assert sorted(i for indices in plan for i in indices) == list(range(64))
    assert [len(indices) for indices in plan] == [16] * 4
    loads = [sum(lengths[i] for i in indices) for indices in plan]
    # Greedy longest-first: ranks differ by at most the longest sample; a plain split is far worse.
    assert max(loads) - min(loads) <= max(lengths)
    plain = [sum(lengths[r * 16 : (r + 1) * 16]) for r in range(4)]
    assert max(loads) - min(loads) <= max(plain) - min(plain)


def test_balance_needs_equal_shares():
    assert balance_over_ranks([30, 12, 50, 7], 2) == [[2, 3], [0, 1]]
    with pytest.raises(ValueError, match="cannot give 5 samples to 2 DP ranks"):
        balance_over_ranks([1, 2, 3, 4, 5], 2)


def test_rows_no_wider_than_asked_grouped_by_the_budget():
    assert pack_rows([30, 12, 50, 7], TokenBudget(128, "actor.max_tokens_per_micro_batch"), row_width=64) == [
        [[1, 2], [0, 3]]
    ]
    lengths = _variable_lengths(64, 0)
    plan = pack_rows(lengths, TokenBudget(300, "actor.max_tokens_per_micro_batch"), row_width=88)
    assert all(len(rows) <= 3 for rows in plan)  # 300 // 88 rows of at most 88 tokens
    assert all(sum(lengths[i] for i in row) <= 88 for rows in plan for row in rows)
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(64))
    # A budget narrower than the rows makes one row per micro-batch; the error names the budget.
    assert pack_rows([5, 5], TokenBudget(5, "ref.max_tokens_per_micro_batch"), row_width=88) == [[[0]], [[1]]]
    with pytest.raises(ValueError, match="ref.max_tokens_per_micro_batch=5 is smaller than 1 sample"):
        pack_rows([5, 6], TokenBudget(5, "ref.max_tokens_per_micro_batch"), row_width=88)
