"""Checks of command-line arguments shared by megarl's sub-commands.

A bad number stops argparse itself (exit 2, the usage line and the flag named); a bad output
directory is refused before anything is written.
"""

import argparse
import math
from pathlib import Path

from megarl.config.resources import writable_dir_problem


def positive_float(upper: float = math.inf):
    """An argparse `type`: a finite number in (0, `upper`]. float() alone takes inf and nan, which
    pass a `> 0` check and then make sizes that never finish (a bucket of inf MiB) or comparisons that never fail."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and 0 < value <= upper):
            bound = f" and at most {upper:.15g}" if math.isfinite(upper) else ""
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0{bound}")
        return value

    return parse


def output_dir_problem(out: Path, *, overwrite: bool) -> str | None:
    """Why `--out` cannot receive a command's files (None if it can): it cannot be created or written, or,
    without --overwrite, it is a directory that already holds files (a real model's weights, a real dataset)."""
    problem = writable_dir_problem("--out", str(out))
    if problem is not None:
        return f"--out {out}: {problem.why}; {problem.fix}"
    held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        return (
            f"--out {out} is not empty (holds {shown}): choose an empty or new directory, or pass --overwrite "
            "to replace the files this command writes there"
        )
    return None


def output_file_problem(flag: str, path: Path) -> str | None:
    """Why a command could not write its result file `path` (None if it could): a directory is there, or
    its directory cannot be created or written. Checked before the work that produces the result."""
    if path.is_dir():
        return f"{flag} {path} is a directory; name a file in it, e.g. {path / 'result.json'}"
    problem = writable_dir_problem(flag, str(path.parent))
    return None if problem is None else f"{flag} {path}: {problem.why}; {problem.fix}"
