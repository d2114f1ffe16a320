"""Marks every test by its directory: tests/unit -> unit, tests/distributed -> distributed, ..., tests/gpu -> gpu,
and runs the areas with the longest tests first.

`scripts/test.sh` spreads the suite's files over two pytest processes (pytest-xdist, `--dist loadfile`), which
take the files in collection order: the whole jobs (e2e) start first and the thousands of short unit tests
fill in at the end, so no process is left with one long job while the other idles."""

from pathlib import Path

import pytest

_AREAS = ("e2e", "distributed", "deploy", "gpu", "unit")
"""Run order: slowest files first (e2e tests are whole jobs of tens of seconds each; unit tests take ms)."""


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent

    def area(item) -> str:
        return Path(item.fspath).relative_to(root).parts[0]

    for item in items:
        if area(item) in _AREAS:
            item.add_marker(getattr(pytest.mark, area(item)))
    items.sort(key=lambda item: _AREAS.index(area(item)) if area(item) in _AREAS else len(_AREAS))
