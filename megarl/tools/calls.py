"""What a tool call is, what it returns, and the error that stops a run before any call is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ToolFailure = Literal["unknown_tool", "raised", "timeout", "bad_return", "malformed", "bad_arguments"]
"""Why a call produced no regular observation: no tool of that name; the tool raised (or its process
died); it ran past its time limit (its process group was killed); it returned a non-string; the
model's call could not be parsed; its arguments do not fit the tool's schema (missing, unknown or of
the wrong JSON type: the parser's check, the call does not run)."""


class ToolError(RuntimeError):
    """A tool cannot be used at all (it does not resolve, has no schema, its corpus is unreadable):
    a configuration or code bug that stops the run at start-up. The message names the setting
    (`rollout.multi_turn.tools[i].function`, `rollout.multi_turn.search.corpus`), the value and the fix."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its JSON arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    """What one call produced."""

    text: str
    """The observation the model reads: the tool's string, or an error observation when it failed."""
    error: ToolFailure | None
    """None for a regular result, else why the call failed (`ToolFailure`)."""
    latency_s: float
    """Seconds from the call's dispatch to its result (0 for calls that never ran)."""

    @classmethod
    def failed(cls, error: ToolFailure, text: str, latency_s: float = 0.0) -> ToolResult:
        """A failed call's result, e.g. `ToolResult.failed("malformed", parse_error)`."""
        return cls(text=text, error=error, latency_s=latency_s)


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())
