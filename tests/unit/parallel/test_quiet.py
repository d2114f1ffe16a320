"""megarl.quiet: each listed start-up warning is dropped, by its message; everything else still shows."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

from megarl import quiet


@pytest.fixture
def restored():
    """The process-wide warning filters and logger filters, as they were before the test."""
    loggers = {name: list(logging.getLogger(name).filters) for name in quiet.LOGS}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")  # nothing left out by "once per location" from earlier tests
        yield shown
    for name, filters in loggers.items():
        logging.getLogger(name).filters = filters


def messages(shown) -> list[str]:
    return [str(w.message) for w in shown]


def test_every_listed_warning_is_dropped_without_cuda_advice(restored):
    quiet.install(cuda_advice=False)
    for message, category in quiet.ALWAYS + quiet.CUDA_ADVICE:
        warnings.warn(message + " (the rest of the library's text)", category, stacklevel=1)
    assert messages(restored) == []


def test_other_warnings_and_cuda_advice_on_gpu_still_show(restored):
    quiet.install(cuda_advice=True)
    te_missing = quiet.CUDA_ADVICE[0][0] + ". Falling back to Torch optimizers."
    warnings.warn(te_missing, UserWarning, stacklevel=1)
    warnings.warn("my reward function saw an empty response", UserWarning, stacklevel=1)
    warnings.warn("full scope is deprecated", DeprecationWarning, stacklevel=1)  # a listed text, another category
    warnings.warn("use a newer megatron: " + quiet.ALWAYS[0][0], UserWarning, stacklevel=1)  # listed, not at the start
    assert messages(restored) == [
        te_missing,
        "my reward function saw an empty response",
        "full scope is deprecated",
        "use a newer megatron: " + quiet.ALWAYS[0][0],
    ]


def test_installing_twice_adds_no_filters(restored):
    quiet.install(cuda_advice=False)
    before = (list(warnings.filters), {name: len(logging.getLogger(name).filters) for name in quiet.LOGS})
    quiet.install(cuda_advice=False)
    assert (list(warnings.filters), {name: len(logging.getLogger(name).filters) for name in quiet.LOGS}) == before


def test_only_the_listed_log_message_of_a_logger_is_dropped(restored):
    quiet.install(cuda_advice=False)
    name = "ray._private.authentication.authentication_token_setup"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage()[:41] for r in records] == ["Token authentication is disabled for this"]


def test_child_processes_read_the_device_independent_filters_from_the_environment():
    listed = quiet.ALWAYS[1][0]
    code = f"import warnings; warnings.warn({listed!r}, FutureWarning); warnings.warn('kept', FutureWarning)"
    env = {**os.environ, "PYTHONWARNINGS": quiet.python_warnings()}
    stderr = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    assert "kept" in stderr and listed not in stderr and "Invalid -W option" not in stderr
