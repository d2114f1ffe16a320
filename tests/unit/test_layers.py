"""The layer contract (ARCHITECTURE.md, "Packages and the direction of imports"), read from the source.

`LAYERS` lists megarl's parts bottom-up, one row per layer. A module imports megarl modules of its own
row or of lower rows only, and the file-level import graph has no circle (two modules of one row may use
each other one way, never both ways). The heavy libraries stay in the rows that run them (`LIBRARIES`),
and a rollout engine takes weights through the bridge's exports only (`INTERFACES`).

What counts as an import: every `import` / `from ... import` statement that names a megarl module, at any
depth: inside functions and under `if TYPE_CHECKING:` too. A function-level import defers a dependency,
it does not remove it (the function cannot run without the other layer), and it is how a circle hides
from the interpreter: the trainer's roles -> handover -> sync_step -> roles circle ran only because
one side imported lazily or for type checking. `from pkg import name` is an edge to `pkg.name` where that
is a module, else to `pkg` (its `__init__`). Not counted: the parent packages' `__init__` that Python
runs on the way to a submodule (a package re-exporting its modules would otherwise be a circle with each
of them; `megarl/config/__init__.py` re-exports nothing, so `import megarl.config.sections` loads the
schema alone: `tests/unit/config/test_schema_imports.py` counts that at run time), and dotted strings
("pkg.module:function") that worker groups, rewards and tools resolve in other processes.

A new module falls in the row of its package; a new package (or top-level module) must be given a row
(`test_every_module_has_a_row`). A finding names the file, the line and the fix.
"""

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"

CONFIG_SCHEMA = [
    f"megarl.config.{name}"
    for name in (
        "sections",
        "roles",
        "rollout",
        "config",
        "problems",
        "resources",
        "recipes",
        "loader",
        "names",
        "hub",
        "batch_plan",
        "placement",
        "role_checks",
        "engines",
        "token_budget",
    )
]
"""The config modules that import no megarl package above the bottom row: the sections, YAML loading and the
checks that read nothing but the config. The rest of `megarl.config` (`validate`, `model_facts`, `memory`,
`tokenizer_files`, `sft`) checks a config against the model registry, checkpoints and tools, and sits above
them; the package's `__init__` imports nothing."""

LAYERS: list[tuple[str, list[str]]] = [
    (
        "base",
        [
            "megarl.versions",
            "megarl.text_encoding",
            "megarl.interrupt",
            "megarl.credentials",
            "megarl.isolation",
            "megarl.run_lock",
            "megarl.quiet",
            "megarl.algorithms",
            "megarl.parallel",
            *CONFIG_SCHEMA,
        ],
    ),
    ("models", ["megarl.models"]),
    ("bridge", ["megarl.bridge"]),
    ("workers", ["megarl.workers"]),
    ("data, rewards, tools", ["megarl.data", "megarl.rewards", "megarl.tools"]),
    ("config checks, orchestration", ["megarl.config", "megarl.orchestration"]),
    ("rollout", ["megarl.rollout"]),
    ("cluster", ["megarl.cluster", "megarl.trainer.settings"]),
    ("trainer", ["megarl.trainer"]),
    ("entry points", [ROOT := "megarl", "megarl.cli", "megarl.bench", "megarl.deploy"]),
]
"""Bottom-up. An entry names a module or a package (the package and everything under it); the longest entry
that names a module decides its row. `megarl` itself (ROOT) is the package's front door
(`from megarl import Trainer`) and names only `megarl/__init__.py`. `megarl.trainer.settings` (the config
sections → the workers' settings objects) sits in the cluster's row: the cluster's start-up builds the worker
specs with it (`megarl.cluster.roles.worker_specs`), and it imports nothing above the config checks."""

LIBRARIES: dict[str, list[str]] = {
    "ray": ["megarl.orchestration"],
    "vllm": ["megarl.workers.rollout", "megarl.bench"],
    "megatron": ["megarl.parallel", "megarl.models", "megarl.workers"],
    "torch.distributed": [entry for _, entries in LAYERS for entry in entries if entry != "megarl.algorithms"],
}
"""Where each heavy library may be imported: Ray by the orchestration only (the workers are plain classes,
and the layers above reach Ray through its functions), vLLM by the rollout engines (and the peer benchmark), megatron-core by the processes that build
models; `megarl.algorithms` is pure torch math (no torch.distributed)."""

INTERFACES: dict[str, str] = {"megarl.workers.rollout": "megarl.bridge"}
"""importer -> package it may use only through the package's `__all__` (`from megarl.bridge import X`): a
rollout engine takes weights through the bridge's exports, so a transport can change without touching an
engine."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def repository_sources() -> dict[str, str]:
    """megarl's modules: dotted name -> source text."""
    return {module_name(path, PACKAGE): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str, source: str, modules) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, names) of every import statement in `source`, at any depth; relative imports
    resolved against `module`; `from pkg import name` resolved to `pkg.name` where that is one of `modules`."""
    is_package = f"{module}.__init__" in modules or any(m.startswith(module + ".") for m in modules)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in modules]
            found += [(sub, node.lineno, []) for sub in submodules]
            if len(submodules) < len(names):
                found.append((base, node.lineno, [n for n in names if f"{base}.{n}" not in modules]))
    return found


def _under(module: str, entry: str) -> bool:
    return module == entry or (entry != ROOT and module.startswith(entry + "."))


def row_of(module: str) -> int | None:
    """The index in `LAYERS` of `module`'s row; None when no entry names it."""
    matches = [
        (len(entry), row) for row, (_, entries) in enumerate(LAYERS) for entry in entries if _under(module, entry)
    ]
    return max(matches)[1] if matches else None


def megarl_edges(sources: dict[str, str]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of one megarl module by another."""
    edges = []
    for module, source in sources.items():
        for target, line, _ in imports(module, source, sources):
            if target in sources and target != module:
                edges.append((module, target, line))
    return edges


def upward_imports(sources: dict[str, str]) -> list[str]:
    """An import of a higher row, one line each, with where it is and what to do."""
    found = []
    for module, target, line in megarl_edges(sources):
        low, high = row_of(module), row_of(target)
        if low is not None and high is not None and high > low:
            found.append(
                f"{module}:{line} imports {target}: row {LAYERS[low][0]!r} may not import row "
                f"{LAYERS[high][0]!r}; move the code it needs down (or this code up)"
            )
    return found


def cycles(sources: dict[str, str]) -> list[list[str]]:
    """Each circle of the module graph (a strongly connected component of two or more modules), sorted."""
    graph: dict[str, set[str]] = {module: set() for module in sources}
    for module, target, _ in megarl_edges(sources):
        graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):  # Tarjan, iterative: the graph is ~400 modules deep at most
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe_cycle(component: list[str], sources: dict[str, str]) -> str:
    inside = [f"{a}:{line} -> {b}" for a, b, line in megarl_edges(sources) if a in component and b in component]
    return "circle " + " ⇄ ".join(component) + " (" + "; ".join(inside) + ")"


def library_imports(sources: dict[str, str]) -> list[str]:
    """An import of a heavy library outside the rows `LIBRARIES` allows it in."""
    found = []
    for module, source in sources.items():
        for target, line, names in imports(module, source, sources):
            candidates = [target, *(f"{target}.{name}" for name in names)]
            for library, allowed in LIBRARIES.items():
                hit = any(c == library or c.startswith(library + ".") for c in candidates)
                if hit and not any(_under(module, entry) for entry in allowed):
                    found.append(f"{module}:{line} imports {library}, which only {', '.join(allowed)} may import")
    return found


def interface_breaches(sources: dict[str, str]) -> list[str]:
    """An import that reaches past a package's `__all__` where `INTERFACES` says it must not."""
    found = []
    for importer, package in INTERFACES.items():
        exported = _all_of(sources.get(package, ""))
        for module, source in sources.items():
            if not _under(module, importer):
                continue
            for target, line, names in imports(module, source, sources):
                if _under(target, package) and (target != package or not set(names) <= exported):
                    private = target if target != package else sorted(set(names) - exported)
                    found.append(
                        f"{module}:{line} imports {private}: use what `{package}` exports (its __all__), "
                        f"or export it there"
                    )
    return found


def _all_of(source: str) -> set[str]:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_every_module_has_a_row_and_every_entry_names_code():
    sources = repository_sources()
    assert [module for module in sources if row_of(module) is None] == [], "give each of these a row in LAYERS"
    for row, entries in LAYERS:
        stale = [entry for entry in entries if not any(_under(module, entry) for module in sources)]
        assert stale == [], f"LAYERS row {row!r} names {stale}, which no longer exist: remove them"


def test_no_module_imports_a_higher_row():
    found = upward_imports(repository_sources())
    assert found == [], "\n".join(found)


def test_the_module_graph_has_no_circle():
    sources = repository_sources()
    found = [describe_cycle(component, sources) for component in cycles(sources)]
    assert found == [], "break each circle by moving what both sides need into a module of its own:\n" + "\n".join(
        found
    )


def test_heavy_libraries_stay_in_their_rows():
    found = library_imports(repository_sources())
    assert found == [], "\n".join(found)


def test_rollout_engines_take_weights_through_the_bridge_exports():
    sources = repository_sources()
    assert interface_breaches(sources) == []
    assert any(
        _under(target, "megarl.bridge")
        for module, target, _ in megarl_edges(sources)
        if _under(module, "megarl.workers.rollout")
    )  # the engines do use the bridge


def test_each_check_finds_what_it_guards():
    """The checks above are not vacuous: on a made-up package each finds its kind of breach, at any depth."""
    sources = {
        "megarl.bridge": "__all__ = ['SyncPlan']\nfrom megarl.bridge.plan import SyncPlan, Hidden\n",
        "megarl.bridge.plan": "class SyncPlan: ...\nclass Hidden: ...\n",
        "megarl.models.flops": "def f():\n    from megarl.workers.checkpoint_files import MANIFEST\n",
        "megarl.workers.checkpoint_files": "import megarl\nimport ray\nMANIFEST = 1\n",
        "megarl.workers.rollout.engine": "from megarl.bridge import Hidden\nfrom megarl.bridge.plan import SyncPlan\n",
        "megarl": "",
        "megarl.trainer.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megarl.trainer.b import B\n",
        "megarl.trainer.b": "from megarl.trainer import a\nB = 1\n",
        "megarl.algorithms.kl": "from torch import distributed\n",
    }
    assert upward_imports(sources) == [
        "megarl.models.flops:2 imports megarl.workers.checkpoint_files: row 'models' may not import row 'workers'; "
        "move the code it needs down (or this code up)",
        "megarl.workers.checkpoint_files:1 imports megarl: row 'workers' may not import row 'entry points'; "
        "move the code it needs down (or this code up)",
    ]
    assert cycles(sources) == [["megarl.trainer.a", "megarl.trainer.b"]]
    assert describe_cycle(["megarl.trainer.a", "megarl.trainer.b"], sources) == (
        "circle megarl.trainer.a ⇄ megarl.trainer.b (megarl.trainer.a:3 -> megarl.trainer.b; "
        "megarl.trainer.b:1 -> megarl.trainer.a)"
    )
    assert [line.split(" imports ")[:2] for line in library_imports(sources)] == [
        [
            "megarl.workers.checkpoint_files:2",
            "ray, which only " + ", ".join(LIBRARIES["ray"]) + " may import",
        ],
        [
            "megarl.algorithms.kl:1",
            "torch.distributed, which only " + ", ".join(LIBRARIES["torch.distributed"]) + " may import",
        ],
    ]
    assert [line.split(": use")[0] for line in interface_breaches(sources)] == [
        "megarl.workers.rollout.engine:1 imports ['Hidden']",
        "megarl.workers.rollout.engine:2 imports megarl.bridge.plan",
    ]
