"""A tiny HF checkpoint shared by the unit model tests (read-only: tests copy it before changing it)."""

import pytest

from megarl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", num_hidden_layers=4)
