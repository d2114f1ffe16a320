"""Reading the tool calls out of a model's turn (`rollout.multi_turn.tool_format`), checked against the
tools' schemas.

    parser = parser_for("hermes", toolset.schemas())
    turn = parser.parse('I will look it up. <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>')
    turn.calls    # [ToolCall(name="search", arguments={"query": "x"})]
    turn.errors   # [] ; one CallError per call that cannot run: "malformed" (unreadable) or "bad_arguments"

Parsing never raises: whatever the model wrote, a bad call becomes an error message the model can read.
A call of a tool that has no schema here is passed on as it is: the ToolSet answers an unknown name.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

from megarl.tools.arguments import argument_problems
from megarl.tools.calls import ToolCall, ToolFailure

EXCERPT_CHARS = 200
"""How much of a malformed call an error message quotes."""


@dataclass(frozen=True)
class CallError:
    """A call the parser does not pass on; the model reads `message` as its observation."""

    kind: ToolFailure
    """"malformed" (it cannot be read) or "bad_arguments" (its arguments do not fit its tool's schema)."""
    message: str
    name: str = ""
    """The tool it names, when that could be read."""


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn that may run, in the order written, and one error per call that may not."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Hermes), any text around them.

    A last `<tool_call>` without its end tag counts as a call too: generation stopped at the end tag
    (a stop string that the engine leaves out of the text) or ran out of tokens (then its JSON is
    usually cut, and reported as malformed)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, schemas: list[dict]):
        """schemas: the tools' OpenAI-style schemas (`ToolSet.schemas()`)."""
        self._block = re.compile(re.escape(self.start_tag) + r"(.*?)(?:" + re.escape(self.end_tag) + r"|\Z)", re.DOTALL)
        self._parameters = {schema["function"]["name"]: schema["function"].get("parameters", {}) for schema in schemas}

    def parse(self, text: str) -> ParsedTurn:
        turn = ParsedTurn()
        for number, match in enumerate(self._block.finditer(text), start=1):
            call, error = self._read_call(match.group(1).strip())
            if error is not None:
                turn.errors.append(CallError("malformed", f"tool call {number}: {error}"))
                continue
            parameters = self._parameters.get(call.name)  # None: an unknown name, which the ToolSet answers
            problems = [] if parameters is None else argument_problems(call.arguments, parameters)
            if problems:
                turn.errors.append(
                    CallError(
                        "bad_arguments",
                        f"tool call {number} ({call.name}): {'; '.join(problems)}; {self._signature(call.name)}",
                        call.name,
                    )
                )
            else:
                turn.calls.append(call)
        return turn

    def _signature(self, name: str) -> str:
        """What the tool takes, as the fix of a bad call: `calculator takes expression (string, required)`."""
        parameters = self._parameters[name]
        required = set(parameters.get("required", ()))
        taken = [
            f"{argument} ({properties.get('type', 'any')}{', required' if argument in required else ''})"
            for argument, properties in parameters.get("properties", {}).items()
        ]
        return f"{name} takes {', '.join(taken) or 'no arguments'}"

    def _read_call(self, body: str) -> tuple[ToolCall | None, str | None]:
        fix = f'write {self.start_tag}{{"name": "<tool>", "arguments": {{...}}}}{self.end_tag}'
        try:
            data = json.loads(body)
            # An escaped lone surrogate ("\\ud800") decodes to a str that no UTF-8 encoder (tokenizer, log) takes.
            json.dumps(data, ensure_ascii=False).encode()
        except json.JSONDecodeError as error:
            return None, f"invalid JSON ({error}) in {_excerpt(body)}; {fix}"
        except RecursionError:
            return None, f"JSON nested too deeply to read in {_excerpt(body)}; {fix}"
        except UnicodeEncodeError:
            return None, f"a string with an unpaired surrogate escape (not text) in {_excerpt(body)}; {fix}"
        except ValueError:  # the one other ValueError of json.loads: an integer past int()'s digit limit
            return None, f"a number of more than {sys.get_int_max_str_digits()} digits in {_excerpt(body)}; {fix}"
        if not isinstance(data, dict):
            return None, f'a JSON {type(data).__name__} instead of an object with "name" and "arguments"'
        name = data.get("name")
        if not isinstance(name, str) or not name:
            return None, f'no "name" string in {_excerpt(body)}'
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            return None, f'"arguments" of {name} is a JSON {type(arguments).__name__}, not an object of named arguments'
        return ToolCall(name=name, arguments=arguments), None


PARSERS = {"hermes": HermesParser}
"""Parsers by `rollout.multi_turn.tool_format`."""


def parser_for(tool_format: str, schemas: list[dict]) -> HermesParser:
    """The parser of `tool_format` (a `rollout.multi_turn.tool_format` value) for the tools of `schemas`."""
    if tool_format not in PARSERS:
        raise ValueError(f"rollout.multi_turn.tool_format {tool_format!r}: unknown; use one of {', '.join(PARSERS)}")
    return PARSERS[tool_format](schemas)


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "...")
