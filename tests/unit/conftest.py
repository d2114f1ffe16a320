"""`sandbox_backend`: a test of code run in the python tool's sandbox (the python tool's, the code reward's)
runs once per way of building the sandbox (bubblewrap, util-linux unshare), skipped with the reason where
this machine cannot build it that way."""

import pytest

import megarl.tools.builtin.python as python_tool


@pytest.fixture(params=list(python_tool.BACKENDS))
def sandbox_backend(request, monkeypatch) -> str:
    problem = python_tool.backend_problem(request.param)
    if problem is not None:  # e.g. bubblewrap not installed: CI installs it (.ci/run)
        pytest.skip(f"{request.param} cannot build the python tool's sandbox on this machine: {problem}")
    monkeypatch.setattr(python_tool, "backend", lambda: request.param)
    return request.param
