"""A tiny HF reward model and the ragged batch it scores (a plain module: the spawned ranks import it too)."""

import torch

from megarl.models.tiny import make_tiny_reward_model  # noqa: F401 - re-exported for conftest
from megarl.workers.batch import PolicyBatch

BATCH_SIZE, PROMPT_LEN, RESPONSE_LEN = 8, 6, 5


def ragged_batch() -> PolicyBatch:
    """8 samples: prompts left-padded to 6, responses right-padded to 5, with full-width rows and one
    empty response (scored at its last prompt token). Padded columns hold real token ids (never the
    pad id 0), so a wrong index or a missing mask changes the scores."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 100, (BATCH_SIZE, PROMPT_LEN), generator=gen)
    responses = torch.randint(4, 100, (BATCH_SIZE, RESPONSE_LEN), generator=gen)
    prompt_lens = torch.tensor([6, 1, 3, 6, 2, 5, 4, 1])
    response_lens = torch.tensor([5, 1, 0, 3, 5, 4, 2, 5])
    prompt_mask = torch.arange(PROMPT_LEN)[None, :] >= (PROMPT_LEN - prompt_lens)[:, None]
    response_mask = torch.arange(RESPONSE_LEN)[None, :] < response_lens[:, None]
    return PolicyBatch(prompts, prompt_mask, responses, response_mask)
