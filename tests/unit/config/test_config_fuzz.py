"""Property-based fuzz of the config loader and `megarl validate` (issue 18): whatever a recipe file and
its overrides hold, loading ends in a config or a `ConfigError`, and validation in exit 0 or 2 — never
another exception, never a hang, nothing written, no process started.

A recipe is the valid base recipe (conftest `workdir`) with random values at random keys: every key of
the schema (walked from its dataclasses, sections included), unknown keys inside and beside its
sections, values of every YAML type (null, bools, integers up to thousands of digits, floats with inf
and nan, unicode / empty / path strings, lists, nested mappings, YAML-special plain scalars such as
`yes`, `.nan`, `2001-12-14`, `!!binary`, anchors and aliases), and random `key.sub=value` overrides,
malformed ones included. Hypothesis runs derandomized with no example database, so CI sees the same
examples every time; each property prints how many examples it ran.
"""

import argparse
import contextlib
import dataclasses
import io
import signal
import sys
import types
import typing
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import yaml
from config_testing import error_lines, run_validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.cli.validate import run as validate_command
from megarl.config.config import Config
from megarl.config.loader import load_config
from megarl.config.problems import ConfigError
from megarl.config.sft import SftConfig

CPU_LIMIT_S = 10
"""CPU seconds one example may use. The hypothesis deadline only judges an example once it returns; this
alarm (CPU time, so a loaded machine does not trip it) turns one that never returns into a failure."""
FUZZ = settings(
    max_examples=120,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
"""Every property: 120 examples, the same ones every run; the deadline (wall time) is far above the
milliseconds an example takes, so only a blow-up trips it."""


# --- the keys of a schema


def schema_keys(schema) -> dict[str, object]:
    """Every dotted key of `schema` with its type hint, sections included (`actor`, `actor.optim`, ...)."""
    keys = {}
    for field in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[field.name]
        keys[field.name] = hint
        if dataclasses.is_dataclass(hint):
            keys.update({f"{field.name}.{sub}": sub_hint for sub, sub_hint in schema_keys(hint).items()})
    return keys


# --- values

HUGE_INT_TEXTS = [
    "1" * 5000,
    "-" + "9" * 4400,
    "0x" + "f" * 5000,
    "0x" + "f" * 4000,
    "1_000_" + "0" * 5000,
    "9" * 4300 + ".5",
]
"""Integers past Python's 4300-digit limit of int <-> str conversion, as YAML text."""
SPECIAL_SCALARS = [
    "~",
    "null",
    "NULL",
    "",
    "true",
    "True",
    "yes",
    "no",
    "on",
    "off",
    "y",
    "n",
    ".inf",
    "-.inf",
    ".nan",
    ".NaN",
    "1e999",
    "-1e999",
    "1e-999",
    "0x1F",
    "0o17",
    "017",
    "0b101",
    "1_000",
    "1:20:30",
    "-0",
    "+1",
    "2001-12-14",
    "2001-12-14t21:59:43.10-05:00",
    "!!binary aGVsbG8=",
    "!!timestamp x",
    "!!timestamp 2001-13-45",
    "!!bool x",
    "!!set [1]",
    "!!map [1]",
    "!!set {a, b}",
    "!!omap [a: 1]",
    "!!str 3",
    "!!int x",
    "!!float abc",
    "!foo bar",
    "!!python/object/apply:os.system [echo]",
    "&a [*a]",
    "&a {x: *a}",
    "*undefined",
    "[1, [2, [3]]]",
    "{a: 1}",
    "{a: {b: {c: 1}}}",
    "[" * 300 + "]" * 300,
    "{a: " * 300 + "1" + "}" * 300,
    "? [a, b]",
    "{? [a, b]: 1}",
    "{<<: {a: 1}}",
    "{<<: [1]}",
    "{<<: 3}",
    "{a: 1, a: 2}",
    "'unterminated",
    '"\\x00"',
    '"\\ud800"',
    "- a",
    "a: b",
    "|\n  block",
    ">-\n  x",
    "%YAML 1.2",
    "---",
    "...",
    "#comment",
    "\t",
    "@",
    "`",
    "=",
    "a=b",
    "~/x",
    "~nosuchuser/x",
    "/",
    ".",
    "..",
    "a\\b",
    "C:\\x",
    "\x00",
    *HUGE_INT_TEXTS,
]
"""Plain YAML text that a parser reads as something other than a string, or not at all."""

EDGE_INTS = st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**63 - 1, 2**63, 2**64, -(2**64), 10**30, 10**400])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-320, 0.5, 1.5, 1e308, float("inf"), float("-inf"), float("nan")])
PATHS = st.sampled_from(
    [
        "",
        ".",
        "..",
        "/",
        "/tmp",
        "~",
        "~/x",
        "~nosuchuser/x",
        "model",
        "train.jsonl",
        "a.parquet",
        "org/name",
        "Qwen/Qwen2.5-0.5B",
        "a" * 300,
        "x/" * 100,
        "a\x00b",
        "pkg.mod:fn",
    ]
)
TEXTS = st.text(max_size=20) | st.sampled_from(SPECIAL_SCALARS) | PATHS
"""Strings: random unicode, empty, YAML-special and path-like."""

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(10**400), 10**400)
    | EDGE_INTS
    | st.floats()
    | EDGE_FLOATS
    | TEXTS
)
VALUES = st.recursive(
    SCALARS, lambda items: st.lists(items, max_size=3) | st.dictionaries(TEXTS, items, max_size=3), max_leaves=8
)
"""A value of any YAML type, nested."""


def typed_value(hint) -> st.SearchStrategy:
    """Values of the type `hint` (the edge cases of it), which load and so reach validation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(typed_value(member) for member in args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(typed_value(args[0]), max_size=3)
        return st.tuples(*(typed_value(member) for member in args)).map(list)
    if dataclasses.is_dataclass(hint):
        return st.fixed_dictionaries(
            {}, optional={f.name: typed_value(typing.get_type_hints(hint)[f.name]) for f in dataclasses.fields(hint)}
        )
    return {
        type(None): st.none(),
        bool: st.booleans(),
        int: EDGE_INTS | st.integers(),
        float: EDGE_FLOATS | st.floats(),
        str: TEXTS,
    }[hint]


# --- recipes and overrides

IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)


def key_paths(keys: dict[str, object]) -> st.SearchStrategy:
    """A known key, an unknown key inside a known section, or an unknown path (random, unicode)."""
    sections = [key for key, hint in keys.items() if dataclasses.is_dataclass(hint)]
    return (
        st.sampled_from(list(keys))
        | st.tuples(st.sampled_from(sections), IDENTIFIERS).map(".".join)
        | st.lists(IDENTIFIERS | st.text(min_size=1, max_size=6), min_size=1, max_size=3).map(".".join)
    )


def assignments(keys: dict[str, object]) -> st.SearchStrategy:
    """(key, value) pairs; a known key mostly gets a value of its own type."""

    def value_for(key):
        return typed_value(keys[key]) | VALUES if key in keys else VALUES

    return st.lists(key_paths(keys).flatmap(lambda key: st.tuples(st.just(key), value_for(key))), max_size=4)


def flow_yaml(value) -> str:
    """`value` as one line of YAML, as a user would type it after `key=`."""
    return (
        yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**9).removesuffix("\n...\n").strip()
    )


def typed_override(keys: dict[str, object]) -> st.SearchStrategy:
    """`key.sub=value` with a value of the key's own type, which loads."""
    return st.sampled_from(list(keys)).flatmap(
        lambda key: typed_value(keys[key]).map(lambda v: f"{key}={flow_yaml(v)}")
    )


def overrides(keys: dict[str, object]) -> st.SearchStrategy:
    """`key.sub=value` strings: typed or any values, raw YAML-special text, and malformed ones."""
    well_formed = st.tuples(key_paths(keys), st.builds(flow_yaml, VALUES) | TEXTS).map("=".join)
    typed = typed_override(keys)
    malformed = st.text(max_size=12) | st.sampled_from(
        ["=", "=1", "a..b=1", "a.=1", ".a=1", "-x=1", "a b=1", "actor.optim.lr", "1a=2", "actor.optim.lr==1"]
    )
    return st.lists(well_formed | typed | malformed, max_size=3)


def set_path(tree: dict, key: str, value) -> None:
    """`tree[a][b][c] = value` for `a.b.c`, making (or replacing with) mappings on the way."""
    *parents, leaf = key.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[leaf] = value


def recipe_text(base: dict, pairs: list[tuple[str, object]], raw: tuple[str, str, str] | None) -> str:
    """The base recipe with `pairs` set, dumped; `raw` (section, key, text) appends `section:\\n  key: text`
    unquoted, as a user would type it."""
    tree = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    for key, value in pairs:
        set_path(tree, key, value)
    text = yaml.safe_dump(tree, allow_unicode=True, sort_keys=False) if tree else ""
    if raw is not None:
        text += f"{raw[0]}:\n  {raw[1]}: {raw[2]}\n"
    return text


RAW_LINES = st.none() | st.tuples(
    IDENTIFIERS | st.sampled_from(["trainer", "actor", "zz"]),
    IDENTIFIERS | st.just("seed"),
    st.sampled_from(SPECIAL_SCALARS) | st.text(max_size=20),
)


# --- the properties


@contextlib.contextmanager
def cpu_bound(seconds: float):
    """Raise `TimeoutError` in the example once it has used `seconds` of CPU time (SIGVTALRM: pytest-timeout
    owns SIGALRM)."""

    def stop(signum, frame):
        raise TimeoutError(f"one example used more than {seconds} CPU seconds: a hang")

    previous = signal.signal(signal.SIGVTALRM, stop)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def load(path: Path, override_list: list[str], schema):
    """The loaded config, or the `ConfigError` (anything else propagates and fails the property)."""
    try:
        return load_config(path, override_list, schema=schema)
    except ConfigError as error:
        assert error.problems and all(str(problem) for problem in error.problems)  # the message can be printed
        return error


def validate_exit_code(recipe: Path, override_list: list[str], check_files: bool) -> int:
    """`megarl validate RECIPE OVERRIDES...` in-process (the function the CLI runs), output swallowed."""
    args = argparse.Namespace(
        config=str(recipe), overrides=override_list, no_file_checks=not check_files, gpu_memory_gib=80.0
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = validate_command(args)
    assert "Traceback" not in err.getvalue()
    return code


def base_recipe(workdir: Path) -> dict:
    return yaml.safe_load((workdir / "base.yaml").read_text())


def started_nothing(modules_before: set[str], children_before: set[int]) -> None:
    """No Ray, vLLM or Megatron imported and no process started by what ran (against what this process had
    before: in a whole-suite run, earlier tests may have imported them)."""
    new = {name.split(".")[0] for name in set(sys.modules) - modules_before}
    assert not new & {"ray", "vllm", "megatron"}, new
    assert {child.pid for child in psutil.Process().children()} <= children_before


@pytest.mark.parametrize("schema", [Config, SftConfig], ids=["train", "sft"])
def test_any_recipe_loads_or_raises_config_error(workdir, tmp_path_factory, schema):
    recipe = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    keys, base = schema_keys(schema), base_recipe(workdir) if schema is Config else {}
    examples = []

    @FUZZ
    @given(pairs=assignments(keys), raw=RAW_LINES, override_list=overrides(keys))
    def check(pairs, raw, override_list):
        examples.append(1)
        recipe.write_text(recipe_text(base, pairs, raw))
        with cpu_bound(CPU_LIMIT_S):
            result = load(recipe, override_list, schema)
        assert isinstance(result, (schema, ConfigError))

    check()
    print(f"{schema.__name__}: {len(examples)} examples")


def test_any_file_content_loads_or_raises_config_error(tmp_path):
    recipe, examples = tmp_path / "recipe.yaml", []

    @FUZZ
    @given(
        content=st.binary(max_size=64)
        | st.text(max_size=64).map(str.encode)
        | st.sampled_from(SPECIAL_SCALARS).map(str.encode)
    )
    def check(content):
        examples.append(1)
        recipe.write_bytes(content)
        with cpu_bound(CPU_LIMIT_S):
            assert isinstance(load(recipe, [], Config), (Config, ConfigError))

    check()
    print(f"file content: {len(examples)} examples")


def test_validate_exits_0_or_2_and_starts_nothing(workdir, tmp_path_factory):
    """The base recipe with values of each key's own type (edge cases: 0, negatives, 2**64, inf, nan, odd
    strings), which load and so reach every semantic check, the memory estimate and the batch plan; half
    the examples add only such overrides, half any overrides."""
    recipe = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    keys, base, examples = schema_keys(Config), base_recipe(workdir), []
    modules_before, children_before = set(sys.modules), {child.pid for child in psutil.Process().children()}
    assert validate_exit_code(workdir / "base.yaml", [], check_files=True) == 0
    leaves = [key for key, hint in keys.items() if not dataclasses.is_dataclass(hint)]
    typed_pairs = st.lists(
        st.sampled_from(leaves).flatmap(lambda key: st.tuples(st.just(key), typed_value(keys[key]))),
        min_size=1,
        max_size=4,
    )

    @FUZZ
    @given(
        pairs=typed_pairs,
        override_list=st.lists(typed_override(keys), max_size=2) | overrides(keys),
        check_files=st.booleans(),
    )
    def check(pairs, override_list, check_files):
        examples.append(1)
        recipe.write_text(recipe_text(base, pairs, None))
        with cpu_bound(CPU_LIMIT_S):
            assert validate_exit_code(recipe, override_list, check_files) in (0, 2)

    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
    check()
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before  # nothing written
    started_nothing(modules_before, children_before)
    print(f"validate: {len(examples)} examples")


# --- what the fuzz found: each used to end in another exception or a hang (issue 18)

NO_USER = "~megarl-no-such-user/x"
LONG_NAME = "a" * 300
"""A file name longer than the 255 bytes of Linux file systems: looking at it fails with ENAMETOOLONG."""
FOUND = [
    # PyYAML's constructors raised ValueError / KeyError / AttributeError / TypeError on a tag they cannot read
    ("tag-int-unreadable", ["rollout.stop=[!!int x]"], "rollout.stop", "('x' cannot be read as !!int"),
    ("tag-bool-unreadable", ["rollout.stop=[!!bool x]"], "rollout.stop", "('x' cannot be read as !!bool)"),
    (
        "tag-timestamp-unreadable",
        ["trainer.project_name=!!timestamp x"],
        "trainer.project_name",
        "('x' cannot be read as !!timestamp)",
    ),
    ("tag-set-of-a-list", ["rollout.stop=!!set [1]"], "rollout.stop", "(the value cannot be read as !!set)"),
    # ValueError: Python converts at most 4300 digits between int and str
    (
        "integer-of-5000-digits",
        ["trainer.seed=" + "1" * 5000],
        "trainer.seed",
        "('11111111111111111111'... (5000 characters) cannot be read as !!int (an integer of at most 4300 digits)",
    ),
    (
        "hex-integer-of-4800-digits",
        ["trainer.seed=0x" + "f" * 4000],
        "trainer.seed",
        "(4002 characters) cannot be read as !!int (an integer of at most 4300 digits)",
    ),
    # RecursionError
    (
        "alias-inside-its-anchor",
        ["rollout.stop=&a [*a]"],
        "rollout.stop",
        "(the alias *a stands for a value that contains it (a value that holds itself)",
    ),
    (
        "nested-1000-deep",
        ["rollout.stop=" + "[" * 1000 + "]" * 1000],
        "rollout.stop",
        "(values nested more than 32 levels deep",
    ),
    # RuntimeError: Could not determine home directory (pathlib's expanduser)
    (
        "unknown-user-model",
        [f"model.path={NO_USER}"],
        "model.path",
        "~megarl-no-such-user is no user of this machine, so the path cannot be expanded",
    ),
    (
        "unknown-user-tokenizer",
        [f"model.tokenizer_path={NO_USER}"],
        "model.tokenizer_path",
        "is no user of this machine",
    ),
    ("unknown-user-data", [f"data.train_files=[{NO_USER}.jsonl]"], "data.train_files[0]", "is no user of this machine"),
    (
        "unknown-user-output",
        [f"trainer.output_dir={NO_USER}"],
        "trainer.output_dir",
        "is no user of this machine, so the path cannot be expanded; fix: write the directory out in full",
    ),
    ("unknown-user-resume", [f"checkpoint.resume={NO_USER}"], "checkpoint.resume", "is no user of this machine"),
    (
        "unknown-user-reward-model",
        [f"reward.reward_model={NO_USER}"],
        "reward.reward_model",
        "is no user of this machine",
    ),
    # OSError: [Errno 36] File name too long (pathlib's is_dir / exists ignore only ENOENT-like errors)
    (
        "long-name-data",
        [f"data.train_files=[{LONG_NAME}.jsonl]"],
        "data.train_files[0]",
        "cannot be looked at (File name too long)",
    ),
    ("long-name-model", [f"model.path={LONG_NAME}"], "model.path", "cannot be looked at (File name too long)"),
    (
        "long-name-output",
        [f"trainer.output_dir={LONG_NAME}"],
        "trainer.output_dir",
        "cannot be looked at (File name too long)",
    ),
    (
        "long-name-resume",
        [f"checkpoint.resume={LONG_NAME}"],
        "checkpoint.resume",
        "cannot be looked at (File name too long)",
    ),
    # hangs: a loop over every rollout engine, and over every number up to a batch size
    (
        "engines-beyond-counting",
        ["placement.nnodes=1000000000000000000000000000000"],
        "data.train_batch_size",
        "32 samples do not split evenly over 4000000000000000000000000000000 GPUs",
    ),
    (
        "batch-beyond-counting",
        ["data.train_batch_size=9223372036854775807"],
        "actor.ppo_mini_batch_size",
        "fix: use a divisor of 9223372036854775807 that also fits DP 2: 1, 7, 49, 73, 127, 337",
    ),
    # OverflowError: cannot convert float infinity to integer (the memory estimate in bytes)
    ("kv-cache-of-1e308-gib", ["rollout.kv_cache_gib=1e308"], "rollout.kv_cache_gib", "must lie in (0, 1048576] GiB"),
]


@pytest.mark.parametrize("overrides, key, message", [case[1:] for case in FOUND], ids=[case[0] for case in FOUND])
def test_what_the_fuzz_found_exits_2_naming_the_key(workdir, capsys, overrides, key, message):
    with cpu_bound(CPU_LIMIT_S):
        code, out, err = run_validate(capsys, "base.yaml", *overrides)
    assert (code, out) == (2, "")
    assert "Traceback" not in err
    assert [line for line in error_lines(err) if line.startswith(f"error: {key} ") and message in line], err
