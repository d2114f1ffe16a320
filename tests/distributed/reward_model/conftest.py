"""A tiny reward model, a causal LM and a two-label classifier (both rejected), and HF's scores."""

import pytest
import torch
from reward_model_helpers import BATCH_SIZE, make_tiny_reward_model, ragged_batch

from megarl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    """Qwen2 reward model (q/k/v biases, GQA, vocab 100) with a wide init: sharp attention and scores
    of order 1, so an attention-mask or last-token mistake shows in the scores."""
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "qwen2", "qwen2", initializer_range=0.2)


@pytest.fixture(scope="session")
def not_reward_models(tmp_path_factory):
    """name -> checkpoint dir that `MegatronRewardModel.from_hf` must reject."""
    root = tmp_path_factory.mktemp("not_rm")
    return {
        "causal_lm": str(make_tiny_model(root / "lm", "qwen2")),
        "two_labels": str(make_tiny_reward_model(root / "two_labels", "qwen2", num_labels=2)),
    }


@pytest.fixture(scope="session")
def hf_scores(tiny_reward_model):
    """`[B]` HF `AutoModelForSequenceClassification` scores of `ragged_batch()`, each sample run alone
    without padding (its real prompt tokens, then its kept response tokens)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model, dtype=torch.float32).eval()
    batch = ragged_batch()
    scores = torch.zeros(BATCH_SIZE)
    with torch.no_grad():
        for i in range(BATCH_SIZE):
            tokens = torch.cat([batch.prompts[i][batch.prompt_mask[i]], batch.responses[i][batch.response_mask[i]]])
            scores[i] = model(tokens[None]).logits[0, 0]
    return scores
