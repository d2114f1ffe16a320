"""The loop drives its cluster through `megarl.cluster.protocol.Cluster` only: the job's cluster
(`RunningCluster`) has every call of the protocol with the protocol's parameters, and the trainer asks its
cluster for nothing else. The loop's unit tests run `RunningCluster` over fake groups
(`tests/fake_cluster.py`; `test_loop_on_fake_cluster.py` checks that what the loop got is a `Cluster`), so
the fake and the real one cannot part."""

import ast
import inspect
from pathlib import Path

import pytest

from megarl.cluster.protocol import Cluster
from megarl.cluster.running import RunningCluster

pytestmark = pytest.mark.unit

MISSING = object()
TRAINER = Path(__file__).resolve().parents[3] / "megarl" / "trainer"


def members(protocol: type) -> dict[str, object]:
    """The protocol's calls and attributes, by name."""
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def mismatches(protocol: type, implementation: type) -> list[str]:
    """Each member of `protocol` that `implementation` lacks, or has with other parameters or as another kind."""
    found = []
    for name, expected in members(protocol).items():
        actual = inspect.getattr_static(implementation, name, MISSING)
        if actual is MISSING:
            found.append(f"{implementation.__name__} has no {name}")
        elif isinstance(expected, property) != isinstance(actual, property):
            found.append(f"{implementation.__name__}.{name}: a property in one, not in the other")
        elif callable(expected) and parameters(actual) != parameters(expected):
            found.append(
                f"{implementation.__name__}.{name}{parameters(actual)}: the protocol has {parameters(expected)}"
            )
    return found


def parameters(function) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def cluster_calls(source: str) -> set[str]:
    """The attributes a module asks of `self.cluster`."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "cluster"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }


def test_the_running_cluster_keeps_the_protocol():
    assert mismatches(Cluster, RunningCluster) == []


def test_the_trainer_asks_its_cluster_only_what_the_protocol_has():
    used = set().union(*(cluster_calls(path.read_text()) for path in sorted(TRAINER.glob("*.py"))))
    assert {"to_training", "to_rollout", "stage", "save", "load", "shutdown", "engines"} <= used
    assert used - set(members(Cluster)) == set(), "add these to megarl.cluster.protocol.Cluster, or do not use them"


def test_the_checks_find_what_they_guard():
    class Drifted:
        engines = None  # not a property

        def to_training(self, step): ...

        def shutdown(self): ...

    found = mismatches(Cluster, Drifted)
    assert "Drifted.engines: a property in one, not in the other" in found
    assert "Drifted.to_training('self', 'step'): the protocol has ('self',)" in found
    assert "Drifted has no to_rollout" in found and not any("shutdown" in line for line in found)
    assert cluster_calls("self.cluster.roles.policy.call_all('x')\nself.cluster.stage(b)\ncluster.load(p)") == {
        "roles",
        "stage",
    }
