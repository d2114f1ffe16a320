"""Fixtures of the rollout tests: two tiny Qwen2 checkpoints with different weights.

`initializer_range=0.2` (HF's default is 0.02) makes the random models' next-token distributions
far from uniform, so greedy decoding has clear winners and the two models clearly differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_base"), "qwen2", seed=0, initializer_range=0.2)


@pytest.fixture(scope="session")
def new_model_dir(tmp_path_factory) -> Path:
    """Same architecture, other weights: what a weight sync replaces the base with."""
    return make_tiny_model(tmp_path_factory.mktemp("rollout_new"), "qwen2", seed=1, initializer_range=0.2)
