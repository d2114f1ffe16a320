"""The config schema loads without its checks (issue 30 item 2): importing a schema module in a fresh
interpreter loads only the schema modules it names, `megarl`, `megarl.versions` and `megarl.config` (whose
`__init__` re-exports nothing, since Python runs it before any submodule), and none of the heavy libraries."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCHEMA = ["sections", "roles", "rollout", "problems", "config"]
ALLOWED = {"megarl", "megarl.versions", "megarl.config", *(f"megarl.config.{name}" for name in SCHEMA)}
REPOSITORY = Path(__file__).resolve().parents[3]
"""The working directory of the probes: `python -c` puts it first on sys.path, so they import this megarl."""
HEAVY = ("torch", "ray", "megatron", "vllm", "transformers", "yaml", "numpy")


@pytest.mark.parametrize("name", SCHEMA)
def test_a_schema_module_loads_only_the_schema(name):
    code = (
        f"import sys, json, megarl.config.{name}; "
        "print(json.dumps(sorted(m for m in sys.modules if m == 'megarl' or m.startswith('megarl.'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPOSITORY)
    loaded = json.loads(result.stdout)
    extra = sorted(set(loaded) - ALLOWED)
    assert not extra, (
        f"`import megarl.config.{name}` loaded {len(loaded)} megarl modules, {extra} outside the schema: "
        "import checks, the model registry or tools from a checks module (e.g. megarl.config.validate), "
        "not from the schema or from megarl/config/__init__.py"
    )
    if name != "config":  # `Config` holds the sections of the three others: 7 modules
        assert len(loaded) <= 5, loaded


def test_the_schema_imports_no_heavy_library():
    code = (
        "import sys, json, megarl.config.config, megarl.config.problems; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPOSITORY)
    assert json.loads(result.stdout) == [], "the schema must not import heavy libraries: move the import to a check"
