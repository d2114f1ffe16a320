"""No config key that nothing reads: every leaf of `Config` (e.g. `actor.offload.params`) must be read
by the code that runs a job, i.e. megarl outside the modules that only load, validate or describe a
config (`NOT_RUNTIME`). A key a user can set that silently does nothing fails here.

How "read" is decided, statically (AST). A leaf is read when some attribute chain of the runtime code
spells it out from the config object: `config.actor.offload.params`, or the same reached through
names that stand for a part of it:
- a local `critic = config.critic` (then `critic.offload.params`),
- a member `self.settings = config.rollout.sync` (then `self.settings.verify_every`),
- a parameter, for every chain its callers pass (`micro_batch_cut(config.ref, "ref")` makes
  `role_config.max_tokens_per_micro_batch` inside `micro_batch_cut` read `config.ref.max_tokens_per_micro_batch`).
Chains that do not lead back to `config` (a worker's `spec.critic.section.offload`, a settings object of
the same field names) do not count, so the scan is section-aware: reading the actor's `offload.params`
does not make the critic's read.

A section handed on whole (`ActorSpec(section=config.actor)`: the workers take the config's own section
classes) is followed by its class: a parameter annotated with it (`optim: OptimizerConfig`) stands for
every chain of that class the runtime hands on whole, so `optim.weight_decay` in the worker reads
`actor.optim.weight_decay` and `critic.optim.weight_decay` while both sections are handed on, and
neither once nothing hands it on. A section handed to a class (a spec holding it) hands on its
subsections with it: `config.actor` in `ActorSpec` hands on `config.actor.optim`."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megarl.config.config import Config
from megarl.config.sft import SftConfig

MEGARL = Path(__file__).resolve().parents[3] / "megarl"
NOT_RUNTIME = {
    "config/validate.py",
    "config/loader.py",
    "config/memory.py",
    "config/memory_table.py",
    "config/model_facts.py",
    "config/names.py",
    "config/placement.py",
    "config/problems.py",
    "config/resources.py",
    "cli/validate.py",
    "tools/validation.py",
}
"""Modules that load, validate or estimate a config: their reads do not make a key do anything."""
SFT_RUNTIME = {
    "trainer/sft.py",
    "trainer/settings.py",
    "cli/sft.py",
    "workers/sft_worker.py",
    "workers/megatron_train.py",
}
"""The modules that run `megarl sft` (its recipe, `SftConfig`, shares section names with `Config`: the
scan of its keys looks at its own runtime only, so an RL read of `data.shuffle` does not count);
`megatron_train` reads the sections the SFT worker hands on whole (`optim`)."""
ROOTS = {("config",), ("self", "config")}
"""How the runtime holds the config (`config: Config` arguments, `Trainer.config`)."""
Chain = tuple[str, ...]


def leaf_paths(cls=Config, prefix: Chain = ()) -> list[Chain]:
    paths = []
    for field in dataclasses.fields(cls):
        path = prefix + (field.name,)
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        paths += leaf_paths(type(default), path) if dataclasses.is_dataclass(default) else [path]
    return paths


def _chain(node: ast.AST) -> Chain | None:
    """`a.b.c` as ("a", "b", "c"); None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return (node.id, *reversed(names)) if isinstance(node, ast.Name) else None


class Scope:
    """The names that stand for chains in one function (or module body): locals, parameters, members."""

    def __init__(self, node: ast.AST, members: dict[Chain, set[Chain]]):
        self.node = node
        self.class_name: str | None = None
        """For a class's `__init__`: the class's name (calling the class calls it)."""
        self.members = members
        self.aliases: dict[Chain, set[Chain]] = {}
        for assign in (n for n in ast.walk(node) if _is_single_assignment(n)):
            target, value = (assign.targets[0] if isinstance(assign, ast.Assign) else assign.target), assign.value
            pairs = (
                zip(target.elts, value.elts)
                if isinstance(target, ast.Tuple)
                and isinstance(value, ast.Tuple)
                and len(target.elts) == len(value.elts)
                else [(target, value)]
            )
            for name, expression in pairs:
                chain = _chain(expression)
                if isinstance(name, ast.Name) and chain is not None and len(chain) > 1:
                    self.aliases.setdefault((name.id,), set()).add(chain)

    def expand(self, chain: Chain) -> set[Chain]:
        """`chain` and what it stands for: its head replaced by the chains that name stands for, again
        for what those start with (a bounded number of times: `x = x.next` must not loop)."""
        found, frontier = {chain}, [chain]
        for _ in range(4):
            frontier = [
                alias + current[size:]
                for current in frontier
                for size in (1, 2)
                for alias in self.aliases.get(current[:size], set()) | self.members.get(current[:size], set())
                if alias + current[size:] not in found
            ]
            found.update(frontier)
        return found


def _is_single_assignment(node: ast.AST) -> bool:
    """`x = ...` or `x: T = ...`."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1) or (
        isinstance(node, ast.AnnAssign) and node.value is not None
    )


def _scopes(trees: list[ast.Module]) -> list[Scope]:
    scopes = []
    for tree in trees:
        members: dict[Chain, set[Chain]] = {}
        for assign in (n for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1):
            target, value = _chain(assign.targets[0]), _chain(assign.value)
            if target is not None and len(target) == 2 and value is not None and len(value) > 1:
                members.setdefault(target, set()).add(value)
        scopes += [Scope(node, members) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Module))]
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            # `ToolSet(multi_turn)` calls `ToolSet.__init__`: its scope also answers to the class's name.
            for init in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
                next(s for s in scopes if s.node is init).class_name = cls.name
    return scopes


def _bind_parameters(scopes: list[Scope]) -> None:
    """Each function parameter stands for every chain its callers pass (by position or keyword)."""
    by_name: dict[str, list[Scope]] = {}
    for scope in scopes:
        if isinstance(scope.node, ast.FunctionDef):
            by_name.setdefault(scope.class_name or scope.node.name, []).append(scope)
    calls = [(scope, call) for scope in scopes for call in ast.walk(scope.node) if isinstance(call, ast.Call)]
    for _ in range(4):  # a parameter handed on to another function (`_role_plan` → `_update_plan`)
        for caller, call in calls:
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            for callee in by_name.get(name, []):
                params = [arg.arg for arg in callee.node.args.args]
                params = params[1:] if params[:1] in (["self"], ["cls"]) else params
                bound = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
                for param, value in bound:
                    chain = _chain(value)
                    if chain is not None:  # only what leads back to the config matters here
                        rooted = {c for c in caller.expand(chain) if any(c[: len(r)] == r for r in ROOTS)}
                        callee.aliases.setdefault((param,), set()).update(rooted)


def section_paths(cls=Config, prefix: Chain = ()) -> dict[str, set[Chain]]:
    """Class name of each section (and subsection) -> its paths in `cls` (`OptimizerConfig` ->
    {("actor", "optim"), ("critic", "optim")})."""
    found: dict[str, set[Chain]] = {}
    for field in dataclasses.fields(cls):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            found.setdefault(type(default).__name__, set()).add(prefix + (field.name,))
            for name, paths in section_paths(type(default), prefix + (field.name,)).items():
                found.setdefault(name, set()).update(paths)
    return found


def _bind_sections(scopes: list[Scope], schema) -> None:
    """A parameter annotated with a section's class stands for every config chain of that class that
    some call hands on whole (as an argument: `packs_by_tokens(config.actor, config)`). A section handed on
    whole to a class (`ActorSpec(section=config.actor)`: a worker spec holds the config's own section)
    hands on its subsections with it: the worker reads them off the object, where no chain leads back to
    the config, and passes them on (`optim=actor.section.optim` to a parameter `optim: OptimizerConfig`)."""
    sections = section_paths(schema)
    last_names = {path[-1] for paths in sections.values() for path in paths}
    handed: dict[str, set[Chain]] = {}
    stored: set[Chain] = set()
    for scope in scopes:
        for call in (n for n in ast.walk(scope.node) if isinstance(n, ast.Call)):
            callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            for value in [*call.args, *(k.value for k in call.keywords)]:
                chain = _chain(value)
                if chain is None or len(chain) < 2 or chain[-1] not in last_names:
                    continue  # only `<...>.optim`-like chains can name a section (and expanding is costly)
                for expanded in scope.expand(chain):
                    for root in ROOTS:
                        if expanded[: len(root)] != root:
                            continue
                        for name, paths in sections.items():
                            if expanded[len(root) :] in paths:
                                handed.setdefault(name, set()).add(expanded)
                                if callee[:1].isupper():
                                    stored.add(expanded)
    _add_subsections(handed, stored, sections)
    for scope in (s for s in scopes if isinstance(s.node, ast.FunctionDef)):
        for arg in scope.node.args.args + scope.node.args.kwonlyargs:
            annotation = (
                {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)} if arg.annotation else set()
            )
            for name in annotation & handed.keys():
                scope.aliases.setdefault((arg.arg,), set()).update(handed[name])


def _add_subsections(handed: dict[str, set[Chain]], stored: set[Chain], sections: dict[str, set[Chain]]) -> None:
    """Each section chain in `stored` (handed on whole to a class) hands on its subsections, by their classes."""
    for chain in stored:
        root = next(root for root in ROOTS if chain[: len(root)] == root)
        path = chain[len(root) :]
        for name, paths in sections.items():
            for sub in paths:
                if len(sub) > len(path) and sub[: len(path)] == path:
                    handed.setdefault(name, set()).add(root + sub)


def _resolve_members(scopes: list[Scope]) -> None:
    """A member set from a parameter (`self.search = multi_turn.search` in `__init__(self, multi_turn)`,
    or the parameter itself: `self.settings = settings`) also stands for what that parameter stands for
    there: read in another method, `self.search.top_k` has no `multi_turn` to expand."""
    for scope in scopes:
        if not isinstance(scope.node, ast.FunctionDef):
            continue
        for assign in (n for n in ast.walk(scope.node) if isinstance(n, ast.Assign) and len(n.targets) == 1):
            target, value = _chain(assign.targets[0]), _chain(assign.value)
            if target is not None and len(target) == 2 and value is not None:
                rooted = {c for c in scope.expand(value) if any(c[: len(r)] == r for r in ROOTS)}
                scope.members.setdefault(target, set()).update(rooted)


def config_reads(modules: set[str] | None = None, schema=Config) -> set[Chain]:
    """Every config path (without its root) that a runtime attribute chain spells out from the config
    (in `modules` only, paths relative to megarl/, when given); `schema`: the config's class, whose
    sections `_bind_sections` follows."""
    paths = [path for path in sorted(MEGARL.rglob("*.py")) if str(path.relative_to(MEGARL)) not in NOT_RUNTIME]
    trees = [
        ast.parse(path.read_text()) for path in paths if modules is None or str(path.relative_to(MEGARL)) in modules
    ]
    scopes = _scopes(trees)
    _bind_sections(scopes, schema)
    _bind_parameters(scopes)
    _resolve_members(scopes)
    reads = set()
    for scope in scopes:
        for node in ast.walk(scope.node):
            chain = _chain(node) if isinstance(node, ast.Attribute) else None
            for expanded in scope.expand(chain) if chain else ():
                for root in ROOTS:
                    if expanded[: len(root)] == root:
                        reads.add(expanded[len(root) :])
    return reads


def unread_leaves(reads: set[Chain], schema=Config) -> list[str]:
    return [".".join(path) for path in leaf_paths(schema) if path not in reads]


def test_every_config_key_is_read_by_the_runtime():
    assert unread_leaves(config_reads()) == []


def test_every_sft_config_key_is_read_by_the_sft_runtime():
    assert unread_leaves(config_reads(SFT_RUNTIME, SftConfig), SftConfig) == []


def test_the_scan_is_section_aware():
    """The check itself: the critic's offload keys are read only through the critic's section (handed on
    whole in `CriticSpec`, its `offload` with it), and a worker spec's chain of the same names does not count."""
    reads = config_reads()
    assert ("critic", "offload", "params") in reads and ("actor", "offload", "params") in reads
    assert ("spec", "critic", "section", "offload") not in reads
