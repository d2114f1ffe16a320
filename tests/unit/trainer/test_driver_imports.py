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
    """The modules a CLI command's `run` imports (lazily, inside the function)."""
    run = next(node for node in ast.parse(cli_file.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.name == "run")
    return {node.module for node in ast.walk(run) if isinstance(node, ast.ImportFrom)}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_driver_imports_load_no_megatron_or_vllm():
    driver = {"megarl.cli.main", "megarl.trainer.trainer", "megarl.trainer.sft"}
    driver |= _run_imports(PACKAGE / "cli" / "train.py") | _run_imports(PACKAGE / "cli" / "sft.py")
    assert "megarl.trainer.trainer" in _run_imports(PACKAGE / "cli" / "train.py")
    code = ("import importlib, json, sys\n"
            f"for name in {sorted(driver)!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, check=True, capture_output=True,
                            text=True)
    modules = json.loads(loaded.stdout)
    bad = sorted({m.split(".")[0] for m in modules if any(_under(m, p) for p in DRIVER_MUST_NOT_IMPORT)})
    assert bad == [], f"importing the driver ({sorted(driver)}) loaded {bad}"
