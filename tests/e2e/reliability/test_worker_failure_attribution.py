"""A rank whose process dies is the one `WorkerFailure` names, even when a peer's collective error
(connection reset by the dead rank) reaches the driver first."""

import pytest
from ray.util.placement_group import remove_placement_group

from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, create_placement_group
from megarl.orchestration.worker_group import DEATH_GRACE_S, WorkerFailure, WorkerGroup

TARGET = "tests.e2e.reliability.reliability_targets:DyingPeer"


@pytest.fixture
def group():
    init_ray(num_cpus=2)
    pg = create_placement_group("dying", 2, BundleSpec(cpus=1))
    group = WorkerGroup("dying", TARGET, 2, pg, BundleSpec(cpus=1))
    yield group
    group.kill()
    remove_placement_group(pg)
    shutdown_ray()


def test_the_dead_rank_is_named_not_the_peer_that_noticed(group):
    with pytest.raises(WorkerFailure) as failure:
        group.call_all("leave_then_die", 0, DEATH_GRACE_S / 4)
    assert failure.value.rank == 0 and failure.value.pid == group.pids[0], str(failure.value)
