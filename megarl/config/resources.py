"""Checks that look outside the config: data files, writable directories, importable user functions.

None of them writes anything, imports user code or starts a process: directories are tested with
os.access on the nearest existing parent, user functions (rewards, tools) are found by reading the module's source.
None of them raises on a path either: a path that no file can have (`local_path`, `unusable_path`) is a
problem like a missing file.
"""

import ast
import importlib.machinery
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from megarl.config.problems import Problem

DATA_SUFFIXES = (".jsonl", ".parquet")


def local_path(path: str) -> Path:
    """`path` as the workers open it, `~` and `~user` expanded; as written where that fails (a `~user` with no
    home on this machine): it then names no existing file, and `unusable_path` says why."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def unusable_path(path: str) -> str | None:
    """Why `path` can name no file on this machine, beyond plain absence: a `~user` of no user here, a NUL
    character, or what looking at it fails with (a name longer than the file system takes, an unreadable
    parent); None for a path that exists or is merely absent."""
    if "\0" in path:
        return "holds a NUL character, which no file name can"
    try:
        Path(path).expanduser()
    except RuntimeError:
        return f"{path.split('/')[0]} is no user of this machine, so the path cannot be expanded"
    try:
        os.stat(local_path(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        return f"cannot be looked at ({error.strerror})"
    return None


def data_file_problems(key: str, paths: tuple[str, ...], check_exists: bool) -> list[Problem]:
    """Each data file must be .jsonl/.parquet and (when `check_exists`) an existing file."""
    problems = []
    for index, path in enumerate(paths):
        item = f"{key}[{index}]"
        if check_exists and os.path.isdir(local_path(path)):
            problems.append(
                Problem(
                    item,
                    path,
                    "is a directory, not a data file",
                    f"list the {' or '.join(DATA_SUFFIXES)} files inside it one by one",
                )
            )
        elif not path.endswith(DATA_SUFFIXES):
            problems.append(
                Problem(item, path, "unsupported file type", f"convert it to one of {', '.join(DATA_SUFFIXES)}")
            )
        elif check_exists and not os.path.isfile(local_path(path)):
            problems.append(
                Problem(
                    item,
                    path,
                    unusable_path(path) or "file does not exist",
                    "correct the path (relative paths start at the working directory), create the "
                    "file, or validate with --no-file-checks for a recipe meant for another machine",
                )
            )
    return problems


def writable_dir_problem(key: str, path: str) -> Problem | None:
    """A problem if `path` could not be created or written as a directory; nothing is created."""
    unusable = unusable_path(path)
    if unusable is not None:
        return Problem(key, path, unusable, "write the directory out in full, e.g. /home/<user>/runs")
    target = local_path(path).absolute()
    existing = target
    while not os.path.exists(existing):
        existing = existing.parent
    if not existing.is_dir():
        return Problem(
            key,
            path,
            f"{existing} is a file, so no directory can be made there",
            "choose a directory path that does not go through a file",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == target else f" (the nearest existing parent of {target})"
        return Problem(
            key,
            path,
            f"{existing}{made} is not writable by this user",
            "choose a writable location or fix the permissions",
        )
    return None


def reward_function_problem(key: str, spec: str) -> Problem | None:
    """A problem if the reward function `pkg.module:function` cannot be found or cannot take megarl's call
    (`function_problem`)."""
    return function_problem(
        key,
        spec,
        "reward function",
        "(prompts, completions, **columns) -> list[float]",
        "my_rewards.tasks:score",
        _reward_call_problem,
    )


def _reward_call_problem(parameters: ast.arguments) -> str | None:
    """Why a function with these parameters fails on every call `fn(prompts, responses, answer=..., **columns)`
    (megarl.rewards.worker), or None. Only certain failures: other columns may fill named parameters."""
    positional = len(parameters.posonlyargs) + len(parameters.args)
    if parameters.vararg is None and positional < 2:
        return (
            f"takes {positional} positional parameter(s), but megarl passes 2 (the prompts and the responses) "
            "and the data's columns by name"
        )
    # "answer": megarl.data.prompts.ANSWER_ARGUMENT (not imported: megarl.data imports megarl.config)
    if parameters.kwarg is None and "answer" not in {p.arg for p in parameters.args + parameters.kwonlyargs}:
        return (
            "has neither an `answer` parameter nor **columns, but megarl passes the data's answer column as "
            "answer= (and its other columns by name)"
        )
    return None


def function_problem(
    key: str,
    spec: str,
    what: str,
    signature: str,
    example: str,
    call_problem: Callable[[ast.arguments], str | None] | None = None,
) -> Problem | None:
    """A problem if `pkg.module:function` cannot be found, is an `async def`, or (`call_problem` of its
    parameters) cannot take megarl's call. Nothing of the user's runs: the module is located without
    importing its parent packages (`_module_source`) and its source is parsed.
    what: the kind of function, for the message ("reward function"); signature: what a definition
    should look like after its name; example: a well-formed spec."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function.isidentifier():
        return Problem(key, spec, f"a user {what} is written `pkg.module:function`", f"write e.g. {example}")
    try:
        origin = _module_source(module_name)
    except (ImportError, ValueError) as error:  # e.g. an empty part in the dotted name
        return Problem(
            key,
            spec,
            f"module {module_name} cannot be found ({type(error).__name__}: {error})",
            f"write the module as a dotted name, e.g. {example.partition(':')[0]}",
        )
    if origin is None:
        return Problem(
            key,
            spec,
            f"module {module_name} cannot be imported (no such module on the Python path)",
            "install the package or add its directory to PYTHONPATH",
        )
    if not origin.endswith(".py"):
        return None  # a compiled or namespace module: its names are only known by importing it
    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)  # bytes: its `coding:` line decides, as for import
    except (OSError, SyntaxError, ValueError) as error:
        return Problem(key, spec, f"{origin} cannot be parsed: {error}", "fix the module")
    bindings = _top_level_bindings(tree)
    if bindings is None:
        return None
    if function not in bindings:
        return Problem(
            key,
            spec,
            f"{origin} defines no top-level {function}",
            f"define `def {function}{signature}` there or correct the name",
        )
    definition = bindings[function]
    if definition is None:
        return None  # bound by something other than one plain def or literal: only importing it would tell
    where = f"{origin}:{definition.lineno}: {function}"
    if isinstance(definition, ast.Assign):
        value = definition.value
        kind = type(value.value).__name__ if isinstance(value, ast.Constant) else type(value).__name__.lower()
        return Problem(key, spec, f"{where} is a {kind}, not a function", f"point it at a `def {function}{signature}`")
    if isinstance(definition, ast.AsyncFunctionDef):
        return Problem(
            key,
            spec,
            f"{where} is an async def, but megarl calls a {what} as a plain function, so "
            "every call would return an unawaited coroutine instead of a result",
            "make it a plain def (it may run its async code with asyncio.run)",
        )
    assert isinstance(definition, ast.FunctionDef)  # what `_top_level_bindings` keeps besides literals
    why = None if call_problem is None else call_problem(definition.args)
    if why is not None:
        return Problem(key, spec, f"{where} {why}", f"define it as `def {function}{signature}`")
    return None


def _module_source(module_name: str) -> str | None:
    """Where `module_name` lives (its origin; None if not found), found as the import system would,
    without running any package's `__init__`: `importlib.util.find_spec("pkg.mod")` imports `pkg` (a
    package whose `__init__` blocks or raises would hang or break validate), so only the top-level
    name goes through the finders and each sub-name is searched in its parent's locations."""
    top, *rest = module_name.split(".")
    found = importlib.util.find_spec(top)  # a top-level name: located, not imported
    if found is None or not rest:
        return None if found is None else found.origin or ""
    if found.submodule_search_locations is None:
        return None
    locations = list(found.submodule_search_locations)  # a top-level namespace's parent is sys.path itself
    for leaf in rest[:-1]:
        locations = _subpackage_locations(leaf, locations)
    try:
        found = importlib.machinery.PathFinder.find_spec(module_name, locations) if locations else None
    except KeyError:  # the name is itself a nested namespace package, whose path needs its parent imported
        return None
    return None if found is None else found.origin or ""


def _subpackage_locations(leaf: str, locations: list[str]) -> list[str]:
    """The search locations of the package `leaf` inside `locations`, found as the import system finds it
    (the first regular package wins, else every directory of that name is a portion of a namespace
    package; a module of that name has no submodules), without `PathFinder`: its spec of a nested
    namespace package needs the parent package imported."""
    portions = []
    for parent in locations:
        directory = os.path.join(parent, leaf)
        if os.path.isfile(os.path.join(directory, "__init__.py")):
            return [directory]
        if os.path.isfile(directory + ".py"):
            return []
        if os.path.isdir(directory):
            portions.append(directory)
    return portions


_LITERALS = (ast.Constant, ast.Dict, ast.List, ast.Set, ast.Tuple)
"""Expressions whose value is never callable."""


def _top_level_bindings(tree: ast.Module) -> dict[str, ast.stmt | None] | None:
    """The names a module binds at its top level, those in module-level if/try/with blocks included
    (a `def` under `try:` is still a module attribute), each with the undecorated def or the `name = <literal>`
    that binds it, or None where that is unknown without running the module (bound twice, decorated, ...);
    None for the whole module when a `from x import *` makes its names unknowable without importing."""
    bindings: dict[str, ast.stmt | None] = {}

    def bind(name: str, node: ast.stmt) -> None:
        plain_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list
        literal = isinstance(node, ast.Assign) and isinstance(node.value, _LITERALS) and len(node.targets) == 1
        bindings[name] = node if (plain_def or literal) and name not in bindings else None  # ClassDef: callable

    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    bind(target.id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            for alias in node.names:
                bind((alias.asname or alias.name).split(".")[0], node)
        elif isinstance(node, (ast.If, ast.Try, ast.TryStar, ast.With)):
            statements.extend(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
            statements.extend(stmt for handler in getattr(node, "handlers", []) for stmt in handler.body)
    return bindings
