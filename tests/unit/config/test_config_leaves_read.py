"""No config key that nothing reads: every leaf of `Config` (e.g. `actor.offload.params`) must be read
by the code that runs a job, i.e. megarl outside the modules that only load, validate or describe a
config (`NOT_RUNTIME`). A key a user can set that silently does nothing fails here.

How "read" is decided, statically (AST). Every attribute chain in the runtime code (`config.actor.
offload.params`, `offload.params`, `sync.bucket_mb`, ...) is a sequence of names; inside a function,
a chain that starts at a parameter is also read as the chains its callers pass for that parameter. A leaf path is read
when some chain ends with one of its tails of two or more names and the section that tail starts from
is read too (recursively; a top-level section counts as read: the trainer holds the config). Inside a
function, a chain that starts at a local `name = a.b.c` is also read as starting at `a.b.c`; in a
module, one that starts at `self.x = a.b.c` as starting there. So `critic.offload.params` needs a chain
`... offload.params` and a chain `... critic.offload`: code that reads `offload.params` from the
actor's section alone does not make the critic's key read."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megarl.config.config import Config

MEGARL = Path(__file__).resolve().parents[3] / "megarl"
NOT_RUNTIME = {
    "config/validate.py", "config/loader.py", "config/memory.py", "config/model_facts.py", "config/names.py",
    "config/placement.py", "config/problems.py", "config/resources.py", "cli/validate.py",
}
"""Modules that load, validate or estimate a config: their reads do not make a key do anything."""


def leaf_paths(cls=Config, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for field in dataclasses.fields(cls):
        path = prefix + (field.name,)
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        paths += leaf_paths(type(default), path) if dataclasses.is_dataclass(default) else [path]
    return paths


def _chain(node: ast.expr) -> tuple[str, ...] | None:
    """`a.b.c` as ("a", "b", "c"); None for anything else."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return (node.id, *reversed(names))


def _parameter_aliases(trees: list[ast.Module]) -> dict[tuple[int, str], set[tuple[str, ...]]]:
    """(function node id, parameter) -> the chains passed for it at any call of a function of that
    name (`_role_plan("critic", config.critic, ...)` makes `role` inside `_role_plan` stand for
    `config.critic`), so reads through a parameter count for the section passed in."""
    functions: dict[str, list[ast.FunctionDef]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, []).append(node)
    calls = [(caller, call) for tree in trees for caller in ast.walk(tree)
             if isinstance(caller, (ast.FunctionDef, ast.Module))
             for call in ast.walk(caller) if isinstance(call, ast.Call)]
    aliases: dict[tuple[int, str], set[tuple[str, ...]]] = {}
    for _ in range(4):  # a parameter handed on to another function (`_role_plan` → `_update_plan`)
        for caller, call in calls:
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            for function in functions.get(name, []):
                params = [arg.arg for arg in function.args.args]
                if params[:1] in (["self"], ["cls"]):
                    params = params[1:]
                bound = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
                for param, value in bound:
                    chain = _chain(value)
                    if chain is None:
                        continue
                    passed = {chain} | {outer + chain[1:] for outer in aliases.get((id(caller), chain[0]), ())}
                    aliases.setdefault((id(function), param), set()).update(passed)
    return aliases


def attribute_chains() -> set[tuple[str, ...]]:
    """Every tail of every `a.b.c...` chain in the runtime modules (base name included), with a
    function parameter's chains also read as the chains passed for it."""
    trees = [ast.parse(path.read_text()) for path in sorted(MEGARL.rglob("*.py"))
             if str(path.relative_to(MEGARL)) not in NOT_RUNTIME]
    aliases = _parameter_aliases(trees)
    chains = set()
    for tree in trees:
        members = _member_aliases(tree)
        for function in (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Module))):
            local = _local_aliases(function)
            for node in ast.walk(function):
                chain = _chain(node) if isinstance(node, ast.Attribute) else None
                if chain is None:
                    continue
                chains.add(chain)
                for alias in aliases.get((id(function), chain[0]), set()) | local.get(chain[0], set()):
                    chains.add(alias + chain[1:])
                for alias in members.get(chain[:2], ()):
                    chains.add(alias + chain[2:])
    return {chain[i:] for chain in chains for i in range(len(chain))}


def _member_aliases(tree: ast.Module) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    """`self.settings = config.rollout.sync` anywhere in a module: `self.settings` stands for the chain."""
    aliases: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute):
            target, chain = _chain(node.targets[0]), _chain(node.value)
            if target is not None and len(target) == 2 and chain is not None and len(chain) > 1:
                aliases.setdefault(target, set()).add(chain)
    return aliases


def _local_aliases(function: ast.AST) -> dict[str, set[tuple[str, ...]]]:
    """`name = a.b.c` (or `x, name = ..., a.b.c`) inside `function`: name stands for the chain."""
    aliases: dict[str, set[tuple[str, ...]]] = {}
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                 and len(target.elts) == len(value.elts) else [(target, value)])
        for name, expression in pairs:
            chain = _chain(expression)
            if isinstance(name, ast.Name) and chain is not None and len(chain) > 1:
                aliases.setdefault(name.id, set()).add(chain)
    return aliases


def is_read(path: tuple[str, ...], chains: set[tuple[str, ...]]) -> bool:
    if len(path) == 1:
        return True
    return any(path[start:] in chains and is_read(path[:start + 1], chains) for start in range(len(path) - 1))


def unread_leaves() -> list[str]:
    chains = attribute_chains()
    return [".".join(path) for path in leaf_paths() if not is_read(path, chains)]


def test_every_config_key_is_read_by_the_runtime():
    assert unread_leaves() == []


def test_the_scan_sees_a_missing_read():
    """The check itself: a leaf whose only reads are removed is reported, per section."""
    chains = attribute_chains()
    assert is_read(("critic", "offload", "params"), chains)
    without_critic_section = {chain for chain in chains
                              if ("critic", "offload") not in zip(chain, chain[1:])}  # nothing reads critic.offload
    assert not is_read(("critic", "offload", "params"), without_critic_section)
    assert is_read(("actor", "offload", "params"), without_critic_section)
