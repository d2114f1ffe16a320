"""The small batch the micro-batch layout tests cut: it has left padding, a hole in a response, and an
empty response."""

import torch

from megarl.workers.batch import PolicyBatch


def three_samples() -> PolicyBatch:
    """Prompts of 3, 1, 2 real tokens (left-padded to 3); responses counting 2, 1 (+ a hole), 0 tokens."""
    return PolicyBatch(
        prompts=torch.tensor([[11, 12, 13], [0, 0, 21], [0, 31, 32]]),
        prompt_mask=torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]], dtype=torch.bool),
        responses=torch.tensor([[14, 15, 0], [22, 23, 24], [33, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]], dtype=torch.bool),
    )
