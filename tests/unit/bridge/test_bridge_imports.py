"""What importing the bridge loads, not only what its files name: no worker, trainer, vLLM or Ray module.
Which modules the bridge's files may import (and that the rollout engines use only `megarl.bridge`'s
exports) is the layer contract's (`tests/unit/test_layers.py`); this probe catches what the contract's
file-level graph cannot see, such as a package `__init__` run on the way to a module it names (an import
through `megarl.config`, whose validation reads checkpoint manifests with `megarl.workers`, once pulled the
workers in)."""

import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "megarl"
BRIDGE_MUST_NOT_LOAD = ("megarl.workers", "megarl.trainer", "megarl.orchestration", "megarl.cli", "vllm", "ray")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_importing_the_bridge_loads_nothing_above_it():
    """A fresh interpreter that imported megarl.bridge and each of its modules holds no module above it."""
    code = (
        "import importlib, json, pkgutil, sys, megarl.bridge\n"
        "for info in pkgutil.walk_packages(megarl.bridge.__path__, 'megarl.bridge.'):\n"
        "    importlib.import_module(info.name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, check=True, capture_output=True, text=True
    )
    modules = json.loads(loaded.stdout)
    assert "megarl.bridge.plan" in modules  # the probe really imported the bridge
    bad = [m for m in modules if any(_under(m, f) for f in BRIDGE_MUST_NOT_LOAD)]
    assert bad == [], f"import megarl.bridge loaded {bad}"
