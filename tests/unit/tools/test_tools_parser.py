"""The hermes parser reads every call of a turn, in order, and makes each unreadable one a message (never raises)."""

import re

import pytest

from megarl.tools import ParsedTurn, ToolCall, parser_for


@pytest.fixture
def parser():
    return parser_for("hermes")


def test_one_call_with_text_around_it(parser):
    turn = parser.parse('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
                        '</tool_call> Then I answer.')
    assert turn == ParsedTurn(calls=[ToolCall("calculator", {"expression": "2+2"})], errors=[])
    assert (parser.start_tag, parser.end_tag) == ("<tool_call>", "</tool_call>")


def test_several_calls_in_one_turn_keep_their_order_and_nested_arguments(parser):
    turn = parser.parse('<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
                        '<tool_call>{"name": "plan", "arguments": {"steps": [{"id": 1, "tags": ["x"]}], "deep": '
                        '{"a": {"b": null}}}}</tool_call>')
    assert turn.errors == []
    assert turn.calls == [ToolCall("search", {"query": "a"}),
                          ToolCall("plan", {"steps": [{"id": 1, "tags": ["x"]}], "deep": {"a": {"b": None}}})]


def test_a_call_without_arguments_has_none(parser):
    assert parser.parse('<tool_call>{"name": "now"}</tool_call>').calls == [ToolCall("now", {})]


def test_a_last_call_cut_at_its_end_tag_still_counts(parser):
    # Generation stopped at "</tool_call>" (a stop string the engine leaves out of the text).
    turn = parser.parse('I search. <tool_call>{"name": "search", "arguments": {"query": "x"}}')
    assert turn.calls == [ToolCall("search", {"query": "x"})] and turn.errors == []


@pytest.mark.parametrize("body, message", [
    ('{"name": "search", "arguments": {"query": "x"}', r"tool call 1: invalid JSON \(Expecting ',' delimiter"),
    ('{"arguments": {"query": "x"}}', r'tool call 1: no "name" string in'),
    ('{"name": "", "arguments": {}}', r'tool call 1: no "name" string in'),
    ('{"name": "search", "arguments": "query=x"}', r'tool call 1: "arguments" of search is a JSON str, not an object'),
    ('["search", {"query": "x"}]', r'tool call 1: a JSON list instead of an object with "name" and "arguments"'),
])
def test_each_malformed_call_is_an_error_message(parser, body, message):
    turn = parser.parse(f"<tool_call>{body}</tool_call>")
    assert turn.calls == []
    assert len(turn.errors) == 1
    assert re.match(message, turn.errors[0]), turn.errors[0]


def test_good_and_bad_calls_of_one_turn_are_told_apart(parser):
    turn = parser.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{oops}</tool_call> '
                        '<tool_call>{"name": "b", "arguments": {"n": 1}}</tool_call>')
    assert turn.calls == [ToolCall("a", {}), ToolCall("b", {"n": 1})]
    assert len(turn.errors) == 1 and turn.errors[0].startswith("tool call 2: invalid JSON")


def test_text_without_calls_has_none(parser):
    assert parser.parse("The answer is 4.") == ParsedTurn([], [])


def test_an_unknown_format_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"rollout.multi_turn.tool_format 'react': unknown; use one of hermes"):
        parser_for("react")
