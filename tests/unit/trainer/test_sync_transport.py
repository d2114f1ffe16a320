"""`rollout.sync.transport` resolved for a placement (`megarl.trainer.roles.sync_transport`): the
shared transports only where every engine shares the sender's node."""

import pytest
import torch

from megarl.orchestration.placement import PlacementError
from megarl.trainer.roles import sync_transport

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="auto on a CPU machine")


def test_auto_streams_through_shared_memory_when_every_engine_is_on_the_senders_node():
    assert sync_transport("auto", "node-a", ["node-a", "node-a"]) == "shared_memory"


def test_auto_falls_back_to_the_collective_across_nodes():
    assert sync_transport("auto", "node-a", ["node-a", "node-b"]) == "collective"


def test_an_explicit_choice_is_kept_where_it_can_run():
    assert sync_transport("collective", "node-a", ["node-a"]) == "collective"
    assert sync_transport("shared_memory", "node-a", ["node-a"]) == "shared_memory"


def test_shared_memory_with_an_engine_on_another_node_names_the_setting_and_the_fix():
    with pytest.raises(PlacementError, match=r"rollout.sync.transport=shared_memory.*1 other node.*collective"):
        sync_transport("shared_memory", "node-a", ["node-a", "node-b", "node-b"])
