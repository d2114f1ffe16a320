"""Fixtures of the reliability tests: one tiny workspace (model, data, recipe) for the whole session."""

import pytest
from reliability_job import make_workspace


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """Read-only for the tests: each job writes under its own run dir."""
    return make_workspace(tmp_path_factory.mktemp("reliability-workspace"))


@pytest.fixture
def jobs():
    """Jobs a test starts (`reliability_job.Job`); whatever they left behind is killed after the test."""
    started = []
    yield started
    for job in started:
        job.cleanup()
