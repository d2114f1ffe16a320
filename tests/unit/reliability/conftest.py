"""Fixtures of the start-up checks of `megarl train`."""

import pytest


class _RayWouldStart(Exception):
    pass


@pytest.fixture
def ray_refused(monkeypatch):
    """The trainer's `init_ray` raises: a start-up check that lets a bad input through fails the test at
    once instead of starting Ray and vLLM. (`megarl train`'s early start is a no-op here: these checks
    come before the trainer uses Ray, whether or not its node is starting meanwhile.
    tests/unit/reliability/test_reliability_cli_inputs.py keeps one bad-data case with the real early start.)"""
    import megarl.orchestration.cluster as cluster
    import megarl.trainer.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise _RayWouldStart

    monkeypatch.setattr(trainer_module, "init_ray", refuse)
    monkeypatch.setattr(cluster, "start_ray_early", lambda *args, **kwargs: None)
