"""`validate` finds a user's reward function without running the user's code (issue 18, item 6):
the module is located as the import system would (top-level name through `importlib.util.find_spec`,
which locates without importing; each sub-name through `importlib.machinery.PathFinder` in its
parent's `submodule_search_locations`, which is how `importlib._bootstrap._find_and_load` searches a
submodule once the parent is imported) and its source is parsed. And what Python accepts as a
module attribute is accepted: a `def` inside try/except or if, and `from x import *`."""

import sys
import textwrap

import pytest

from megarl.config.resources import reward_function_problem

RAISING_INIT = "open(__file__ + '.ran', 'w').close()\nraise RuntimeError('the package __init__ ran')\n"


@pytest.fixture
def package(tmp_path, monkeypatch):
    """`user_pkg/` on sys.path whose __init__ leaves a marker and raises if anything executes it."""
    root = tmp_path / "user_pkg"
    root.mkdir()
    (root / "__init__.py").write_text(RAISING_INIT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    sys.modules.pop("user_pkg", None)


def write(package, name: str, source: str) -> None:
    (package / f"{name}.py").write_text(textwrap.dedent(source))


def test_a_package_whose_init_raises_is_searched_not_run(package):
    write(package, "rewards", "def score(prompts, completions, **columns):\n    return [0.0] * len(prompts)\n")
    assert reward_function_problem("reward.function", "user_pkg.rewards:score") is None
    assert not (package / "__init__.py.ran").exists()
    assert "user_pkg" not in sys.modules
    problem = reward_function_problem("reward.function", "user_pkg.rewards:nope")
    assert problem is not None and "defines no top-level nope" in problem.why
    assert not (package / "__init__.py.ran").exists()


def test_a_missing_submodule_is_named_without_running_the_package(package):
    problem = reward_function_problem("reward.function", "user_pkg.missing:score")
    assert problem is not None and "module user_pkg.missing cannot be imported" in problem.why
    assert not (package / "__init__.py.ran").exists()


@pytest.mark.parametrize(
    "source",
    [
        """
    try:
        import numpy
    except ImportError:
        numpy = None
    else:
        pass

    try:
        import fast_scores
    except ImportError:
        def score(prompts, completions, **columns):
            return [0.0] * len(prompts)
    """,
        """
    import os

    if os.environ.get("FAST"):
        score = None
    else:
        def score(prompts, completions, **columns):
            return [0.0] * len(prompts)
    """,
        "from user_helpers import *\n",  # its names are only known by importing it
    ],
)
def test_what_python_binds_at_module_level_is_accepted(package, source):
    write(package, "rewards", source)
    assert reward_function_problem("reward.function", "user_pkg.rewards:score") is None


def test_a_function_inside_nested_namespace_packages_is_found_without_importing_them(tmp_path, monkeypatch):
    """`tests.e2e.trainer.bad_rewards:flaky` style paths through directories without `__init__.py`: a
    namespace package's own search path needs its parent imported (KeyError otherwise); the lookup
    walks the directories itself."""
    import sys

    from megarl.config.resources import reward_function_problem

    (tmp_path / "nsroot" / "inner").mkdir(parents=True)
    (tmp_path / "nsroot" / "inner" / "rewards.py").write_text(
        "def score(prompts, responses, **columns):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_function_problem("reward.function", "nsroot.inner.rewards:score") is None
    missing = reward_function_problem("reward.function", "nsroot.inner.rewards:nope")
    assert missing is not None and "defines no top-level nope" in missing.why
    assert "nsroot" not in sys.modules and "nsroot.inner" not in sys.modules
