"""tests/conftest.py marks each test by its area and orders the areas longest first, so that the two pytest
processes of `scripts/test.sh` (pytest-xdist, a file at a time) start the whole jobs first and the unit tests
fill in at the end."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).parents[1]


class Item:
    """What the hook reads of a collected test: its file, and the markers it adds."""

    def __init__(self, path: str):
        self.fspath = TESTS / path
        self.markers: list[str] = []

    def add_marker(self, marker) -> None:
        self.markers.append(marker.name)


def test_whole_jobs_run_first_and_each_test_is_marked_by_its_area():
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    paths = ["deploy/test_a.py", "unit/test_b.py", "e2e/x/test_c.py", "distributed/test_d.py", "unit/test_a.py"]
    items = [Item(path) for path in paths]
    conftest.pytest_collection_modifyitems(None, items)
    assert [str(item.fspath.relative_to(TESTS)) for item in items] == [
        "e2e/x/test_c.py",
        "distributed/test_d.py",
        "deploy/test_a.py",
        "unit/test_b.py",  # within an area, the collection's order
        "unit/test_a.py",
    ]
    assert [item.markers for item in items] == [["e2e"], ["distributed"], ["deploy"], ["unit"], ["unit"]]
