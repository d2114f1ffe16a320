"""YAML recipes and `key.sub=value` overrides into a typed `Config`, refusing unknown keys and wrong types.

A recipe states only what differs from the dataclass defaults. Values are checked against the field
types as written (an int is accepted where a float is expected; nothing else is converted), so the
loaded config is exactly what the user asked for.
"""

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.config.config import Config
from megarl.config.problems import ConfigError, Problem, non_ascii_note
from megarl.config.recipes import recipe_path
from megarl.text_encoding import iconv_hint, wide_encoding

MAX_DEPTH = 32
"""How deeply a recipe's values may nest (a recipe needs 5 levels: rollout.multi_turn.tools[i].function);
PyYAML composes recursively, and a deeper document would exhaust Python's stack."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`), refuses duplicate and complex
    keys, values nested past `MAX_DEPTH`, aliases inside their own anchor and scalars its tags cannot read,
    and keeps YAML 1.1 merge keys (`<<: *base`, whose keys the mapping's own keys override)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.open_anchors: list[str | None] = []
        """The anchor (or None) of each node being composed, outermost first: its length is the depth, and an
        alias to one of them would make a value that holds itself."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self.open_anchors:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"the alias *{event.anchor} stands for a value that contains it (a value that holds itself)",
                event.start_mark,
            )
        if len(self.open_anchors) >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"values nested more than {MAX_DEPTH} levels deep", event.start_mark
            )
        self.open_anchors.append(getattr(event, "anchor", None))
        try:
            return super().compose_node(parent, index)
        finally:
            self.open_anchors.pop()

    def construct_object(self, node, deep=False):
        """Every node constructed at once (deep), so that a constructor's failure is raised here, for its node."""
        try:
            return super().construct_object(node, deep=True)
        except (ValueError, TypeError, KeyError, AttributeError):  # PyYAML's constructors on `!!int x`, `!!bool x`,
            # `!!timestamp 2001-13-45`, `!!set [1]`, and int() on more digits than Python converts
            raise yaml.constructor.ConstructorError(
                None, None, f"{_excerpt(node)} cannot be read as {_tag(node)}", node.start_mark
            ) from None

    def construct_yaml_int(self, node):
        """An integer Python can print: no setting means a number of thousands of digits, and no message
        could show one (`int` refuses to convert more than `sys.get_int_max_str_digits()` digits)."""
        value = super().construct_yaml_int(node)
        str(value)  # the ValueError of a hexadecimal integer past the limit, which `int()` read
        return value

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)  # deep: a complex key's items, for the message
            if not _hashable(key):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"a complex key (`? {_flow(key)}`): keys of a recipe are plain names",
                    key_node.start_mark,
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (the first value would be silently dropped)",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _excerpt(node) -> str:
    """The node's text as written ('x' of `!!int x`), shortened: `'1111'... (5000 characters)`."""
    if not isinstance(node.value, str):
        return "the value"
    return repr(node.value) if len(node.value) <= 40 else f"{node.value[:20]!r}... ({len(node.value)} characters)"


def _tag(node) -> str:
    """`!!int` for `tag:yaml.org,2002:int`, with the digit limit that an integer may also have broken."""
    tag, limit = node.tag.replace("tag:yaml.org,2002:", "!!"), sys.get_int_max_str_digits()
    return f"{tag} (an integer of at most {limit} digits)" if tag == "!!int" and limit else tag


def _flow(value) -> str:
    text: str = yaml.safe_dump(value, default_flow_style=True)
    return text.strip()


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, name: str = "<unicode string>"):
    """Parse YAML text with megarl's rules (scientific floats, no duplicate or complex keys); `name` is
    the file that error positions name."""
    loader = _Loader(text)
    loader.name = name  # read by every position mark made from here on
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_config(path: str | Path, overrides: typing.Sequence[str] = (), schema: type = Config):
    """Read a YAML recipe, apply `key.sub=value` overrides in order, and build the typed `Config` (or
    another root dataclass `schema`, e.g. `megarl.config.sft.SftConfig`).

    Raises `ConfigError` listing every unknown key, wrong type and malformed override at once.
    Semantic checks (sizes, divisibility, files) are `validate()`'s job. A `configs/<name>` path that
    does not exist here reads the recipe shipped with megarl (`megarl.config.recipes`).
    """
    path = recipe_path(path)
    try:
        data = parse_yaml(_read_recipe(path), str(path)) or {}
    except OSError as error:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    None,
                    f"cannot read the config file ({error.strerror})",
                    "pass the path of an existing YAML recipe, e.g. configs/quickstart.yaml",
                )
            ]
        ) from error
    except yaml.YAMLError as error:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    None,
                    f"not valid YAML: {' '.join(str(error).split())}",
                    "correct the YAML syntax at the position shown",
                )
            ]
        ) from error
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    str(path),
                    data,
                    "a recipe must be a mapping of sections",
                    "write sections at the top level, e.g. `model:` then `  path: ...`",
                )
            ]
        )
    problems = apply_overrides(data, overrides)
    config = build_config(data, problems, schema)
    if problems:
        raise ConfigError(problems)
    return config


MAX_RECIPE_BYTES = 1 << 20
"""The most a recipe file may hold; shipped recipes are under 10 KiB."""


def _read_recipe(path: Path) -> str:
    """The recipe's text: UTF-8, with or without a byte-order mark; ConfigError naming the encoding
    (UTF-16 text without a mark is valid UTF-8 full of NULs) or the first byte that is not UTF-8."""
    with path.open("rb") as file:
        raw = file.read(MAX_RECIPE_BYTES + 1)  # a device (/dev/zero) or a huge file would never end or fill memory
    if len(raw) > MAX_RECIPE_BYTES:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    None,
                    f"holds more than {MAX_RECIPE_BYTES >> 20} MiB, so it is no recipe (a recipe is a few KiB of YAML)",
                    "pass the recipe's YAML file, e.g. configs/quickstart.yaml",
                )
            ]
        )
    encoding = wide_encoding(raw[:4])
    if encoding is not None:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    None,
                    f"the file is {encoding}-encoded text, megarl reads UTF-8 recipes",
                    f"convert it, e.g. {iconv_hint(path, encoding, 'fixed.yaml')}",
                )
            ]
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError([_not_utf8(path, error)]) from None


def _not_utf8(path: Path, error: UnicodeDecodeError) -> Problem:
    """Where the first byte that is not UTF-8 is, as line and column."""
    before = error.object[: error.start]
    line = before.count(b"\n") + 1
    column = error.start - (before.rfind(b"\n") + 1) + 1
    byte = error.object[error.start]
    return Problem(
        f"{path}:{line}",
        None,
        f"byte 0x{byte:02x} at column {column} is not UTF-8 (the file was saved in "
        "another encoding, e.g. Latin-1 or cp1252)",
        f"save it as UTF-8, e.g. {iconv_hint(path, 'LATIN1', 'fixed.yaml')}",
    )


def apply_overrides(data: dict[str, Any], overrides: typing.Sequence[str]) -> list[Problem]:
    """Set each `key.sub=value` (value parsed as YAML: scalars, `[a, b]` lists) into `data`, in place."""
    problems = []
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
            problems.append(
                Problem(
                    "<override>",
                    override,
                    f"an override must look like key.sub=value{non_ascii_note(key)}",
                    "write e.g. actor.optim.lr=1e-6 or data.train_files=[a.jsonl,b.jsonl]",
                )
            )
            continue
        try:
            value = parse_yaml(text)
        except yaml.YAMLError as error:
            problems.append(
                Problem(
                    key,
                    text,
                    f"the value is not valid YAML ({str(error).splitlines()[0]})",
                    "quote strings with special characters, e.g. key='a: b'",
                )
            )
            continue
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            if node.get(part) is None:  # absent, or `section:` left empty in the recipe
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                section = ".".join(parents[: depth + 1])
                problems.append(
                    Problem(
                        key,
                        value,
                        f"{section} is a value, not a section",
                        f"override {section} itself, e.g. {section}=...",
                    )
                )
                break
        else:
            if isinstance(value, dict) and isinstance(node.get(leaf), dict):
                _merge(node[leaf], value)  # `actor.optim={lr: 1e-6}` keeps the recipe's other optim keys
            else:
                node[leaf] = value
    return problems


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def build_config(data: dict[str, Any], problems: list[Problem], schema: type = Config):
    """Build a `Config` (or `schema`) from nested plain data, appending a `Problem` per unknown key or wrong type.

    A field with a problem keeps its default so the rest can still be checked; callers must not use
    the result when `problems` is non-empty.
    """
    return _build(schema, data, "", problems, _all_keys(schema), schema())


def _build(cls, data: dict[str, Any], prefix: str, problems: list[Problem], all_keys: list[str], base=None):
    """`base` (a `cls` instance, default `cls()`) with the keys of `data`. A section's defaults are its
    field's (`critic.optim` defaults to lr 1e-5, not `OptimizerConfig`'s 1e-6), kept for every key the
    recipe does not state."""
    base = cls() if base is None else base
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            problems.append(_unknown_key(key, value, prefix, list(fields), all_keys))
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if value is None:  # `section:` with every key commented out
                value = {}
            if not isinstance(value, dict):
                problems.append(
                    Problem(
                        key,
                        value,
                        "this is a section, not a value",
                        f"write a mapping of its keys: {', '.join(f.name for f in dataclasses.fields(hint))}",
                    )
                )
                continue
            values[name] = _build(hint, value, f"{key}.", problems, all_keys, getattr(base, name))
            continue
        item = _dataclass_items(hint)
        if item is not None and isinstance(value, (list, tuple)) and all(isinstance(v, dict) for v in value):
            values[name] = tuple(_build(item, v, f"{key}[{i}].", problems, all_keys) for i, v in enumerate(value))
            continue
        try:
            values[name] = _convert(hint, value)
        except _Mismatch:
            problems.append(
                Problem(
                    key,
                    value,
                    f"wrong type: expected {_describe(hint)}{non_ascii_note(value)}",
                    f"set {key} to {_describe(hint)}",
                )
            )
        except _NotFinite:
            problems.append(
                Problem(
                    key,
                    value,
                    "not a finite number (YAML reads 1e999 and .inf as infinity, .nan as not-a-number)",
                    f"set {key} to a finite number",
                )
            )
    return dataclasses.replace(base, **values)


def _dataclass_items(hint):
    """The item class of a `tuple[SomeSection, ...]` field (a list of sections, like rollout.multi_turn.tools)."""
    args = typing.get_args(hint)
    if (
        typing.get_origin(hint) is tuple
        and len(args) == 2
        and args[1] is Ellipsis
        and dataclasses.is_dataclass(args[0])
    ):
        return args[0]
    return None


class _Mismatch(Exception):
    pass


class _NotFinite(Exception):
    """A float setting given inf or nan: the right type, but no setting means it, and every range check
    (`lr > 0`) would pass infinity."""


def _convert(hint, value):
    """`value` checked against the type `hint`; tuples from YAML lists; ints accepted as floats."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise _Mismatch
    if origin in (Union, types.UnionType):
        for member in args:
            try:
                return _convert(member, value)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in value)
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_convert(member, item) for member, item in zip(args, value))
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond the float range, e.g. 1 followed by 400 zeros
                raise _NotFinite from None
            if not math.isfinite(number):
                raise _NotFinite
            return number
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if dataclasses.is_dataclass(hint):  # an item of a list of sections that is not a mapping
        raise _Mismatch
    raise TypeError(f"config field type {hint!r} is not supported by the loader")


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(member) for member in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of ({_describe(args[0])})"
        return f"a list of {len(args)} items ({', '.join(_describe(member) for member in args)})"
    if dataclasses.is_dataclass(hint):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(hint))
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names[hint]


def _all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included: `actor`, `actor.optim`, `actor.optim.lr`, ..."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(_all_keys(hints[f.name], f"{key}."))
    return keys


RETIRED_KEYS = {
    "actor.tis_cap": "actor.rollout_correction: {level: token, mode: truncate, high: <the cap>} (the same truncated IS)",
}
"""Keys a recipe may still hold from an older megarl -> what replaced them."""


def _unknown_key(key: str, value, prefix: str, siblings: list[str], all_keys: list[str]) -> Problem:
    """An unknown key, with the closest sibling names or same-named keys elsewhere (`actor.lr` → `actor.optim.lr`)."""
    if key in RETIRED_KEYS:
        return Problem(key, value, "this key was replaced", f"use {RETIRED_KEYS[key]}")
    leaf = key.rsplit(".", 1)[-1]
    # The most specific guess wins: a sibling typo, then the same name in another section, then any near key.
    near = [f"{prefix}{name}" for name in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
    same_name = [k for k in all_keys if k.rsplit(".", 1)[-1] == leaf]
    near = near or [k for k in same_name if k.startswith(prefix)] or same_name
    near = near or [k for k in difflib.get_close_matches(key, all_keys, n=3, cutoff=0.8) if not key.startswith(f"{k}.")]
    where = prefix.rstrip(".") or "the top level"
    if near:
        fix = f"did you mean {' or '.join(near[:3])}?"
    else:
        fix = f"remove it; keys of {where}: {', '.join(siblings)}"
    return Problem(key, value, f"unknown key in {where}{non_ascii_note(leaf)}", fix)
