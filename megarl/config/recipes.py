"""Where a recipe path points: the file named, or the copy of a shipped recipe inside the package.

The recipes of the repository's `configs/` ship in megarl itself (`megarl/configs`, package data of the
wheel), so that the commands the documentation writes, e.g. `megarl validate configs/quickstart.yaml`,
work after `pip install megarl` from any directory: a relative `configs/<name>` that does not exist here
is read from the installed copy. A file that exists is always the one read.
"""

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The recipes installed with megarl (in a checkout, a link to the repository's configs/)."""
PREFIX = "configs"
"""The directory name the documentation's recipe paths start with."""


def recipe_path(path: str | Path) -> Path:
    """`path` when it exists or is not a `configs/<name>` path; else the shipped recipe of that name,
    when there is one (the caller's error then names `path` as given)."""
    path = Path(path)
    if path.exists() or path.is_absolute() or path.parts[:1] != (PREFIX,):
        return path
    shipped = SHIPPED_DIR.joinpath(*path.parts[1:])
    return shipped if shipped.is_file() else path


def shipped_recipes() -> list[str]:
    """The shipped recipes as the documentation names them, e.g. `configs/quickstart.yaml`."""
    return sorted(f"{PREFIX}/{path.name}" for path in SHIPPED_DIR.glob("*.yaml"))
