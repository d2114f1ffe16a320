"""Checking a call's arguments against its tool's OpenAI-style schema, before the call runs.

    argument_problems({"expr": "2+2"}, calculator_schema["function"]["parameters"])
    # ["missing required argument 'expression'", "unknown argument 'expr'"]

The schemas are the ones the chat template shows the model (`ToolSet.schemas`, read from each tool's
type hints by `transformers.utils.get_json_schema`), so the model is told exactly what it got wrong
against what it was shown. Only the JSON types of the top-level arguments are checked (string,
number, integer, boolean, array, object, null; a list of types; `nullable`); what is inside an array
or an object is the tool's to judge.
"""

from __future__ import annotations

import reprlib

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
"""The Python values `json.loads` gives for each JSON-schema type."""


def argument_problems(arguments: dict, parameters: dict) -> list[str]:
    """What is wrong with `arguments` (a parsed call's) for a tool whose schema's "parameters" is
    `parameters`: missing required arguments, arguments it does not take, values of the wrong JSON
    type; [] when the call may run."""
    properties = parameters.get("properties", {})
    problems = [
        f"missing required argument {name!r}" for name in parameters.get("required", ()) if name not in arguments
    ]
    problems += [f"unknown argument {name!r}" for name in arguments if name not in properties]
    for name, value in arguments.items():
        expected = _types(properties.get(name, {}))
        if expected and not any(_is_type(value, kind) for kind in expected):
            problems.append(
                f"argument {name!r} must be {' or '.join(expected)}, not {_json_type(value)} {_excerpt(value)}"
            )
    return problems


def _types(schema: dict) -> list[str]:
    """The JSON types a property accepts ([] for any)."""
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if not kinds or any(kind not in JSON_TYPES for kind in kinds):  # none given, or one this check does not know
        return []
    return kinds + ["null"] * bool(schema.get("nullable"))


def _is_type(value, kind: str) -> bool:
    if isinstance(value, bool):  # a JSON true is a Python int too, but never a number
        return kind == "boolean"
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()  # JSON schema: 3.0 is an integer
    return isinstance(value, JSON_TYPES[kind])


def _json_type(value) -> str:
    return next(
        kind for kind in ("boolean", "integer", "number", "string", "array", "object", "null") if _is_type(value, kind)
    )


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 3  # a model may nest a value as deep as JSON allows: repr() would recurse as deep
_SHORT_REPR.maxstring = 60
"""A repr bounded in depth and length, whatever the value (megabytes, deep nesting)."""


def _excerpt(value, chars: int = 40) -> str:
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= chars else text[:chars] + "..."
