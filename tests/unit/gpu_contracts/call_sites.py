"""Reads megarl's own source for the calls it makes, so a contract test checks the arguments megarl
really passes (not a copy of them that could drift)."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

MEGARL = Path(__file__).resolve().parents[3] / "megarl"


@dataclass(frozen=True)
class CallSite:
    """One call in megarl's source: where, how many positional arguments, which keywords."""

    where: str
    positional: int
    keywords: tuple[str, ...]


def call_sites(relative_path: str, name: str) -> list[CallSite]:
    """Every call of `name(...)` or `<expr>.name(...)` in `megarl/<relative_path>` (keywords written
    out; a `**mapping` argument is not resolved)."""
    path = MEGARL / relative_path
    sites = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if called != name:
            continue
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            raise AssertionError(f"{relative_path}:{node.lineno}: {name}(*args) cannot be checked statically")
        # `**mapping` entries are not seen: only the keywords written out are checked.
        keywords = tuple(k.arg for k in node.keywords if k.arg is not None)
        sites.append(CallSite(f"{relative_path}:{node.lineno}", len(node.args), keywords))
    if not sites:
        raise AssertionError(f"megarl/{relative_path} calls no {name}(...): the contract test is stale")
    return sites


def assert_fits(sites: list[CallSite], target, *, bound: bool) -> None:
    """Each call site binds to `target`'s signature (`bound`: called on an instance, so `self` is
    supplied by Python and the class attribute's first parameter is taken)."""
    signature = inspect.signature(target)
    for site in sites:
        positional = [None] * (site.positional + (1 if bound else 0))
        try:
            signature.bind(*positional, **dict.fromkeys(site.keywords))
        except TypeError as error:
            raise AssertionError(
                f"{site.where}: {target.__qualname__}{signature} does not accept {site.positional} positional "
                f"argument(s) and keywords {list(site.keywords)}: {error}"
            ) from None


def dataclass_fields(cls) -> set[str]:
    return set(inspect.signature(cls).parameters)
