"""The capability table (`megarl.config.engines`) is the one list of rollout backends: the config's
`rollout.backend` choices match it, and the factory refuses what a backend's row says it cannot do,
before any model loads."""

import typing

import pytest

from megarl.config.engines import ENGINES, engine_capabilities
from megarl.config.rollout import RolloutConfig
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.rollout.factory import make_rollout_engine


def test_the_config_offers_exactly_the_backends_with_capabilities():
    choices = typing.get_args(typing.get_type_hints(RolloutConfig)["backend"])
    assert sorted(choices) == sorted(ENGINES)


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match=r"'sglang' names no rollout engine; use one of \['hf', 'vllm'\]"):
        engine_capabilities("sglang")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (EngineArgs("/no/model", tensor_parallel_size=2), r"'hf' runs at most TP 1: tensor_parallel_size=2"),
        (EngineArgs("/no/model", expert_parallel=True), r"'hf' has no expert parallelism"),
    ],
)
def test_the_factory_refuses_what_the_hf_row_rules_out_before_loading(args, message):
    # /no/model does not exist: reaching the engine would fail differently, so the match proves the refusal came first
    with pytest.raises(ValueError, match=message):
        make_rollout_engine("hf", args)
