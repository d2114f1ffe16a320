"""The scripts in benchmarks/ import from megarl inside their functions, and no test runs them (they take
minutes): a name they import that megarl renamed or removed would surface only when someone profiles. Issue 30's
removal of `OptimSettings` left two of them importing it. This resolves every `from megarl... import name`
they hold, without running them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _megarl_imports(script: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each `from megarl... import name` anywhere in `script`."""
    tree = ast.parse(script.read_text(), filename=str(script))
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megarl"
        for alias in node.names
    ]


def test_the_benchmark_scripts_are_found():
    assert len(SCRIPTS) >= 5, f"expected the benchmark scripts in {BENCHMARKS}, found {SCRIPTS}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_megarl_name_a_benchmark_script_imports_exists(script):
    missing = []
    for line, module, name in _megarl_imports(script):
        imported = importlib.import_module(module)
        if not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{script.name}:{line}: from {module} import {name}")
    assert not missing, "names megarl no longer has (rename them in the script):\n" + "\n".join(missing)
