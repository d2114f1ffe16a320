"""The facts about the model that validation and the memory estimate need (heads, KV groups, layers, widths),
read from config.json.

`model.path` may be a local HF checkpoint directory or a hub id `org/name`. For a hub id the facts come
from the local HF cache if the checkpoint was downloaded (megarl.config.hub), else from `KNOWN_MODELS`
(published values of common checkpoints), so recipes for real models validate with `--no-file-checks`
on a machine that has never downloaded them. Nothing is downloaded and no weights are read.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from megarl.config.hub import cached_snapshot, download_command, is_hub_id
from megarl.config.resources import local_path, unusable_path
from megarl.models.arch import supported_model_types
from megarl.models.hf_config import read_model_dims


@dataclass(frozen=True)
class ModelFacts:
    """Shape facts of a causal LM, as in its HF config.json."""

    model_type: str
    """HF `model_type`, one registered in `megarl.models.arch`."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (query groups); equal to num_attention_heads without GQA."""
    num_hidden_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    vocab_size: int
    """Vocabulary size (before Megatron's padding)."""
    max_position_embeddings: int
    """Longest sequence (prompt + response) the model supports."""
    ffn_hidden_size: int
    """MLP intermediate size (`intermediate_size`; gate and up each have this many rows)."""
    head_dim: int
    """Width of one attention head."""
    tie_word_embeddings: bool
    """The output layer is the embedding (no separate output weight)."""
    source: str
    """Where the facts were read: a config.json path or `megarl known models table`."""
    num_experts: int = 0
    """Routed experts per layer (`num_experts`, Qwen3-MoE); 0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    """One expert's intermediate size (`moe_intermediate_size`); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (`num_experts_per_tok`, top-k); 0 for a dense model."""


class ModelFactsError(Exception):
    """The model's facts cannot be found; `why` and `fix` are shown to the user."""

    def __init__(self, why: str, fix: str):
        super().__init__(why)
        self.why, self.fix = why, fix


def _known(
    model_type, heads, kv_heads, layers, hidden, vocab, max_positions, ffn, head_dim, tied, experts=(0, 0, 0)
) -> ModelFacts:
    """`experts`: (num_experts, moe_intermediate_size, num_experts_per_tok) of a mixture of experts."""
    return ModelFacts(
        model_type,
        heads,
        kv_heads,
        layers,
        hidden,
        vocab,
        max_positions,
        ffn,
        head_dim,
        tied,
        "megarl known models table",
        *experts,
    )


KNOWN_MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct": _known("qwen2", 14, 2, 24, 896, 151936, 32768, 4864, 64, True),
    "Qwen/Qwen2.5-1.5B-Instruct": _known("qwen2", 12, 2, 28, 1536, 151936, 32768, 8960, 128, True),
    "Qwen/Qwen2.5-3B-Instruct": _known("qwen2", 16, 2, 36, 2048, 151936, 32768, 11008, 128, True),
    "Qwen/Qwen2.5-7B": _known("qwen2", 28, 4, 28, 3584, 152064, 131072, 18944, 128, False),
    "Qwen/Qwen2.5-7B-Instruct": _known("qwen2", 28, 4, 28, 3584, 152064, 32768, 18944, 128, False),
    "Qwen/Qwen2.5-Math-7B": _known("qwen2", 28, 4, 28, 3584, 152064, 4096, 18944, 128, False),
    "Qwen/Qwen2.5-32B": _known("qwen2", 40, 8, 64, 5120, 152064, 131072, 27648, 128, False),
    "Qwen/Qwen3-0.6B": _known("qwen3", 16, 8, 28, 1024, 151936, 40960, 3072, 128, True),
    "Qwen/Qwen3-8B": _known("qwen3", 32, 8, 36, 4096, 151936, 40960, 12288, 128, False),
    "Qwen/Qwen3-30B-A3B": _known("qwen3_moe", 32, 4, 48, 2048, 151936, 40960, 6144, 128, False, (128, 768, 8)),
    "meta-llama/Llama-3.1-8B-Instruct": _known("llama", 32, 8, 32, 4096, 128256, 131072, 14336, 128, False),
}
"""Hub id -> facts from the checkpoint's published config.json, for validating without a download."""


def load_model_facts(path: str) -> ModelFacts:
    """Facts of the model at `path` (local directory or hub id); raises `ModelFactsError` if not found."""
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
        return read_config_json(config_json)
    if is_hub_id(path):
        snapshot = cached_snapshot(path)
        if snapshot is not None:
            return read_config_json(snapshot / "config.json")
        if path in KNOWN_MODELS:
            return KNOWN_MODELS[path]
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


def read_config_json(config_json: Path) -> ModelFacts:
    """Facts from an HF config.json, checked by the model builder's own reader (megarl.models.hf_config):
    a checkpoint that validates here is one megarl can build. Raises `ModelFactsError` naming the file."""
    try:
        dims = read_model_dims(config_json)
    except (OSError, ValueError) as error:
        raise ModelFactsError(
            f"{config_json}: {error}",
            f"use a checkpoint of a supported architecture ({', '.join(supported_model_types())}) "
            "with a complete config.json",
        ) from error
    return ModelFacts(
        dims.model_type,
        dims.num_attention_heads,
        dims.num_kv_heads,
        dims.num_layers,
        dims.hidden_size,
        dims.vocab_size,
        dims.max_position_embeddings,
        dims.ffn_hidden_size,
        dims.head_dim,
        dims.tie_word_embeddings,
        str(config_json),
        dims.num_experts,
        dims.moe_ffn_hidden_size,
        dims.num_experts_per_tok,
    )
