"""The capability table (`megarl.config.engines`) is the one list of rollout backends: the config's
`rollout.backend` choices match it, the factory refuses what a backend's row says it cannot do,
before any model loads, and an engine class's weight-source loaders are the kinds its row declares
(`RolloutEngine.receive`; the engines themselves: tests/e2e/rollout/test_engine_contract.py)."""

import typing

import pytest

from megarl.bridge import CollectivePlan, InProcessTensors, RankRings, SharedRings
from megarl.config.engines import ENGINES, engine_capabilities
from megarl.config.rollout import RolloutConfig
from megarl.workers.rollout.base import RolloutEngine
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


def _loader(engine, source):
    raise AssertionError("not called: the class is refused where it is defined")


@pytest.mark.parametrize(
    ("loaders", "loads"),
    [
        # 'hf' declares per_rank_load=False: a per-rank loader is one it does not declare.
        (
            [InProcessTensors, SharedRings, CollectivePlan, RankRings],
            "['CollectivePlan', 'InProcessTensors', 'RankRings', 'SharedRings']",
        ),
        # Every engine takes the sync group's plan.
        ([InProcessTensors, SharedRings], "['InProcessTensors', 'SharedRings']"),
    ],
)
def test_an_engine_class_whose_loaders_disagree_with_its_capabilities_is_refused_where_defined(loaders, loads):
    with pytest.raises(TypeError) as refused:
        type("HalfEngine", (RolloutEngine,), {"backend": "hf", "_loaders": dict.fromkeys(loaders, _loader)})
    assert str(refused.value) == (
        f"HalfEngine (rollout backend 'hf') loads {loads}, its capabilities in megarl/config/engines.py declare "
        "['CollectivePlan', 'InProcessTensors', 'SharedRings']: give it a loader per declared kind (`_loaders`) "
        "or correct its capabilities"
    )


def test_an_engine_class_whose_loaders_match_its_capabilities_is_defined():
    kinds = [InProcessTensors, SharedRings, CollectivePlan]
    engine = type("HfLike", (RolloutEngine,), {"backend": "hf", "_loaders": dict.fromkeys(kinds, _loader)})
    assert set(engine._loaders) == set(kinds)
