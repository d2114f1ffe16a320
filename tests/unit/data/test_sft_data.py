"""SFT conversations: the loss mask covers exactly the assistant tokens; bad rows are errors naming file:line,
field and fix; batches follow the seed."""

import pytest

from megarl.data import DataError
from megarl.data.sft import load_sft_samples, sft_batches, tokenize_conversation
from megarl.models.tiny import TOOL_TOKENS, build_char_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {}}},
        },
    }
]
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "it is 5"},
]
# Qwen2.5's ChatML turns (without its tool rendering): the end of turn is `<|im_end|>\n`.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_char_tokenizer(tool_tokens=True)


def masked_spans(tokenizer, ids, mask) -> list[str]:
    """The text of each maximal run of masked tokens."""
    spans, run = [], []
    for token, masked in zip(ids + [None], mask + [False]):
        if masked:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def test_the_mask_covers_exactly_the_assistant_turns_of_the_tiny_tool_template(tool_tokenizer):
    ids, mask = tokenize_conversation(tool_tokenizer, CONVERSATION, TOOLS)
    text = tool_tokenizer.decode(ids)
    assert (
        text.startswith("tools: calc(expression)\nsystem: be brief\n")
        and "tool: <tool_response>5</tool_response>\n" in text
    )
    # Each assistant message's content and its end of turn (the newline), never the "assistant: " header.
    assert masked_spans(tool_tokenizer, ids, mask) == [CALL + "\n", "it is 5\n"]
    tool_ids = [tool_tokenizer.convert_tokens_to_ids(token) for token in TOOL_TOKENS]
    assert tool_ids == [100, 101, 102, 103] and ids.count(100) == 1 and ids.count(102) == 1  # single tokens
    assert sum(mask) == len(tool_tokenizer(CALL + "\n" + "it is 5\n", add_special_tokens=False)["input_ids"])


def test_the_mask_follows_another_template(tool_tokenizer):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHATML
    messages = [m for m in CONVERSATION if m["role"] != "tool"][:3] + [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]
    ids, mask = tokenize_conversation(
        tokenizer, [dict(m, content=m["content"].replace(CALL, "call")) for m in messages], None
    )
    assert masked_spans(tokenizer, ids, mask) == ["call<|im_end|>\n", "done<|im_end|>\n"]


def test_a_template_whose_prefixes_change_is_refused():
    tokenizer = build_char_tokenizer()
    # Writes the number of messages first: every prefix starts differently from the whole conversation.
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="do not start the whole conversation"):
        tokenize_conversation(tokenizer, CONVERSATION[1:3], None)


def test_bad_rows_name_file_line_field_and_fix(tool_tokenizer, write_jsonl):
    good = {"messages": CONVERSATION, "tools": TOOLS}
    path = write_jsonl(
        "demos.jsonl",
        [
            good,
            {"conversation": CONVERSATION},
            {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "only a question"}]},
            {"messages": CONVERSATION, "tools": "calc"},
            b"\xff\xfe not utf-8\n",
        ],
    )
    with pytest.raises(DataError) as error:
        load_sft_samples([path], tool_tokenizer, max_length=512, truncate=False)
    message = str(error.value)
    assert message.startswith("6 bad row(s)")
    for line, expected in [
        (2, '"messages" is missing; fix:'),
        (3, "messages[0].role is 'robot'; fix: use one of"),
        (4, "messages[0].content is a number, not a string; fix:"),
        (5, '"messages" has no assistant message'),
        (6, '"tools" is the string'),
        (7, "the line is not UTF-8 text; fix:"),
    ]:
        assert f"{path}:{line}: {expected}" in message, (line, message)
    assert f"{path}:1:" not in message


def test_overlong_rows_are_errors_or_truncated(tool_tokenizer, write_jsonl):
    path = write_jsonl("long.jsonl", [{"messages": CONVERSATION, "tools": TOOLS}])
    full = len(tokenize_conversation(tool_tokenizer, CONVERSATION, TOOLS)[0])
    with pytest.raises(DataError, match=rf"{path}:1: {full} tokens > data.max_length=70; fix: .*data.truncate: true"):
        load_sft_samples([path], tool_tokenizer, max_length=70, truncate=False)
    (sample,) = load_sft_samples([path], tool_tokenizer, max_length=70, truncate=True)
    assert len(sample.input_ids) == 70 and sample.location == f"{path}:1"
    with pytest.raises(DataError, match="no assistant token within the first 20 tokens"):
        load_sft_samples([path], tool_tokenizer, max_length=20, truncate=True)


def test_batches_are_full_and_follow_the_seed(tool_tokenizer, write_jsonl):
    rows = [
        {"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a" * (i + 1)}]}
        for i in range(7)
    ]
    samples = load_sft_samples([write_jsonl("d.jsonl", rows)], tool_tokenizer, max_length=64, truncate=False)
    runs = [list(sft_batches(samples, batch_size=3, epochs=2, seed=seed, shuffle=True)) for seed in (0, 0, 1)]
    assert len(runs[0]) == 4 and all(len(batch) == 3 for batch in runs[0])  # 7 // 3 = 2 per epoch
    locations = [[[s.location for s in batch] for batch in run] for run in runs]
    assert locations[0] == locations[1] and locations[0] != locations[2]
    assert locations[0][:2] != locations[0][2:]  # each epoch has its own order
    with pytest.raises(DataError, match="fewer than one batch of train.batch_size=8"):
        next(sft_batches(samples, batch_size=8, epochs=1, seed=0, shuffle=False))


def test_a_template_that_refuses_a_row_is_named_with_the_row(write_jsonl):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% if tools %}{{ raise_exception('this template takes no tools') }}{% endif %}x"
    path = write_jsonl("t.jsonl", [{"messages": CONVERSATION[1:3], "tools": TOOLS}])
    with pytest.raises(
        DataError,
        match=rf"{path}:1: the chat template failed on this row \(TemplateError: this "
        r"template takes no tools\); fix:",
    ):
        load_sft_samples([path], tokenizer, max_length=512, truncate=False)
