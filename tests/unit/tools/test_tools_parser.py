"""The hermes parser reads every call of a turn, in order, makes each unreadable one a message (never raises),
and checks each call's arguments against its tool's schema (the one the chat template shows the model)."""

import re

import pytest
from transformers.utils import get_json_schema

from megarl.tools import CallError, ParsedTurn, ToolCall, parser_for


@pytest.fixture
def parser():
    """No schemas: every readable call passes (a name without a schema is the ToolSet's to answer)."""
    return parser_for("hermes", [])


def test_one_call_with_text_around_it(parser):
    turn = parser.parse(
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
        "</tool_call> Then I answer."
    )
    assert turn == ParsedTurn(calls=[ToolCall("calculator", {"expression": "2+2"})], errors=[])
    assert (parser.start_tag, parser.end_tag) == ("<tool_call>", "</tool_call>")


def test_several_calls_in_one_turn_keep_their_order_and_nested_arguments(parser):
    turn = parser.parse(
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
        '<tool_call>{"name": "plan", "arguments": {"steps": [{"id": 1, "tags": ["x"]}], "deep": '
        '{"a": {"b": null}}}}</tool_call>'
    )
    assert turn.errors == []
    assert turn.calls == [
        ToolCall("search", {"query": "a"}),
        ToolCall("plan", {"steps": [{"id": 1, "tags": ["x"]}], "deep": {"a": {"b": None}}}),
    ]


def test_a_call_without_arguments_has_none(parser):
    assert parser.parse('<tool_call>{"name": "now"}</tool_call>').calls == [ToolCall("now", {})]


def test_a_last_call_cut_at_its_end_tag_still_counts(parser):
    # Generation stopped at "</tool_call>" (a stop string the engine leaves out of the text).
    turn = parser.parse('I search. <tool_call>{"name": "search", "arguments": {"query": "x"}}')
    assert turn.calls == [ToolCall("search", {"query": "x"})] and turn.errors == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "search", "arguments": {"query": "x"}', r"tool call 1: invalid JSON \(Expecting ',' delimiter"),
        ('{"arguments": {"query": "x"}}', r'tool call 1: no "name" string in'),
        ('{"name": "", "arguments": {}}', r'tool call 1: no "name" string in'),
        (
            '{"name": "search", "arguments": "query=x"}',
            r'tool call 1: "arguments" of search is a JSON str, not an object',
        ),
        ('["search", {"query": "x"}]', r'tool call 1: a JSON list instead of an object with "name" and "arguments"'),
    ],
)
def test_each_malformed_call_is_an_error_message(parser, body, message):
    turn = parser.parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == []
    assert len(turn.errors) == 1
    assert turn.errors[0].kind == "malformed" and re.match(message, turn.errors[0].message), turn.errors[0]


def test_good_and_bad_calls_of_one_turn_are_told_apart(parser):
    turn = parser.parse(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{oops}</tool_call> '
        '<tool_call>{"name": "b", "arguments": {"n": 1}}</tool_call>'
    )
    assert turn.calls == [ToolCall("a", {}), ToolCall("b", {"n": 1})]
    assert len(turn.errors) == 1 and turn.errors[0].message.startswith("tool call 2: invalid JSON")


def test_text_without_calls_has_none(parser):
    assert parser.parse("The answer is 4.") == ParsedTurn([], [])


def test_an_unknown_format_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tool_format 'react': unknown; use one of hermes"):
        parser_for("react", [])


def plan(
    title: str,
    steps: int,
    weight: float = 1.0,
    draft: bool = False,
    tags: list[str] | None = None,
    meta: dict | None = None,
) -> str:
    """Plan something (a tool of every basic JSON type; its schema is read as the ToolSet reads one).

    Args:
        title: A name.
        steps: How many.
        weight: How much.
        draft: Whether a draft.
        tags: Labels.
        meta: Anything else.
    """
    return title


@pytest.fixture
def checking():
    return parser_for("hermes", [get_json_schema(plan)])


def call(arguments: str, name: str = "plan") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_calls_that_fit_their_schema_pass(checking):
    turn = checking.parse(
        call('{"title": "a", "steps": 3}')
        + call('{"title": "b", "steps": 2.0, "weight": 2, "draft": true, "tags": ["x"], "meta": {"k": 1}}')
    )
    assert turn.errors == []
    assert [c.arguments["title"] for c in turn.calls] == ["a", "b"]
    # Optional arguments may be null (`tags: list[str] | None`), and a name without a schema passes: the
    # ToolSet is the one place that answers an unknown tool.
    turn = checking.parse(call('{"title": "c", "steps": 1, "tags": null}') + call('{"x": 1}', name="nope"))
    assert turn.errors == [] and [c.name for c in turn.calls] == ["plan", "nope"]


SIGNATURE = (
    "plan takes title (string, required), steps (integer, required), weight (number), draft (boolean), "
    "tags (array), meta (object)"
)


@pytest.mark.parametrize(
    "arguments, problem",
    [
        ('{"title": "a"}', "missing required argument 'steps'"),
        ("{}", "missing required argument 'title'; missing required argument 'steps'"),
        ('{"title": "a", "steps": 1, "color": "red"}', "unknown argument 'color'"),
        ('{"title": 7, "steps": 1}', "argument 'title' must be string, not integer 7"),
        ('{"title": "a", "steps": 1.5}', "argument 'steps' must be integer, not number 1.5"),
        ('{"title": "a", "steps": true}', "argument 'steps' must be integer, not boolean True"),
        ('{"title": "a", "steps": 1, "weight": "2"}', "argument 'weight' must be number, not string '2'"),
        ('{"title": "a", "steps": 1, "draft": 1}', "argument 'draft' must be boolean, not integer 1"),
        ('{"title": "a", "steps": 1, "tags": "x"}', "argument 'tags' must be array or null, not string 'x'"),
        ('{"title": "a", "steps": 1, "meta": []}', "argument 'meta' must be object or null, not array []"),
    ],
)
def test_each_call_that_does_not_fit_its_schema_is_a_bad_arguments_error(checking, arguments, problem):
    turn = checking.parse(call(arguments))
    assert turn.calls == []
    assert turn.errors == [CallError("bad_arguments", f"tool call 1 (plan): {problem}; {SIGNATURE}", "plan")]


def test_a_bad_call_among_good_ones_is_numbered_and_the_others_run(checking):
    turn = checking.parse(call('{"title": "a", "steps": 1}') + call('{"title": "b"}') + "<tool_call>{oops</tool_call>")
    assert turn.calls == [ToolCall("plan", {"title": "a", "steps": 1})]
    assert [(e.kind, e.message.split(":")[0]) for e in turn.errors] == [
        ("bad_arguments", "tool call 2 (plan)"),
        ("malformed", "tool call 3"),
    ]
