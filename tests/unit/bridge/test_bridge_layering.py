"""Dependency direction between the bridge and the rollout engines: each transport's sender and
receiver live in `megarl/bridge/`, which never imports a rollout backend (nor vLLM, nor anything
above the workers); the backends in `megarl/workers/rollout/` take weights only through the names
`megarl.bridge` exports, so a transport can change without touching an engine."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import megarl.bridge

PACKAGE = Path(__file__).resolve().parents[3] / "megarl"
BRIDGE = PACKAGE / "bridge"
ROLLOUT = PACKAGE / "workers" / "rollout"
BRIDGE_MUST_NOT_IMPORT = ("megarl.workers", "megarl.trainer", "megarl.orchestration", "megarl.cli", "vllm", "ray")


def imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every absolute import in `path`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("path", sorted(BRIDGE.rglob("*.py")), ids=lambda p: str(p.relative_to(BRIDGE)))
def test_bridge_imports_no_rollout_backend(path):
    bad = [m for m, _ in imported_modules(path) if any(_under(m, f) for f in BRIDGE_MUST_NOT_IMPORT)]
    assert bad == [], f"{path} imports {bad}: the bridge sits below the rollout engines and the workers"


@pytest.mark.parametrize("path", sorted(ROLLOUT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROLLOUT)))
def test_rollout_backends_use_only_the_bridge_interface(path):
    for module, names in imported_modules(path):
        if not _under(module, "megarl.bridge"):
            continue
        assert module == "megarl.bridge", (
            f"{path} imports {module}: a rollout backend takes weights through `megarl.bridge`'s exports only"
        )
        private = [n for n in names if n not in megarl.bridge.__all__]
        assert private == [], f"{path} imports {private} from megarl.bridge, which does not export them"


def test_the_scan_sees_both_directions():
    """The scans above are not vacuous: the backends do use the bridge, and the rule catches an
    import of a backend module."""
    assert any(_under(m, "megarl.bridge") for p in ROLLOUT.rglob("*.py") for m, _ in imported_modules(p))
    offending = ast.parse("from megarl.workers.rollout.vllm_engine import VLLMRolloutEngine")
    module = next(n.module for n in ast.walk(offending) if isinstance(n, ast.ImportFrom))
    assert any(_under(module, f) for f in BRIDGE_MUST_NOT_IMPORT)


def test_importing_the_bridge_loads_nothing_above_it():
    """What importing megarl.bridge and each of its modules loads, not only what its files name: a fresh interpreter may hold no
    worker, trainer, vLLM or Ray module afterwards (an import through `megarl.config`, whose validation
    reads checkpoint manifests with `megarl.workers`, once pulled the workers in)."""
    code = ("import importlib, json, pkgutil, sys, megarl.bridge\n"
            "for info in pkgutil.walk_packages(megarl.bridge.__path__, 'megarl.bridge.'):\n"
            "    importlib.import_module(info.name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, check=True, capture_output=True, text=True)
    bad = [m for m in json.loads(loaded.stdout) if any(_under(m, f) for f in BRIDGE_MUST_NOT_IMPORT)]
    assert bad == [], f"import megarl.bridge loaded {bad}"
