"""The tool worker and the config checks stay light: importing them pulls in no Ray, torch or transformers (a
worker starts per concurrent call; validate runs before anything starts)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["megarl.tools", "megarl.tools.worker", "megarl.tools.validation"])
def test_importing_pulls_in_no_heavy_library(module):
    heavy = ("ray", "torch", "transformers", "bm25s")
    probe = f"import sys, {module}; print(sorted(m for m in {heavy} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
