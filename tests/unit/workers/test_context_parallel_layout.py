"""megarl's context-parallel split of a THD row (`megarl.workers.context_parallel`) is megatron-core's: each CP
rank's columns of a sequence are the positions megatron's own THD RoPE gives that rank
(`_get_thd_freqs_on_this_cp_rank` in megatron/core/models/common/embeddings/rope_utils.py, which
`_apply_rotary_pos_emb_thd` calls per sequence with `cu_seqlens.diff() // cp_size` local tokens); every
column lies on exactly one rank."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

from megarl.workers.context_parallel import load_balanced_columns


@pytest.mark.parametrize("cp_size", [2, 4])
def test_each_ranks_columns_are_megatrons_thd_positions_for_that_rank(cp_size):
    lengths = [2 * cp_size * k for k in (1, 3, 2, 5)]
    offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    positions = torch.arange(max(lengths))  # megatron's freqs table, one row per position
    every_rank = []
    for cp_rank in range(cp_size):
        columns = load_balanced_columns(offsets, cp_size, cp_rank)
        expected = torch.cat(
            [
                start + _get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, torch.empty(length // cp_size), positions)
                for start, length in zip(offsets, lengths)
            ]
        )
        assert torch.equal(columns, expected), cp_rank
        every_rank.append(columns)
    assert torch.equal(torch.cat(every_rank).sort().values, torch.arange(offsets[-1]))


def test_a_sequence_not_cut_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="cannot be cut into 2 × context_parallel_size = 4 equal chunks"):
        load_balanced_columns([0, 6], cp_size=2, cp_rank=0)
