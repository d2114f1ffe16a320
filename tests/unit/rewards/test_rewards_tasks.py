"""The synthetic tasks: the quickstart's reward, `megarl make-data` output, and that the data loads under
configs/quickstart.yaml; the SFT demonstrations that `megarl sft` reads."""

import json
from pathlib import Path

from megarl.cli.main import main
from megarl.config.loader import load_config
from megarl.data import load_prompts
from megarl.data.sft import load_sft_samples
from megarl.models.tiny import CHARACTERS, build_char_tokenizer
from megarl.rewards.tasks import REPEAT_ALPHABET, REPEAT_LENGTHS, repeat_first_char

QUICKSTART = Path(__file__).parents[3] / "configs" / "quickstart.yaml"


def test_repeat_first_char_rewards_only_the_exact_first_character():
    responses = ["c", "cd", "a", "C", " c", "", "</s>"]
    assert repeat_first_char(["cab"] * 7, responses, answer=["c"] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_make_data_writes_disjoint_reproducible_files_the_quickstart_config_loads(tmp_path, monkeypatch, capsys):
    out = tmp_path / "quickstart-data"
    assert (
        main(["make-data", "--task", "repeat_first_char", "--out", str(out), "--n-train", "300", "--n-val", "20"]) == 0
    )
    assert "train.jsonl (300 rows)" in capsys.readouterr().out
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert len(train) == 300 and len(val) == 20
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in val}
    shortest, longest = REPEAT_LENGTHS
    for row in train + val:
        assert set(row) == {"prompt", "answer"} and row["answer"] == row["prompt"][0]
        assert set(row["prompt"]) <= set(REPEAT_ALPHABET) <= set(CHARACTERS)
        assert shortest <= len(row["prompt"]) <= longest
    again = tmp_path / "again"
    main(["make-data", "--task", "repeat_first_char", "--out", str(again), "--n-train", "300", "--n-val", "20"])
    assert (again / "train.jsonl").read_text() == (out / "train.jsonl").read_text()

    # The recipe's data section (relative paths, from the working directory) takes every row.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    out.rename(tmp_path / "outputs" / "quickstart-data")
    data = load_config(QUICKSTART).data
    prompts, report = load_prompts(data.train_files, build_char_tokenizer(), data)
    assert report.kept == report.rows == 300
    assert all(prompt.text == prompt.text.strip() and len(prompt.token_ids) == len(prompt.text) for prompt in prompts)
    # Ground truth scores 1 through the task's reward.
    assert (
        repeat_first_char([p.text for p in prompts], [p.answer for p in prompts], answer=[p.answer for p in prompts])
        == [1.0] * 300
    )


def test_make_data_refuses_bad_sizes(tmp_path, capsys):
    assert main(["make-data", "--task", "repeat_first_char", "--out", str(tmp_path), "--n-train", "0"]) == 2
    assert main(["make-data", "--task", "repeat_first_char", "--out", str(tmp_path), "--n-train", "100000"]) == 2
    assert "cannot make 100128 distinct prompts" in capsys.readouterr().err


def test_calc_tool_demos_are_distinct_reproducible_conversations_sft_reads(tmp_path, capsys):
    out = tmp_path / "demos"
    assert main(["make-data", "--task", "calc_tool_demos", "--out", str(out), "--n-train", "40", "--n-val", "4"]) == 0
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len({row["messages"][0]["content"] for row in rows}) == 40
    calls = [row for row in rows if len(row["messages"]) == 4]
    direct = [row for row in rows if len(row["messages"]) == 2]
    assert len(calls) + len(direct) == 40 and 0 < len(direct) < len(calls)  # CALC_DIRECT_SHARE of them answer at once
    a, b = (int(n) for n in calls[0]["messages"][0]["content"].split("+"))
    assert [m["role"] for m in calls[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert calls[0]["messages"][2]["content"] == calls[0]["messages"][3]["content"] == str(a + b)
    assert json.loads(calls[0]["messages"][1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "calculator",
        "arguments": {"expression": f"{a}+{b}"},
    }
    assert calls[0]["tools"][0]["function"]["name"] == "calculator"
    c, d = (int(n) for n in direct[0]["messages"][0]["content"].split("+"))
    assert [m["role"] for m in direct[0]["messages"]] == ["user", "assistant"]
    assert direct[0]["messages"][1]["content"] == str(c + d)
    again = tmp_path / "again"
    main(["make-data", "--task", "calc_tool_demos", "--out", str(again), "--n-train", "40", "--n-val", "4"])
    assert (again / "train.jsonl").read_text() == (out / "train.jsonl").read_text()
    samples = load_sft_samples(
        [out / "train.jsonl"], build_char_tokenizer(tool_tokens=True), max_length=160, truncate=False
    )
    assert len(samples) == 40 and sum(100 in s.input_ids for s in samples) == len(calls)


def test_calc_prompts_never_repeat_a_demonstration_and_score_the_sum():
    import random

    from megarl.rewards.tasks import calc_answer, calc_rows, calc_tool_demo_rows

    prompts = calc_rows(500, random.Random(0))
    demos = {row["messages"][0]["content"] for row in calc_tool_demo_rows(500, random.Random(0))}
    assert not demos & {row["prompt"] for row in prompts}
    a, b = (int(n) for n in prompts[0]["prompt"].split("+"))
    assert prompts[0]["answer"] == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99
    # The split is blind to digits: the prompts use every last digit of the second operand.
    assert {int(row["prompt"][-1]) for row in prompts} == set(range(10))
    assert calc_answer(["p"] * 3, [f"{a + b}\n", f"{a + b + 1}", ""], [str(a + b)] * 3) == [1.0, 0.0, 0.0]
