"""Where validation and the memory estimate find the model's dimensions (`megarl.models.hf_config.ModelDims`):
its config.json, read by the model builder's own reader.

`model.path` may be a local HF checkpoint directory or a hub id `org/name`. For a hub id the config.json comes
from the local HF cache if the checkpoint was downloaded (megarl.config.hub), else from `KNOWN_MODELS`
(published values of common checkpoints), so recipes for real models validate with `--no-file-checks`
on a machine that has never downloaded them. Nothing is downloaded and no weights are read.
"""

import os
from pathlib import Path

from megarl.config.hub import cached_snapshot, download_command, is_hub_id
from megarl.config.resources import local_path, unusable_path
from megarl.models.arch import supported_model_types
from megarl.models.hf_config import ModelDims, read_model_dims

KNOWN_SOURCE = "megarl known models table"
"""The source `load_model_dims` names for a model of `KNOWN_MODELS`."""


class ModelFactsError(Exception):
    """The model's dimensions cannot be found; `why` and `fix` are shown to the user."""

    def __init__(self, why: str, fix: str):
        super().__init__(why)
        self.why, self.fix = why, fix


def _published(model_type: str, heads: int, kv_heads: int, layers: int, hidden: int, ffn: int, **config) -> ModelDims:
    """The dims of a checkpoint from the keys of its published config.json, read as megarl reads a downloaded one
    (`vocab_size`, `max_position_embeddings`, `rms_norm_eps`, `rope_theta` and the rest come as `config`)."""
    return read_model_dims(
        dict(
            model_type=model_type,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=ffn,
            initializer_range=0.02,
            **config,
        )
    )


_QWEN_VOCAB, _QWEN_BIG_VOCAB = 151936, 152064
_LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

KNOWN_MODELS: dict[str, ModelDims] = {
    "Qwen/Qwen2.5-0.5B-Instruct": _published(
        "qwen2", 14, 2, 24, 896, 4864, vocab_size=_QWEN_VOCAB, max_position_embeddings=32768,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": _published(
        "qwen2", 12, 2, 28, 1536, 8960, vocab_size=_QWEN_VOCAB, max_position_embeddings=32768,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen2.5-3B-Instruct": _published(
        "qwen2", 16, 2, 36, 2048, 11008, vocab_size=_QWEN_VOCAB, max_position_embeddings=32768,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen2.5-7B": _published(
        "qwen2", 28, 4, 28, 3584, 18944, vocab_size=_QWEN_BIG_VOCAB, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen2.5-7B-Instruct": _published(
        "qwen2", 28, 4, 28, 3584, 18944, vocab_size=_QWEN_BIG_VOCAB, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen2.5-Math-7B": _published(
        "qwen2", 28, 4, 28, 3584, 18944, vocab_size=_QWEN_BIG_VOCAB, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1e4,
    ),
    "Qwen/Qwen2.5-32B": _published(
        "qwen2", 40, 8, 64, 5120, 27648, vocab_size=_QWEN_BIG_VOCAB, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=1e6,
    ),
    "Qwen/Qwen3-0.6B": _published(
        "qwen3", 16, 8, 28, 1024, 3072, head_dim=128, vocab_size=_QWEN_VOCAB, max_position_embeddings=40960,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen3-8B": _published(
        "qwen3", 32, 8, 36, 4096, 12288, head_dim=128, vocab_size=_QWEN_VOCAB, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1e6,
    ),
    "Qwen/Qwen3-30B-A3B": _published(
        "qwen3_moe", 32, 4, 48, 2048, 6144, head_dim=128, vocab_size=_QWEN_VOCAB, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1e6, num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
        norm_topk_prob=True, router_aux_loss_coef=0.001,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": _published(
        "llama", 32, 8, 32, 4096, 14336, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=_LLAMA3_ROPE,
    ),
}  # fmt: skip
"""Hub id -> dims from the checkpoint's published config.json, for validating without a download."""


def load_model_dims(path: str) -> tuple[ModelDims, str]:
    """The dims of the model at `path` (local directory or hub id) and where they were read (a config.json path or
    `KNOWN_SOURCE`); raises `ModelFactsError` if not found."""
    if not path:
        raise ModelFactsError("model.path is required", "set model.path to an HF checkpoint directory or hub id")
    local = local_path(path)
    if os.path.isfile(local):
        raise ModelFactsError(
            f"{local} is a file, not a directory",
            "point model.path at the directory that holds config.json and the safetensors",
        )
    if os.path.exists(local):
        config_json = local / "config.json"
        if not os.path.isfile(config_json):
            raise ModelFactsError(
                f"{local} has no config.json, so it is not an HF checkpoint directory",
                "point model.path at the directory that holds config.json and the safetensors",
            )
        return read_config_json(config_json), str(config_json)
    if is_hub_id(path):
        snapshot = cached_snapshot(path)
        if snapshot is not None:
            return read_config_json(snapshot / "config.json"), str(snapshot / "config.json")
        if path in KNOWN_MODELS:
            return KNOWN_MODELS[path], KNOWN_SOURCE
        raise ModelFactsError(
            f"{path} is not a local directory, and as a hub id it is neither in the local HF cache nor in megarl's "
            "table of known models",
            "point model.path at an existing HF checkpoint directory (relative paths start at the working directory; "
            f"the quickstart makes one with `megarl init-tiny-model`), or download the model first "
            f"(`{download_command(path)}`)",
        )
    unusable = unusable_path(path)
    raise ModelFactsError(
        unusable or f"directory {local} does not exist",
        "set model.path to an existing HF checkpoint directory (or create it first, e.g. with "
        "`megarl init-tiny-model` for the quickstart)",
    )


def read_config_json(config_json: Path) -> ModelDims:
    """Dims from an HF config.json, checked by the model builder's own reader (megarl.models.hf_config):
    a checkpoint that validates here is one megarl can build. Raises `ModelFactsError` naming the file."""
    try:
        return read_model_dims(config_json)
    except (OSError, ValueError) as error:
        raise ModelFactsError(
            f"{config_json}: {error}",
            f"use a checkpoint of a supported architecture ({', '.join(supported_model_types())}) "
            "with a complete config.json",
        ) from error
