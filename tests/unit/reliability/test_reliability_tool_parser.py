"""Whatever a model writes, the tool-call parser answers with calls and error observations and never
raises (issue 33, item 4): one degenerate turn used to end the run (deeply nested JSON raised
RecursionError, a 5,000-digit number ValueError out of `parse`)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megarl.tools import ParsedTurn, parser_for

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

DEEP = 100_000

DEGENERATE_TURNS = [
    # (id, the turn's text, words of the one error observation)
    ("nested-arrays", "<tool_call>" + "[" * DEEP + "]" * DEEP + "</tool_call>", "JSON nested too deeply to read"),
    (
        "nested-arguments",
        '<tool_call>{"name": "search", "arguments": {"query": ' + '{"a": ' * DEEP + "1" + "}" * DEEP,
        "JSON nested too deeply to read",
    ),
    ("nested-unclosed", "<tool_call>" + "[" * DEEP, "JSON nested too deeply to read"),
    (
        "5000-digit-number",
        '<tool_call>{"name": "search", "arguments": {"query": ' + "7" * 5000 + "}}</tool_call>",
        "a number of more than 4300 digits in",
    ),
    ("5000-digit-name", '<tool_call>{"name": ' + "9" * 5000 + "}</tool_call>", "a number of more than 4300 digits"),
    (
        "escaped-lone-surrogate",
        '<tool_call>{"name": "search", "arguments": {"query": "\\ud800"}}</tool_call>',
        "a string with an unpaired surrogate escape",
    ),
    (
        "escaped-lone-surrogate-name",
        '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>',
        "a string with an unpaired surrogate escape",
    ),
    (
        "raw-lone-surrogate",
        '<tool_call>{"name": "search", "arguments": {"query": "\ud800"}}</tool_call>',
        "a string with an unpaired surrogate escape",
    ),
    (
        "invalid-utf8-bytes",
        b'<tool_call>{"name": "search\xff\xfe", "arguments": {}}'.decode("utf-8", "surrogateescape"),
        "a string with an unpaired surrogate escape",
    ),
    (
        "10-mb-unclosed-string",
        '<tool_call>{"name": "search", "arguments": {"query": "' + "a" * 10_000_000,
        "invalid JSON (Unterminated string",
    ),
    ("10-mb-of-start-tags", "<tool_call>" * 1_000_000, "invalid JSON (Expecting value"),
    (
        "1-mb-argument-of-a-wrong-type",
        '<tool_call>{"name": "search", "arguments": {"query": ['
        + ", ".join(["[[[[1]]]]"] * 100_000)
        + "]}}</tool_call>",
        "argument 'query' must be string, not array [[[[...]",
    ),
]


@pytest.fixture(scope="module")
def parser():
    return parser_for("hermes", [SCHEMA])


def assert_observable(turn: ParsedTurn) -> None:
    """Every error is a short message a tokenizer can encode; every call names a tool and has named arguments."""
    assert isinstance(turn, ParsedTurn)
    for error in turn.errors:
        assert error.kind in ("malformed", "bad_arguments")
        assert len(error.message) < 1000, error.message[:300]
        error.message.encode("utf-8")  # no lone surrogate: the observation goes through the tokenizer
    for call in turn.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        json.dumps([call.name, call.arguments], ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("text, message", [c[1:] for c in DEGENERATE_TURNS], ids=[c[0] for c in DEGENERATE_TURNS])
def test_a_degenerate_turn_is_an_error_observation(parser, text, message):
    turn = parser.parse(text)
    assert turn.calls == []
    assert len(turn.errors) == 1 and message in turn.errors[0].message, turn.errors[0].message[:300]
    assert_observable(turn)


def test_a_huge_well_formed_call_passes_on(parser):
    """10 MB in one argument of the right type is the tool's to answer (and the observation cap's)."""
    turn = parser.parse('<tool_call>{"name": "search", "arguments": {"query": "' + "q" * 10_000_000 + '"}}</tool_call>')
    assert turn.errors == [] and len(turn.calls[0].arguments["query"]) == 10_000_000


TAGGED = st.lists(
    st.one_of(
        st.text(),
        st.sampled_from(
            [
                "<tool_call>",
                "</tool_call>",
                '{"name": "search", "arguments": {',
                "[" * 5000,
                "\\ud800",
                '"query": ',
                "1" * 4400,
                "}",
                "]",
                '"',
                "\\",
            ]
        ),
    ),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=2000).map(lambda raw: (b"<tool_call>" + raw).decode("utf-8", "surrogateescape")), TAGGED
    )
)
def test_any_text_parses_without_raising(parser, text):
    assert_observable(parser.parse(text))
