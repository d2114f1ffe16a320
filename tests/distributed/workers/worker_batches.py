"""The ragged batch the worker tests share (a plain module: the spawned ranks import it too)."""

import torch

from megarl.workers.batch import PolicyBatch

BATCH_SIZE, PROMPT_LEN, RESPONSE_LEN = 8, 6, 5


def ragged_batch() -> PolicyBatch:
    """8 samples: prompts left-padded to 6, responses right-padded to 5, lengths 1..full (seeded).

    Padded columns hold real token ids (not 0) so a missing mask would change the result.
    """
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 100, (BATCH_SIZE, PROMPT_LEN), generator=gen)
    responses = torch.randint(4, 100, (BATCH_SIZE, RESPONSE_LEN), generator=gen)
    prompt_lens = torch.tensor([6, 1, 3, 6, 2, 5, 4, 1])
    response_lens = torch.tensor([5, 1, 2, 3, 5, 4, 1, 5])
    prompt_mask = torch.arange(PROMPT_LEN)[None, :] >= (PROMPT_LEN - prompt_lens)[:, None]
    response_mask = torch.arange(RESPONSE_LEN)[None, :] < response_lens[:, None]
    return PolicyBatch(prompts, prompt_mask, responses, response_mask)


def left_padded(batch: PolicyBatch, columns: int) -> PolicyBatch:
    """`batch` with `columns` more columns of prompt left padding (real token ids, masked out): rows
    whose prompt filled the width go from 0 to `columns` padded columns."""
    padding = torch.randint(4, 100, (len(batch), columns), generator=torch.Generator().manual_seed(1))
    return PolicyBatch(
        torch.cat([padding, batch.prompts], dim=1),
        torch.cat([torch.zeros(len(batch), columns, dtype=torch.bool), batch.prompt_mask], dim=1),
        batch.responses,
        batch.response_mask,
    )
