"""Dependency direction: worker code (checkpoint save/load included) never imports the trainer or Ray."""

import ast
from pathlib import Path

import pytest

WORKERS = Path(__file__).resolve().parents[3] / "megarl" / "workers"
FORBIDDEN = ("megarl.trainer", "megarl.orchestration", "ray")


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append(node.module)
    return found


@pytest.mark.parametrize("path", sorted(WORKERS.rglob("*.py")), ids=lambda p: str(p.relative_to(WORKERS)))
def test_worker_module_imports_no_trainer_and_no_ray(path):
    bad = [m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == [], f"{path} imports {bad}: workers sit below the trainer and know nothing of Ray"
