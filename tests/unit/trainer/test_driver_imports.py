"""The driver process (`megarl train` / `megarl sft` before the workers start) loads neither
megatron-core nor vLLM: only the worker processes build models and engines. Importing megatron.core
alone takes ~2.4 s of the driver's start-up (issue 19, launch to first step), and it came in only
through the plain settings the driver hands the workers (now `megarl.workers.settings`)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[3] / "megarl"
DRIVER_MUST_NOT_IMPORT = ("megatron", "vllm")


def _run_imports(cli_file: Path) -> set[str]:
    """The modules a CLI command's functions import (lazily, inside them)."""
    functions = [node for node in ast.parse(cli_file.read_text()).body if isinstance(node, ast.FunctionDef)]
    return {node.module for function in functions for node in ast.walk(function) if isinstance(node, ast.ImportFrom)}


def _function_imports(cli_file: Path, name: str) -> set[str]:
    """The modules one function of a CLI file imports."""
    function = next(
        node for node in ast.parse(cli_file.read_text()).body if isinstance(node, ast.FunctionDef) and node.name == name
    )
    return {node.module for node in ast.walk(function) if isinstance(node, ast.ImportFrom)}


def _loaded_by(names) -> list[str]:
    """Every module in `sys.modules` after a fresh interpreter imports `names`."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {sorted(names)!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, check=True, capture_output=True, text=True
    )
    return json.loads(loaded.stdout)


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_driver_imports_load_no_megatron_or_vllm():
    driver = {"megarl.cli.main", "megarl.trainer.trainer", "megarl.trainer.sft"}
    driver |= _run_imports(PACKAGE / "cli" / "train.py") | _run_imports(PACKAGE / "cli" / "sft.py")
    assert "megarl.trainer.trainer" in _run_imports(PACKAGE / "cli" / "train.py")
    modules = _loaded_by(driver)
    bad = sorted({m.split(".")[0] for m in modules if any(_under(m, p) for p in DRIVER_MUST_NOT_IMPORT)})
    assert bad == [], f"importing the driver ({sorted(driver)}) loaded {bad}"


def test_ray_starts_before_the_trainer_is_imported():
    """`megarl train`'s `run` begins starting Ray (`start_ray_early`) with what it imports itself, and imports
    the trainer only in `_train`: `run`'s imports must not pull in torch or transformers, the seconds the
    start is meant to overlap."""
    early = _function_imports(PACKAGE / "cli" / "train.py", "run")
    assert "megarl.orchestration.cluster" in early and "megarl.trainer.trainer" not in early
    modules = _loaded_by(early)
    assert not [m for m in modules if _under(m, "torch") or _under(m, "transformers")]
