"""Marks every test by its directory: tests/unit -> unit, tests/distributed -> distributed, ..., tests/gpu -> gpu."""

from pathlib import Path

import pytest

_AREAS = ("unit", "distributed", "e2e", "deploy", "gpu")


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    for item in items:
        area = Path(item.fspath).relative_to(root).parts[0]
        if area in _AREAS:
            item.add_marker(getattr(pytest.mark, area))
