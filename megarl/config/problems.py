"""What a bad config reports: one `Problem` per mistake, all of them gathered into one `ConfigError`."""

import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One mistake in a config: where it is, what was found, why it is wrong and how to fix it."""

    key: str
    """Dotted key path, e.g. `actor.parallel.tensor_model_parallel_size` (or `<override>` for a malformed one)."""
    value: object
    """The offending value as the user wrote it (or as loaded from defaults)."""
    why: str
    """Why the value is wrong; shows the arithmetic for divisibility rules."""
    fix: str
    """What to write instead."""

    def __str__(self) -> str:
        return f"{self.key} = {_yaml_like(self.value)}: {self.why}; fix: {self.fix}"


def _yaml_like(value) -> str:
    """The value as the user wrote it in YAML: true/false/null, strings quoted, tuples as lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_like(item) for item in value) + "]"
    return repr(value)


class ConfigError(ValueError):
    """A config that cannot be used; `problems` lists every mistake found, not only the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


def non_ascii_note(value) -> str:
    """For a name that looks right but is not (`grpо` with a Cyrillic o): its first non-ASCII character,
    its code point and 1-based position; "" for anything else. Every megarl name is ASCII."""
    if not isinstance(value, str):
        return ""
    for position, char in enumerate(value, start=1):
        if not char.isascii():
            name = unicodedata.name(char, "unnamed character")
            return f" (character {position}, {char!r}, is U+{ord(char):04X} {name}, not ASCII: retype the name)"
    return ""
