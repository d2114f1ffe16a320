"""`megarl make-data gsm8k|math|jsonl`: fixtures in each dataset's real schema, written here (never a download),
become prompt files that the GSM8K / MATH recipes' data settings load, whose reference answers score 1.0
with the recipe's reward (a wrong answer 0.0); bad inputs stop with exit 2 and one clear line.

Schemas as published: openai/gsm8k (`question`, `answer` ending in `#### N`, subsets `main` and
`socratic` declared in its README), hendrycks/competition_math (`problem`, `level`, `type`, `solution`
with `\\boxed{}`), HuggingFaceH4/MATH-500 (`problem`, `solution`, `answer`, `subject`, `level`, `unique_id`).
"""

import json
import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_cache_testing import put_in_cache, use_cache

from megarl import interrupt
from megarl.cli.main import main
from megarl.config.loader import load_config
from megarl.config.sections import DataConfig
from megarl.data import load_prompts, reward_columns
from megarl.data.conventions import GSM8K_INSTRUCTION, MATH_INSTRUCTION
from megarl.data.prepare import length_stats, write_whole
from megarl.models.tiny import build_char_tokenizer
from megarl.rewards import resolve_reward_function, tasks

CONFIGS = Path(__file__).parents[3] / "configs"
GSM8K_RECIPE = CONFIGS / "grpo_qwen2.5-0.5b_gsm8k.yaml"
MATH_RECIPE = CONFIGS / "grpo_qwen2.5-7b_math.yaml"

GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
        "in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A library had 1,100 books and bought 150 more. How many books does it have now?",
        "answer": "1,100 + 150 = <<1100+150=1250>>1,250 books.\n#### 1,250",
    },
    {
        "question": "It was 3 degrees in the morning and the temperature fell by 8 degrees. What is it now?",
        "answer": "3 - 8 = <<3-8=-5>>-5 degrees.\n#### -5",
    },
    {"question": "A row whose solution lost its final line. How many?", "answer": "2 + 2 = <<2+2=4>>4"},
]
GSM8K_TEST = [
    {
        "question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total "
        "does it take?",
        "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts "
        "of fabric\n#### 3",
    },
    {
        "question": "Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4. She sells the rest at $2 each. "
        "How much does she make every day?",
        "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18",
    },
]
GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# GSM8K (fixture)
"""

MATH_TRAIN = [
    {
        "problem": "What is the value of $\\sin 60^\\circ$?",
        "level": "Level 1",
        "type": "Precalculus",
        "solution": "The point at $60^\\circ$ on the unit circle has $y$-coordinate $\\frac{\\sqrt{3}}{2}$, so "
        "$\\sin 60^\\circ = \\boxed{\\frac{\\sqrt{3}}{2}}$.",
    },
    {
        "problem": "Compute $\\dbinom{8}{4}$.",
        "level": "Level 2",
        "type": "Counting & Probability",
        "solution": "$\\dbinom{8}{4} = \\frac{8!}{4!4!} = \\boxed{70}$.",
    },
    {
        "problem": "For which $x$ is $x \\le 3$? Give an interval.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "Every $x$ up to and including 3: $x \\in \\boxed{(-\\infty, 3]}$.",
    },
    {
        "problem": "Which choice is prime: (A) 4, (B) 7, (C) 9?",
        "level": "Level 1",
        "type": "Number Theory",
        "solution": "Only 7 is prime, so the answer is $\\boxed{\\text{(B)}}$.",
    },
    {
        "problem": "A problem whose solution states no boxed answer.",
        "level": "Level 3",
        "type": "Algebra",
        "solution": "The answer is 5.",
    },
]
MATH_TEST = [
    {
        "problem": "Simplify $\\frac{6}{8}$.",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "Dividing by 2, $\\frac{6}{8} = \\boxed{\\frac{3}{4}}$.",
    },
    {
        "problem": "Find all roots of $x^2 - 1$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "$x^2 - 1 = (x-1)(x+1)$, so the roots are $\\boxed{-1, 1}$.",
    },
]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as validation reads it: config.json (a tiny Qwen2, 4096 positions, so the MATH
    recipe's 1024 + 2048 tokens fit) and the char tokenizer with its chat template."""
    directory = tmp_path / "model"
    build_char_tokenizer().save_pretrained(directory)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "vocab_size": 100,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def gsm8k_in_cache(tmp_path, monkeypatch):
    """openai/gsm8k in a private HF hub cache, laid out as `hf download openai/gsm8k --repo-type dataset` leaves it."""
    repo = tmp_path / "gsm8k-repo"
    (repo / "README.md").parent.mkdir()
    (repo / "README.md").write_text(GSM8K_README)
    for subset in ("main", "socratic"):
        write_parquet(repo / subset / "train-00000-of-00001.parquet", GSM8K_TRAIN)
        write_parquet(repo / subset / "test-00000-of-00001.parquet", GSM8K_TEST)
    put_in_cache(repo, "openai/gsm8k", tmp_path / "hub", repo_type="dataset")
    use_cache(monkeypatch, tmp_path / "hub")


def make_data(capsys, *argv) -> tuple[int, str, str]:
    code = main(["make-data", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def recipe_data(recipe: Path, out: Path, model: Path):
    """The recipe's config with only the file locations (model, data files) pointed here."""
    return load_config(
        recipe,
        [
            f"model.path={model}",
            f"data.train_files=[{out / 'train.parquet'}]",
            f"data.val_files=[{out / 'test.parquet'}]",
        ],
    )


def test_gsm8k_from_the_hub_cache_gives_files_the_gsm8k_recipe_loads_and_rewards(
    gsm8k_in_cache, model_dir, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "gsm8k"
    code, printed, err = make_data(
        capsys, "gsm8k", "--source", "openai/gsm8k", "--subset", "main", "--model", model_dir, "--out", out
    )
    assert (code, err) == (0, "")
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(path.name for path in out.iterdir()) == ["summary.json", "test.parquet", "train.parquet"]
    train, test = summary["splits"]["train"], summary["splits"]["test"]
    assert (train["from"], train["rows"], train["kept"], train["dropped"]) == (
        "split 'train'",
        5,
        4,
        {"no_final_answer": 1},
    )
    assert (test["from"], test["rows"], test["kept"], test["dropped"]) == ("split 'test'", 2, 2, {})
    assert "train (split 'train'): kept 4 of 5 rows; dropped no_final_answer 1" in printed
    assert f"data.max_prompt_length: {summary['settings']['data.max_prompt_length']}" in printed

    # `megarl validate` with the recipe and these files passes (file checks on: the files and model are read).
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "validate",
            str(GSM8K_RECIPE),
            f"model.path={model_dir}",
            f"data.train_files={summary['settings']['data.train_files']}",
            f"data.val_files={summary['settings']['data.val_files']}",
        ]
    )
    validated = capsys.readouterr()
    assert (code, validated.err) == (0, ""), validated.err
    assert validated.out.rstrip().endswith(f"{GSM8K_RECIPE}: OK")

    # The recipe's data settings load every kept row, chat-templated, as `megarl train` loads them.
    config = recipe_data(GSM8K_RECIPE, out, model_dir)
    tokenizer = build_char_tokenizer()
    prompts, report = load_prompts(config.data.train_files + config.data.val_files, tokenizer, config.data)
    assert (report.kept, dict(report.skipped)) == (6, {})
    questions = [row["question"] for row in GSM8K_TRAIN[:4] + GSM8K_TEST]
    assert [p.text for p in prompts] == [f"user: {q} {GSM8K_INSTRUCTION}\nassistant: " for q in questions]
    assert [p.answer for p in prompts] == ["72", "10", "1250", "-5", "3", "18"]
    longest = max(len(p.token_ids) for p in prompts)
    assert summary["settings"]["data.max_prompt_length"] == longest
    assert max(train["prompt_tokens"]["max"], test["prompt_tokens"]["max"]) == longest

    # The reference solutions (ending in `#### N`) score 1.0 with the recipe's reward; a wrong final number 0.0.
    reward = resolve_reward_function(config.reward.function)
    solutions = [row["answer"] for row in GSM8K_TRAIN[:4] + GSM8K_TEST]
    texts = [p.text for p in prompts]
    assert reward(texts, solutions, **reward_columns(prompts)) == [1.0] * 6
    wrong = [solution.rsplit("#### ", 1)[0] + "#### 7" for solution in solutions]
    assert reward(texts, wrong, **reward_columns(prompts)) == [0.0] * 6


def test_math_from_a_dataset_directory_gives_files_the_math_recipe_loads_and_rewards(
    model_dir, tmp_path, monkeypatch, capsys
):
    source = tmp_path / "competition_math"
    write_parquet(source / "data" / "train-00000-of-00001.parquet", MATH_TRAIN)
    write_parquet(source / "data" / "test-00000-of-00001.parquet", MATH_TEST)
    out = tmp_path / "math"
    code, _, err = make_data(capsys, "math", "--source", source, "--model", model_dir, "--out", out)
    assert (code, err) == (0, "")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["splits"]["train"]["dropped"] == {"no_final_answer": 1}
    assert summary["settings"]["reward.function"] == "math"

    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "validate",
            str(MATH_RECIPE),
            f"model.path={model_dir}",
            f"data.train_files=[{out / 'train.parquet'}]",
            f"data.val_files=[{out / 'test.parquet'}]",
        ]
    )
    validated = capsys.readouterr()
    assert (code, validated.err) == (0, ""), validated.err

    config = recipe_data(MATH_RECIPE, out, model_dir)
    prompts, report = load_prompts(config.data.train_files + config.data.val_files, build_char_tokenizer(), config.data)
    assert (report.kept, dict(report.skipped)) == (6, {})
    assert prompts[0].text.endswith(f" {MATH_INSTRUCTION}\nassistant: ")
    assert [p.answer for p in prompts] == [
        "\\frac{\\sqrt{3}}{2}",
        "70",
        "(-\\infty, 3]",
        "\\text{(B)}",
        "\\frac{3}{4}",
        "-1, 1",
    ]  # nested braces kept whole
    assert [(p.columns["level"], p.columns["type"]) for p in prompts][:2] == [
        ("Level 1", "Precalculus"),
        ("Level 2", "Counting & Probability"),
    ]
    reward = resolve_reward_function(config.reward.function)
    solutions = [row["solution"] for row in MATH_TRAIN[:4] + MATH_TEST]
    texts = [p.text for p in prompts]
    assert reward(texts, solutions, **reward_columns(prompts)) == [1.0] * 6
    assert reward(texts, ["So the answer is $\\boxed{5}$."] * 6, **reward_columns(prompts)) == [0.0] * 6


def test_a_single_split_file_is_cut_by_a_seeded_fraction_and_raw_prompts_are_plain_text(model_dir, tmp_path, capsys):
    # MATH-500's layout (one `test` split, an `answer` column beside the solution) as a JSONL file.
    rows = [
        {
            "problem": f"What is ${i} + {i}$?",
            "solution": f"${i} + {i} = \\boxed{{{2 * i}}}$.",
            "answer": str(2 * i),
            "subject": "Prealgebra",
            "level": 1 + i % 5,
            "unique_id": f"test/prealgebra/{i}.json",
        }
        for i in range(10)
    ]
    source = tmp_path / "math500.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    outputs = []
    for name in ("a", "b"):
        code, _, err = make_data(
            capsys,
            "math",
            "--source",
            source,
            "--model",
            model_dir,
            "--out",
            tmp_path / name,
            "--prompt-format",
            "raw",
            "--test-fraction",
            "0.3",
            "--seed",
            "3",
        )
        assert (code, err) == (0, "")
        outputs.append(
            {split: pq.read_table(tmp_path / name / f"{split}.parquet").to_pylist() for split in ("train", "test")}
        )
    assert outputs[0] == outputs[1]  # the same seed, the same cut
    train, test = outputs[0]["train"], outputs[0]["test"]
    assert (len(train), len(test)) == (7, 3)
    assert {row["answer"] for row in train}.isdisjoint({row["answer"] for row in test})
    assert {row["answer"] for row in train + test} == {str(2 * i) for i in range(10)}
    assert all(isinstance(row["prompt"], str) and row["prompt"].endswith(MATH_INSTRUCTION) for row in train + test)
    assert {(row["subject"], row["level"]) for row in test} <= {("Prealgebra", str(level)) for level in range(1, 6)}
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["settings"]["data.chat_template"] is False
    assert summary["splits"]["test"]["from"] == "split 'train', seeded 30% (--seed)"
    # Raw text loads with the template off, and is the prompt the model sees as is.
    data = DataConfig(
        train_files=(str(tmp_path / "a" / "train.parquet"),),
        chat_template=False,
        max_prompt_length=summary["settings"]["data.max_prompt_length"],
    )
    prompts, report = load_prompts(data.train_files, build_char_tokenizer(), data)
    assert report.kept == 7 and [p.text for p in prompts] == [row["prompt"] for row in train]


def test_jsonl_takes_any_columns_and_an_instruction(model_dir, tmp_path, capsys):
    source = tmp_path / "qa.jsonl"
    source.write_text("".join(json.dumps({"q": f"capital of country {i}?", "a": f"city {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "qa"
    code, _, err = make_data(
        capsys,
        "jsonl",
        "--source",
        source,
        "--prompt-column",
        "q",
        "--answer-column",
        "a",
        "--instruction",
        "Answer in two words.",
        "--test-fraction",
        "0.25",
        "--model",
        model_dir,
        "--out",
        out,
    )
    assert (code, err) == (0, "")
    rows = pq.read_table(out / "train.parquet").to_pylist() + pq.read_table(out / "test.parquet").to_pylist()
    assert sorted(row["answer"] for row in rows) == [f"city {i}" for i in range(4)]
    assert all(row["prompt"][0]["content"].endswith("? Answer in two words.") for row in rows)
    assert "reward.function" not in capsys.readouterr().out  # no built-in reward is implied


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list, str]]:
    """argv (before --model/--out) and the one error line expected, for each bad input."""
    gsm8k_file = write_parquet(tmp_path / "gsm8k.parquet", GSM8K_TRAIN)
    no_answer = write_parquet(tmp_path / "questions.parquet", [{"question": row["question"]} for row in GSM8K_TRAIN])
    math_solutions = write_parquet(
        tmp_path / "math-as-gsm8k.parquet",
        [{"question": row["problem"], "answer": row["solution"]} for row in MATH_TRAIN],
    )
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answ\n')
    return {
        "unknown hub id": (
            ["gsm8k", "--source", "nobody/no-such-dataset"],
            "--source nobody/no-such-dataset: a hub id that is not in the local Hugging Face cache",
        ),
        "missing column": (
            ["gsm8k", "--source", no_answer],
            f"{no_answer} (split 'train'): no column 'answer'; `megarl make-data gsm8k` reads 'question' "
            "and 'answer', the input has ['question']",
        ),
        "another schema": (
            ["math", "--source", gsm8k_file],
            f"{gsm8k_file} (split 'train'): no column 'problem', 'solution'; `megarl make-data math` "
            "reads 'problem' and 'solution', the input has ['answer', 'question']: use the dataset name "
            "that matches the input",
        ),
        "no final answers": (
            ["gsm8k", "--source", math_solutions, "--test-fraction", "0.2"],
            "split 'train', the other 80%): none of its 4 rows is usable (dropped: no_final_answer 4)",
        ),
        "corrupt file": (
            ["gsm8k", "--source", broken],
            f"--source {broken}: `datasets` cannot read it (ArrowInvalid: "
            "JSON parse error: Invalid encoding in string. in row 1)",
        ),
        "missing file": (["gsm8k", "--source", tmp_path / "nowhere" / "train.parquet"], "no such file or directory"),
        "missing subset": (
            ["gsm8k", "--source", "openai/gsm8k"],
            "Config name is missing. Please pick one among the available configs: ['main', 'socratic']",
        ),
        "base model without --prompt-format raw": (
            ["gsm8k", "--source", gsm8k_file, "--model", tmp_path / "base"],
            "its tokenizer has no chat template",
        ),
        "task flag with a dataset": (
            ["gsm8k", "--source", gsm8k_file, "--n-train", "5"],
            "--n-train do(es) not apply to the dataset gsm8k",
        ),
        "no dataset, no task": ([], "name a dataset (gsm8k, math, jsonl) or a synthetic --task"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown hub id",
        "missing column",
        "another schema",
        "no final answers",
        "corrupt file",
        "missing file",
        "missing subset",
        "base model without --prompt-format raw",
        "task flag with a dataset",
        "no dataset, no task",
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, gsm8k_in_cache, model_dir, tmp_path, capsys):
    base = tmp_path / "base"
    build_char_tokenizer().save_pretrained(base)
    (base / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((base / "tokenizer_config.json").read_text()), "chat_template": None})
    )
    (base / "chat_template.jinja").unlink(missing_ok=True)
    argv, expected = bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    model = [] if "--model" in argv else ["--model", model_dir]
    code, printed, err = make_data(capsys, *argv, *model, "--out", out)
    assert (code, printed) == (2, "")
    assert err.startswith("megarl make-data: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not out.exists()


def test_a_non_empty_out_is_kept_unless_overwrite(gsm8k_in_cache, model_dir, tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "train.parquet").write_bytes(b"someone's dataset")
    argv = ["gsm8k", "--source", "openai/gsm8k", "--subset", "main", "--model", model_dir, "--out", out]
    code, _, err = make_data(capsys, *argv)
    assert code == 2 and "is not empty (holds train.parquet)" in err
    assert (out / "train.parquet").read_bytes() == b"someone's dataset"
    code, _, err = make_data(capsys, *argv, "--overwrite")
    assert (code, err) == (0, "")
    assert len(pq.read_table(out / "train.parquet")) == 4


def test_length_percentiles_are_nearest_rank_lengths_of_real_prompts():
    assert length_stats(list(range(100, 0, -1))) == {"min": 1, "p50": 50, "p90": 90, "p95": 95, "p99": 99, "max": 100}
    assert length_stats([7, 3]) == {"min": 3, "p50": 3, "p90": 7, "p95": 7, "p99": 7, "max": 7}


def test_a_stop_signal_ends_it_with_one_line_and_nothing_written(tmp_path, capsys, monkeypatch):
    """Issue 33, items 7 and 11: a SIGTERM while the rows are made ends `make-data` with the signal's exit
    code, one line, and no file (a partial one neither)."""
    monkeypatch.setattr(interrupt, "_requested", None)  # the process-wide request, this test's only
    make_rows = tasks.TASKS["repeat_first_char"]

    def rows_then_signal(n, rng):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the command runs, as a scheduler's would
        return make_rows(n, rng)

    monkeypatch.setitem(tasks.TASKS, "repeat_first_char", rows_then_signal)
    out = tmp_path / "data"
    assert main(["make-data", "--task", "repeat_first_char", "--out", str(out)]) == 143
    assert capsys.readouterr().err.strip() == f"megarl make-data: stopped by SIGTERM; nothing was written to {out}"
    assert not out.exists() or list(out.iterdir()) == []


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    def fails(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_whole(tmp_path / "train.jsonl", fails)
    assert list(tmp_path.iterdir()) == []
