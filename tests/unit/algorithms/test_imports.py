"""megarl.algorithms stays pure: importing it loads no torch.distributed, Ray, Megatron or vLLM beyond what
`import torch` loads. Its files' import statements are the layer contract's (`tests/unit/test_layers.py`:
the base row, `LIBRARIES`); this probe sees what they load in turn."""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import megarl.algorithms

FORBIDDEN = ("torch.distributed", "ray", "megatron", "vllm")
PACKAGE_DIR = Path(megarl.algorithms.__file__).parent
MODULES = ["megarl.algorithms"] + [f"megarl.algorithms.{m.name}" for m in pkgutil.iter_modules([str(PACKAGE_DIR)])]

# `import torch` itself loads torch.distributed, so the probe reports what the modules add on top
# of torch; the layer contract catches a torch.distributed import statement that this cannot see.
# One fresh interpreter serves all modules: importing any submodule runs the package __init__,
# which imports every submodule, so a process per module would load exactly the same set.
_PROBE = """
import importlib, json, sys
import torch
before = set(sys.modules)
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_every_module_is_probed():
    assert {"advantages", "losses", "policy_loss", "kl", "value_loss", "dapo"} <= {
        m.rsplit(".", 1)[-1] for m in MODULES
    }


def test_import_in_fresh_process_loads_nothing_forbidden():
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, *MODULES], capture_output=True, text=True, timeout=120, check=True
    )
    added = json.loads(probe.stdout)
    assert set(MODULES) <= set(added)  # the probe really imported them, fresh
    assert [name for name in added if _forbidden(name)] == []
