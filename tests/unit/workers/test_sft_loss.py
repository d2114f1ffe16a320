"""The SFT objective: the step's mean NLL over loss-masked tokens, whatever the micro-batching; and the
batch layout it reads (one-token prompt, the rest as the response, the loss mask aligned to it)."""

import torch

from megarl.data.sft import SftSample
from megarl.trainer.sft import sft_policy_batch
from megarl.workers.megatron_train import StepCounts
from megarl.workers.sft_worker import NllLoss


def test_micro_batches_add_up_to_the_mean_nll_of_the_step():
    generator = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(6, 9, generator=generator) * 3
    mask = torch.rand(6, 9, generator=generator) > 0.4
    mask[:2, 5:] = False  # micro-batches with different token counts: a mean of micro-batch means would differ
    samples = [SftSample(f"f:{row}", tuple(range(10)), (False,) + tuple(mask[row].tolist())) for row in range(6)]
    batch = sft_policy_batch(samples, pad_id=0)
    assert torch.equal(batch.response_mask, mask)
    tokens = mask.sum().float()
    counts = StepCounts(normalizer=tokens, tokens=tokens, sequences=torch.tensor(6.0))
    loss_fn = NllLoss()
    step_mean = -log_probs[mask].mean()
    for parts in (1, 2, 3, 6):
        rows = torch.arange(6).chunk(parts)
        total = sum(loss_fn(log_probs[r], torch.zeros_like(log_probs[r]), batch.select(r), counts)[0] for r in rows)
        torch.testing.assert_close(total, step_mean)
    micro_means = torch.stack([-log_probs[r][mask[r]].mean() for r in torch.arange(6).chunk(3)]).mean()
    assert not torch.isclose(micro_means, step_mean)


def test_the_batch_predicts_every_token_after_the_first_with_the_loss_mask_aligned():
    short = SftSample("a:1", (5, 6, 7), (False, True, True))
    long = SftSample("a:2", (8, 9, 10, 11, 12), (False, False, True, False, True))
    batch = sft_policy_batch([short, long], pad_id=0)
    assert batch.prompts.tolist() == [[5], [8]] and batch.prompt_mask.all()
    assert batch.responses.tolist() == [[6, 7, 0, 0], [9, 10, 11, 12]]
    assert batch.response_mask.tolist() == [[True, True, False, False], [False, True, False, True]]
