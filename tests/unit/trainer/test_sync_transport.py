"""`rollout.sync.transport` resolved for a placement (`megarl.trainer.roles.sync_transport`): the
shared transports only where every engine shares the sender's node; and `rollout.sync.per_rank`
resolved for that transport (`per_rank_sync`)."""

from pathlib import Path

import pytest

from megarl.orchestration.placement import PlacementError

from megarl.config import load_config
from megarl.trainer.roles import per_rank_sync, sync_transport

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_auto_streams_through_shared_memory_when_every_engine_is_on_the_senders_node():
    assert sync_transport("auto", "cpu", "node-a", ["node-a", "node-a"]) == "shared_memory"


def test_auto_falls_back_to_the_collective_across_nodes_and_on_cuda():
    assert sync_transport("auto", "cpu", "node-a", ["node-a", "node-b"]) == "collective"
    assert sync_transport("auto", "cuda", "node-a", ["node-a", "node-a"]) == "collective"


def test_an_explicit_choice_is_kept_where_it_can_run():
    assert sync_transport("collective", "cpu", "node-a", ["node-a"]) == "collective"
    assert sync_transport("shared_memory", "cpu", "node-a", ["node-a"]) == "shared_memory"


def test_shared_memory_with_an_engine_on_another_node_names_the_setting_and_the_fix():
    with pytest.raises(PlacementError, match=r"rollout.sync.transport=shared_memory.*1 other node.*collective"):
        sync_transport("shared_memory", "cpu", "node-a", ["node-a", "node-b", "node-b"])


def _config(*overrides: str):
    return load_config(QUICKSTART, list(overrides))


TP_1 = "actor.parallel.tensor_model_parallel_size=1"  # the quickstart's actor TP 2 → rollout TP 1 gathers


def test_auto_sends_per_rank_over_a_shared_transport_when_the_tp_sizes_match():
    assert per_rank_sync(_config(TP_1), "shared_memory")
    assert not per_rank_sync(_config(TP_1), "collective")
    assert not per_rank_sync(_config(TP_1, "rollout.backend=hf"), "shared_memory")
    assert not per_rank_sync(_config(TP_1, "rollout.sync.per_rank=never"), "shared_memory")


def test_auto_gathers_when_the_tp_sizes_differ():
    assert not per_rank_sync(_config(), "shared_memory")


def test_per_rank_on_with_engines_beyond_the_senders_node_names_the_setting_and_the_fix():
    with pytest.raises(PlacementError, match=r"rollout.sync.per_rank=always.*by collective.*per_rank: auto"):
        per_rank_sync(_config(TP_1, "rollout.sync.per_rank=always"), "collective")
