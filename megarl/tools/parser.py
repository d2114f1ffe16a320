"""Reading the tool calls out of a model's turn (`rollout.multi_turn.tool_format`).

    parser = parser_for("hermes")
    turn = parser.parse('I will look it up. <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>')
    turn.calls    # [ToolCall(name="search", arguments={"query": "x"})]
    turn.errors   # [] ; one message per call that could not be read (the caller answers it as "malformed")

Parsing never raises: whatever the model wrote, a bad call becomes an error message the model can read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megarl.tools.calls import ToolCall

EXCERPT_CHARS = 200
"""How much of a malformed call an error message quotes."""


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn, in the order written, and one message per call that could not be read."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes), any text around them.

    A last `<tool_call>` without its end tag counts as a call too: generation stopped at the end tag
    (a stop string that the engine leaves out of the text) or ran out of tokens (then its JSON is
    usually cut, and reported as malformed)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self):
        self._block = re.compile(re.escape(self.start_tag) + r"(.*?)(?:" + re.escape(self.end_tag) + r"|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        for number, match in enumerate(self._block.finditer(text), start=1):
            call, error = self._read_call(match.group(1).strip())
            if error is None:
                turn.calls.append(call)
            else:
                turn.errors.append(f"tool call {number}: {error}")
        return turn

    def _read_call(self, body: str) -> tuple[ToolCall | None, str | None]:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as error:
            return None, f"invalid JSON ({error}) in {_excerpt(body)}; write {self.start_tag}" \
                         f'{{"name": "<tool>", "arguments": {{...}}}}{self.end_tag}'
        if not isinstance(data, dict):
            return None, f"a JSON {type(data).__name__} instead of an object with \"name\" and \"arguments\""
        name = data.get("name")
        if not isinstance(name, str) or not name:
            return None, f'no "name" string in {_excerpt(body)}'
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            return None, f'"arguments" of {name} is a JSON {type(arguments).__name__}, not an object of named arguments'
        return ToolCall(name=name, arguments=arguments), None


PARSERS = {"hermes": HermesParser}
"""Parsers by `rollout.multi_turn.tool_format`."""


def parser_for(tool_format: str) -> HermesParser:
    """The parser of `tool_format` (a `rollout.multi_turn.tool_format` value)."""
    try:
        return PARSERS[tool_format]()
    except KeyError:
        raise ValueError(f"rollout.multi_turn.tool_format {tool_format!r}: unknown; use one of "
                         f"{', '.join(PARSERS)}") from None


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "...")
