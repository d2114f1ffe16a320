"""`rollout.min_new_tokens` reaches both engines: the trainer's sampling settings carry it (training and
validation), vLLM gets it as `SamplingParams.min_tokens` (vllm/sampling_params.py; its min-tokens logits
processor masks every stop token, `vllm/v1/sample/logits_processor/builtin.py: MinTokensLogitsProcessor`),
never above a turn's own cap, and the HF engine's samples run at least that long. The vLLM engine's
behaviour is checked on a real engine in tests/e2e/rollout/test_rollout_vllm_tp1.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loader import load_config
from megarl.models.tiny import make_tiny_model
from megarl.trainer.settings import sampling_config
from megarl.workers.rollout import SamplingConfig
from megarl.workers.rollout.hf_engine import HFRolloutEngine
from megarl.workers.rollout.vllm_engine import _sampling_params

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


@pytest.mark.parametrize("validation", [False, True])
def test_the_setting_reaches_the_sampling_of_training_and_validation(validation):
    config = load_config(QUICKSTART, ["rollout.max_new_tokens=16", "rollout.min_new_tokens=6"])
    assert sampling_config(config, (0,), seed=1, validation=validation).min_new_tokens == 6


def test_vllm_gets_min_tokens_capped_by_the_turn():
    sampling = SamplingConfig(max_new_tokens=16, min_new_tokens=6, stop_token_ids=(0,))
    assert _sampling_params(sampling, seed=1, max_new_tokens=16).min_tokens == 6
    # A multi-turn call whose remaining budget is below the minimum: vLLM refuses min_tokens > max_tokens.
    assert _sampling_params(sampling, seed=1, max_new_tokens=3).min_tokens == 3


def test_hf_engine_samples_run_at_least_min_new_tokens(tmp_path):
    engine = HFRolloutEngine(make_tiny_model(tmp_path / "model"), dtype="float32")
    stops, shortest = tuple(range(10, 60)), 5  # half the vocabulary: unconstrained, most samples stop at once
    sampling = SamplingConfig(n=4, max_new_tokens=8, stop_token_ids=stops, seed=3)
    free = engine.generate([[5, 6, 7]], sampling)[0].response_token_ids
    held = engine.generate([[5, 6, 7]], SamplingConfig(**{**vars(sampling), "min_new_tokens": shortest}))[0]
    assert min(map(len, free)) < shortest
    assert all(
        len(tokens) >= shortest and not any(t in stops for t in tokens[:-1]) for tokens in held.response_token_ids
    )
