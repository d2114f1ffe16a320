"""Which backend builds the python tool's sandbox (bubblewrap where `bwrap` is on PATH and works, else
util-linux `unshare`), and what happens where neither can: the run is refused unless the user allows the
code to run unsandboxed, which `megarl validate` warns about."""

import logging
import shutil
from pathlib import Path

import pytest

import megarl.tools.builtin.python as python_tool
from megarl.cli.main import main
from megarl.config.rollout import MultiTurnConfig, PythonToolConfig, ToolConfig
from megarl.tools import ToolCall, ToolError, ToolSet

INSTALLED = {executable: shutil.which(executable) for executable, _ in python_tool.BACKENDS.values()}
"""Where this machine has bubblewrap's and util-linux's programs (None: not installed)."""


@pytest.fixture
def path_dir(tmp_path, monkeypatch) -> Path:
    """An empty directory that is the whole PATH, the backends' probes forgotten before and after."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", str(directory))
    probe_afresh()
    yield directory
    probe_afresh()


def probe_afresh() -> None:
    python_tool.backend.cache_clear()
    python_tool.backend_problem.cache_clear()


def test_bubblewrap_builds_the_sandbox_where_it_works_else_unshare(path_dir):
    for executable, path in INSTALLED.items():
        if path is None:
            pytest.skip(f"`{executable}` is not installed on this machine (CI installs it: .ci/run)")
        (path_dir / executable).symlink_to(path)
    if python_tool.backend_problem("bubblewrap") is not None:
        pytest.skip(f"bubblewrap cannot build the sandbox here: {python_tool.backend_problem('bubblewrap')}")
    assert python_tool.backend() == "bubblewrap"

    (path_dir / "bwrap").unlink()
    probe_afresh()
    assert python_tool.backend() == "unshare"
    assert python_tool.backend_problem("bubblewrap") == "no `bwrap` on PATH"

    # A bwrap that cannot build namespaces (as where the kernel refuses user namespaces): probed, passed over.
    (path_dir / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    (path_dir / "bwrap").chmod(0o755)
    probe_afresh()
    assert python_tool.backend() == "unshare"
    assert python_tool.backend_problem("bubblewrap") == "bwrap: No permissions to creating new namespace"
    sandboxed = python_tool.python(f"import os\nprint(os.getcwd(), os.path.exists({str(path_dir)!r}))")
    assert sandboxed == "/tmp False"  # the host's directory out of view: still sandboxed


def test_without_a_sandbox_the_python_tool_is_refused_unless_allowed(path_dir, tmp_path):
    # A machine with neither `bwrap` nor `unshare`: the run stops at start naming the key that allows it.
    tools = (ToolConfig(function="calculator"), ToolConfig(function="python"))
    with pytest.raises(
        ToolError,
        match=r"tools\[1\]\.function = 'python': this machine cannot run model-written code "
        r"in its sandbox \(bubblewrap: no `bwrap` on PATH; unshare: no `unshare` on PATH\).*unsafe_no_sandbox: true",
    ):
        ToolSet(MultiTurnConfig(enable=True, tools=tools))
    allowed = MultiTurnConfig(enable=True, tools=tools, python_tool=PythonToolConfig(unsafe_no_sandbox=True))
    with ToolSet(allowed) as toolset:
        toolset.wait_ready()
        [result] = toolset.run([ToolCall("python", {"code": f"import os\nprint(os.path.exists({str(tmp_path)!r}))"})])
    assert result.text == "True"  # it ran, unsandboxed: the host's files are in view


def test_the_sandbox_is_used_where_it_works_whatever_the_setting(tmp_path, caplog):
    allowed = MultiTurnConfig(
        enable=True, tools=(ToolConfig(function="python"),), python_tool=PythonToolConfig(unsafe_no_sandbox=True)
    )
    with caplog.at_level(logging.INFO, logger="megarl.tools.toolset"), ToolSet(allowed) as toolset:
        toolset.wait_ready()
        code = f"import os\nprint(os.getcwd(), os.path.exists({str(tmp_path)!r}))"
        [result] = toolset.run([ToolCall("python", {"code": code})])
    assert result.text == "/tmp False"
    # The start-up line names the backend in use (bubblewrap where installed: .ci/run installs it).
    assert caplog.messages == [f"the python tool runs model-written code in a sandbox built by {python_tool.backend()}"]


def test_validate_warns_when_the_sandbox_may_be_skipped(capsys):
    recipe = str(Path(__file__).parents[3] / "configs" / "agent_quickstart.yaml")
    assert main(["validate", "--no-file-checks", recipe]) == 0
    assert warning_lines(capsys.readouterr().out) == []
    assert main(["validate", "--no-file-checks", recipe, "rollout.multi_turn.python_tool.unsafe_no_sandbox=true"]) == 0
    assert warning_lines(capsys.readouterr().out) == [
        "warning: rollout.multi_turn.python_tool.unsafe_no_sandbox is true: where this machine cannot "
        "sandbox the python tool, model-written code runs with your rights (your files, other "
        "processes' secrets, the network)"
    ]


def warning_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning: ")]
