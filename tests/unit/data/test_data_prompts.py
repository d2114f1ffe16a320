"""Loading prompt files: JSONL and Parquet, templates, and every kind of bad input (skipped-and-counted or an error)."""

import copy

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.sections import DataConfig
from megarl.data import DataError, load_prompts, reward_columns


def data_config(**fields) -> DataConfig:
    return DataConfig(**{"chat_template": False, "max_prompt_length": 16, **fields})


def load(paths, tokenizer, **fields):
    return load_prompts([str(path) for path in paths], tokenizer, data_config(**fields))


def test_jsonl_prompts_carry_text_tokens_answer_and_other_columns(write_jsonl, tokenizer):
    path = write_jsonl(
        "train.jsonl", [{"prompt": "abc", "answer": "a", "level": 3}, {"prompt": "xy", "answer": "x", "source": "web"}]
    )
    prompts, report = load([path], tokenizer)
    assert [p.text for p in prompts] == ["abc", "xy"]
    assert prompts[0].token_ids == tuple(tokenizer("abc", add_special_tokens=False)["input_ids"])
    assert len(prompts[0].token_ids) == 3  # one token per character
    assert prompts[0].answer == "a" and prompts[0].columns == {"level": 3}
    assert prompts[1].source == f"{path}:2"
    assert (report.rows, report.kept, sum(report.skipped.values())) == (2, 2, 0)
    assert reward_columns(prompts) == {"answer": ["a", "x"], "level": [3, None], "source": [None, "web"]}


def test_parquet_prompts_with_chat_messages_and_the_tokenizer_template(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]]
    pq.write_table(pa.table({"question": messages, "solution": [4]}), path)
    prompts, _ = load(
        [path], tokenizer, prompt_key="question", answer_key="solution", chat_template=True, max_prompt_length=64
    )
    assert prompts[0].text == "system: be brief\nuser: 2+2\nassistant: "
    assert prompts[0].answer == 4 and prompts[0].source == f"{path} row 0"
    assert len(prompts[0].token_ids) == len(prompts[0].text)


def test_custom_template_string_wraps_a_string_prompt_as_a_user_message(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": "hi", "answer": "1"}])
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    prompts, _ = load([path], tokenizer, chat_template=template)
    assert prompts[0].text == "<user>hi="


def test_chat_messages_without_a_template_are_an_error_naming_the_row(write_jsonl, tokenizer):
    path = write_jsonl(
        "train.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}]
    )
    with pytest.raises(DataError, match=rf"{path}:2: .*chat messages but data.chat_template is false"):
        load([path], tokenizer)


def test_bad_rows_are_skipped_and_counted_by_reason_with_their_locations(write_jsonl, tokenizer):
    path = write_jsonl(
        "train.jsonl",
        [
            {"prompt": "good", "answer": "g"},  # 1 kept
            {"prompt": "", "answer": "x"},  # 2 empty
            {"prompt": "   ", "answer": "x"},  # 3 empty (whitespace)
            {"question": "no prompt key", "prompt": None, "answer": "x"},  # 4 missing prompt (null)
            {"prompt": "no answer"},  # 5 missing answer
            {"prompt": 42, "answer": "x"},  # 6 invalid type
            b'{"prompt": "caf\xe9", "answer": "x"}\n',  # 7 latin-1 byte: undecodable
            {"prompt": "\udc80lone surrogate", "answer": "x"},  # 8 unencodable string
            {"prompt": "x" * 17, "answer": "x"},  # 9 overlong (limit 16)
            b"\n",  # blank line: not a row
            {"prompt": "also good", "answer": "a"},  # 11 kept
        ],
    )
    prompts, report = load([path], tokenizer)
    assert [p.text for p in prompts] == ["good", "also good"]
    assert report.rows == 10 and report.kept == 2
    assert dict(report.skipped) == {
        "empty_prompt": 2,
        "missing_prompt": 1,
        "missing_answer": 1,
        "invalid_prompt": 1,
        "undecodable": 2,
        "overlong": 1,
    }
    assert report.examples["undecodable"] == [f"{path}:7", f"{path}:8"]
    assert report.examples["overlong"] == [f"{path}:9"]
    metrics = report.metrics("data/train")
    assert metrics["data/train/skipped/overlong"] == 1 and metrics["data/train/kept"] == 2
    assert "overlong 1 (" in report.summary()


def test_overlong_prompt_is_an_error_when_filtering_is_off(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": "short", "answer": "s"}, {"prompt": "y" * 20, "answer": "y"}])
    with pytest.raises(DataError, match=rf"{path}:2: the prompt is 20 tokens, over data.max_prompt_length 16"):
        load([path], tokenizer, filter_overlong_prompts=False)


def test_prompt_column_absent_from_the_file_is_an_error_listing_the_columns(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(
        DataError,
        match=rf"{path}: no row has the column 'prompt' \(data.prompt_key\); "
        r"the rows have \['answer', 'question'\]",
    ):
        load([path], tokenizer)


def test_answer_column_absent_from_the_file_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["p"], "label": ["l"]}), path)
    with pytest.raises(DataError, match=r"no row has the column 'answer' \(data.answer_key\).*set data.answer_key"):
        load([path], tokenizer)


def test_wrong_parquet_prompt_type_is_an_error_naming_file_column_and_type(tmp_path, tokenizer):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), path)
    with pytest.raises(DataError, match=rf"{path}: column 'prompt' has Parquet type int64; a prompt column must be"):
        load([path], tokenizer)


def test_empty_file_is_an_error_and_all_rows_skipped_is_an_error_with_counts(write_jsonl, tokenizer):
    empty = write_jsonl("empty.jsonl", [])
    with pytest.raises(DataError, match=rf"{empty}: the file holds no rows"):
        load([empty], tokenizer)
    useless = write_jsonl("useless.jsonl", [{"prompt": "", "answer": "a"}])
    with pytest.raises(
        DataError, match=r"no usable prompt in .*useless.jsonl: kept 0 of 1 rows; skipped: empty_prompt 1"
    ):
        load([useless], tokenizer)


def test_corrupt_json_line_is_an_error_naming_the_line(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": "ok", "answer": "1"}, b'{"prompt": "cut off\n'])
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        load([path], tokenizer)
    listed = write_jsonl("list.jsonl", [["prompt", "answer"]])
    with pytest.raises(DataError, match=rf"{listed}:1: a JSON list where a JSON object"):
        load([listed], tokenizer)


def test_missing_and_unsupported_files_are_errors(tmp_path, tokenizer):
    with pytest.raises(DataError, match=rf"{tmp_path}/absent.jsonl: no such file"):
        load([tmp_path / "absent.jsonl"], tokenizer)
    (tmp_path / "train.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"train.csv: unsupported file type '.csv'"):
        load([tmp_path / "train.csv"], tokenizer)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable Parquet file"):
        load([tmp_path / "broken.parquet"], tokenizer)


def test_a_column_named_answer_beside_another_answer_key_is_an_error(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": "p", "solution": "s", "answer": "a"}])
    with pytest.raises(DataError, match=r"the column 'answer' clashes with the answer column 'solution'"):
        load([path], tokenizer, answer_key="solution")


def test_files_are_read_in_order(write_jsonl, tokenizer):
    first = write_jsonl("a.jsonl", [{"prompt": "one", "answer": "1"}])
    second = write_jsonl("b.jsonl", [{"prompt": "two", "answer": "2"}, {"prompt": "three", "answer": "3"}])
    prompts, report = load([second, first], tokenizer)
    assert [p.text for p in prompts] == ["two", "three", "one"] and report.rows == 3


def test_chat_template_true_needs_a_tokenizer_template(write_jsonl, tokenizer):
    path = write_jsonl("train.jsonl", [{"prompt": "hi", "answer": "1"}])
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(DataError, match=r"data.chat_template is true but the tokenizer .* has no chat template"):
        load([path], plain, chat_template=True)


def test_a_utf8_byte_order_mark_is_read_past(tmp_path, tokenizer):
    """Editors on Windows write one; it is UTF-8 all the same (a UTF-16 file is an error: the reliability tests)."""
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "ok", "answer": "1"}\n{"prompt": "no", "answer": "2"}\n')
    prompts, report = load([path], tokenizer)
    assert [(p.text, p.answer, p.source) for p in prompts] == [("ok", "1", f"{path}:1"), ("no", "2", f"{path}:2")]
    assert report.kept == 2
