"""A tiny checkpoint, a batch with ragged prompts/responses, and HF's log-probs on it (the ground truth)."""

import pytest
import torch
from worker_batches import BATCH_SIZE, RESPONSE_LEN, ragged_batch

from megarl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Qwen2 (q/k/v biases, GQA 4 heads / 2 KV groups, untied, vocab 100) with a wide init: sharp
    attention, so an attention-mask mistake shows in the log-probs."""
    return make_tiny_model(tmp_path_factory.mktemp("workers") / "qwen2", "qwen2", initializer_range=0.2)


@pytest.fixture(scope="session")
def hf_reference(tiny_qwen2):
    """HF transformers log-probs and full-vocabulary entropy `[B, R]` of `ragged_batch()`, each
    sample run alone without padding (0 at padded positions)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    batch = ragged_batch()
    log_probs = torch.zeros(BATCH_SIZE, RESPONSE_LEN)
    entropy = torch.zeros(BATCH_SIZE, RESPONSE_LEN)
    with torch.no_grad():
        for i in range(BATCH_SIZE):
            prompt = batch.prompts[i][batch.prompt_mask[i]]
            response = batch.responses[i][batch.response_mask[i]]
            logits = model(torch.cat([prompt, response])[None]).logits[0]
            log_softmax = logits[len(prompt) - 1 : -1].log_softmax(-1)
            log_probs[i, : len(response)] = log_softmax.gather(-1, response[:, None])[:, 0]
            entropy[i, : len(response)] = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy
