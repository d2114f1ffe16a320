"""The HF reward-model checkpoint form: a `*ForSequenceClassification` with one label.

Such a checkpoint holds the decoder backbone under the causal LM's names (`model.*`, loaded by
`megarl.models.checkpoint.load_hf_weights`) and, in place of `lm_head.weight`, the scalar head
`score.weight` `[1, H]`, which becomes the Megatron `ValueHead` (`output_layer.weight`).
No torch.distributed: every rank reads and checks the head before building its model, so a bad
checkpoint fails everywhere before the first collective.

    weight = read_score_weight("/ckpt/rm")          # [1, H]
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.models.hf_checkpoint import HFCheckpoint
from megarl.models.hf_config import load_hf_config, read_model_dims

SCORE_WEIGHT = "score.weight"
"""HF name of the sequence-classification head (`nn.Linear(hidden, num_labels, bias=False)`)."""


def read_score_weight(model_dir: str | Path) -> torch.Tensor:
    """The scalar head `[1, H]` (fp32) of an HF reward-model checkpoint dir.

    Raises ValueError naming the file when config.json does not have exactly one label or the
    weights have no `score.weight` of shape `[1, hidden_size]`.
    """
    model_dir = Path(model_dir)
    checkpoint = HFCheckpoint(model_dir)
    if SCORE_WEIGHT not in checkpoint.shapes:
        raise ValueError(
            f"{model_dir}: no {SCORE_WEIGHT!r} among the checkpoint's tensors, so it is not a reward model "
            "(a causal LM has lm_head.weight instead); point it at a *ForSequenceClassification checkpoint "
            "with num_labels=1"
        )
    labels = num_labels(load_hf_config(model_dir))
    if labels != 1:
        raise ValueError(
            f"{model_dir / 'config.json'}: a reward model needs num_labels=1 (one scalar per sequence), "
            f"got {labels}; save the *ForSequenceClassification model with num_labels=1"
        )
    hidden_size = read_model_dims(model_dir).hidden_size
    checkpoint.require(SCORE_WEIGHT, (1, hidden_size))
    with checkpoint.reader() as read:
        return read(SCORE_WEIGHT, (slice(None), slice(None))).float()


def num_labels(config: dict) -> int:
    """transformers' `PretrainedConfig.num_labels` of a config.json dict: its `id2label` entries when
    present (that is how it is saved), else an explicit `num_labels`, else transformers' default 2."""
    if "id2label" in config:
        return len(config["id2label"])
    return int(config.get("num_labels", 2))
