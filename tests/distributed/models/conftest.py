"""Tiny HF checkpoints shared by the distributed model tests (made once per session, no downloads).

Weights are made "sharp" on purpose: random init at std 0.02 with unit norms and zero biases gives
near-uniform attention, which would hide a q/k/v, q_norm/k_norm or bias mix-up from a logits check.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models.tiny import make_tiny_model

# Each model has GQA with 2 KV groups per TP rank at TP=2 and a vocab of 100 (padded to 128 / 256).
TINY_MODELS = {
    # head_dim * heads (256) != hidden; llama3 RoPE scaling; untied.
    "llama": dict(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_hidden_layers=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    # q/k/v biases; tied embeddings.
    "qwen2": dict(
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
    # q/k norms, head_dim * heads != hidden, 2 layers per stage at PP=2.
    "qwen3": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_hidden_layers=4),
}


def sharpen(model_dir, seed: int = 0) -> None:
    """Rewrite a checkpoint with norms ~ 1 ± 0.3 and biases ~ N(0, 0.5) (matrices keep their init)."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1 + 0.3 * torch.randn(t.shape, generator=gen)
        elif name.endswith(".bias"):
            tensors[name] = 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """arch -> checkpoint dir of a sharpened tiny model."""
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for seed, (arch, overrides) in enumerate(TINY_MODELS.items()):
        dirs[arch] = make_tiny_model(root / arch, arch, seed=seed, initializer_range=0.1, **overrides)
        sharpen(dirs[arch], seed)
    return dirs
