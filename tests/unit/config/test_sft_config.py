"""`megarl sft` recipes: the recipe loader's errors, every validation problem at once, and bad input stops
the command with exit 2 before any process starts."""

import json

import pytest
import yaml
from config_testing import CONFIGS, write_model

import megarl.trainer.sft as sft_module
from megarl.cli.main import main
from megarl.config.problems import ConfigError
from megarl.config.sft import SftConfig, load_sft_config, validate_sft
from megarl.models.tiny import build_char_tokenizer

DEMO = {"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A model dir (config.json + the char tokenizer with tool tokens), demos.jsonl and a valid recipe sft.yaml."""
    monkeypatch.chdir(tmp_path)
    write_model(tmp_path / "model", vocab_size=104)
    build_char_tokenizer(tool_tokens=True).save_pretrained(tmp_path / "model")
    (tmp_path / "demos.jsonl").write_text(json.dumps(DEMO) + "\n")
    recipe = {
        "model": {"path": "model", "dtype": "float32"},
        "data": {"train_files": ["demos.jsonl"]},
        "train": {"batch_size": 1, "device": "cpu", "output_dir": "out"},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path


def problems_of(overrides: list[str]) -> list[str]:
    return [str(problem) for problem in validate_sft(load_sft_config("sft.yaml", overrides))]


def test_the_valid_recipe_and_the_example_have_no_problems(workdir):
    assert problems_of([]) == []
    example = load_sft_config(CONFIGS / "sft_tiny.yaml")
    assert isinstance(example, SftConfig) and validate_sft(example, check_files=False) == []


def test_unknown_keys_and_wrong_types_are_reported_at_once(workdir):
    with pytest.raises(ConfigError) as error:
        load_sft_config("sft.yaml", ["train.batchsize=8", "optim.lr=fast", "data.max_len=64", "trainer.total_steps=3"])
    shown = [str(problem) for problem in error.value.problems]
    assert len(shown) == 4, shown
    assert "train.batchsize = 8: unknown key in train; fix: did you mean train.batch_size?" in shown
    assert "optim.lr = 'fast': wrong type: expected a number; fix: set optim.lr to a number" in shown
    assert any(
        line.startswith("data.max_len = 64: unknown key in data; fix: did you mean data.max_length") for line in shown
    )
    assert any(line.startswith("trainer = ") and "unknown key in the top level" in line for line in shown)


def test_layout_and_batch_arithmetic(workdir):
    shown = problems_of(["train.gpus=6", "parallel.tensor_model_parallel_size=4"])
    assert any("TP × PP = 4 × 1 = 4 does not divide the 6 GPUs (6 % 4 = 2)" in line for line in shown), shown
    shown = problems_of(["train.gpus=4", "parallel.tensor_model_parallel_size=2", "train.batch_size=5"])
    assert shown == ["train.batch_size = 5: must split evenly over DP = 2 ranks (5 % 2 = 1); fix: use a multiple of 2"]
    shown = problems_of(["train.gpus=2", "train.batch_size=6", "train.micro_batch_size_per_gpu=2"])
    assert shown == [
        "train.micro_batch_size_per_gpu = 2: must divide the 3 conversations per rank "
        "(train.batch_size 6 ÷ DP 2); fix: use a divisor of 3"
    ]
    shown = problems_of(["train.gpus=3", "parallel.tensor_model_parallel_size=3"])
    assert any(
        line.startswith("parallel.tensor_model_parallel_size = 3: TP 3 does not divide the 4 attention heads")
        for line in shown
    ), shown


def test_every_other_problem_is_reported_at_once(workdir):
    (workdir / "full").mkdir()
    (workdir / "full" / "weights.bin").write_text("x")
    shown = problems_of(
        [
            "data.max_length=2048",
            "data.train_files=[missing.jsonl, notes.txt]",
            "train.epochs=0",
            "optim.lr=0",
            "train.seed=-1",
            "train.output_dir=full",
            "model.trust_remote_code=true",
            "model.tokenizer_path=model",
        ]
    )
    keys = sorted(line.split(" = ")[0] for line in shown)
    assert keys == [
        "data.max_length",
        "data.train_files[0]",
        "data.train_files[1]",
        "model.tokenizer_path",
        "model.trust_remote_code",
        "optim.lr",
        "train.epochs",
        "train.output_dir",
        "train.seed",
    ], shown
    assert any(
        "train.output_dir = 'full': already holds 1 file(s) (weights.bin); fix: choose a new directory, or set "
        "train.overwrite: true" in line
        for line in shown
    )
    (line,) = problems_of(["train.output_dir=full", "train.overwrite=true"])  # tests/unit/reliability: the marker
    assert line.startswith("train.output_dir = 'full': holds 1 file(s) that `megarl sft` did not write (weights.bin)")
    assert [line.split(":")[1] for line in problems_of(["train.output_dir=model", "train.overwrite=true"])] == [
        " is model.path"
    ]
    assert [line.split(" = ")[0] for line in problems_of(["train.output_dir=''"])] == ["train.output_dir"]


def test_bad_input_exits_2_before_any_process_starts(workdir, monkeypatch, capsys):
    def no_ray(**kwargs):
        raise AssertionError("Ray started although the input was bad")

    monkeypatch.setattr(sft_module, "init_ray", no_ray)
    assert main(["sft", "sft.yaml", "train.batch_size=0"]) == 2
    assert "megarl sft: train.batch_size = 0: must be >= 1" in capsys.readouterr().err
    (workdir / "demos.jsonl").write_text(json.dumps(DEMO) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    assert main(["sft", "sft.yaml"]) == 2
    err = capsys.readouterr().err
    assert "demos.jsonl:2: messages[0].content is missing (null), not a string; fix:" in err
    assert '"messages" has no assistant message' not in err  # a row's content problems come first
    (workdir / "demos.jsonl").write_text(json.dumps(DEMO) + "\n")
    assert main(["sft", "sft.yaml", "train.batch_size=2"]) == 2
    assert "fewer than one batch of train.batch_size=2" in capsys.readouterr().err


def test_dry_run_checks_everything_and_starts_nothing(workdir, monkeypatch, capsys):
    def no_ray(**kwargs):
        raise AssertionError("Ray started on a dry run")

    monkeypatch.setattr(sft_module, "init_ray", no_ray)
    assert main(["sft", "sft.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "sft: 1 conversations (2 assistant tokens), 1 optimizer steps of 1 (DP 1 × 1 per rank" in out, out
    assert not (workdir / "out").exists()


def test_validate_names_the_command_of_an_sft_recipe(capsys):
    assert main(["validate", "--no-file-checks", str(CONFIGS / "sft_tiny.yaml")]) == 2
    assert "sft_tiny.yaml is a `megarl sft` recipe: check it with `megarl sft" in capsys.readouterr().err


def test_transformer_engine_in_float32_is_refused(workdir):
    """TE has no float32 attention for the THD micro-batches of its spec; auto picks the local spec there."""
    shown = problems_of(["model.transformer_impl=transformer_engine", "train.device=cuda"])
    assert [line.split(":")[0] for line in shown if line.startswith("model.transformer_impl")] == [
        "model.transformer_impl = 'transformer_engine'"
    ], shown
    assert not [
        line
        for line in problems_of(
            ["model.transformer_impl=transformer_engine", "train.device=cuda", "model.dtype=bfloat16"]
        )
        if line.startswith("model.transformer_impl")
    ]


def test_sequence_parallel_needs_tensor_parallelism(workdir):
    assert problems_of(["parallel.sequence_parallel=true"]) == [
        "parallel.sequence_parallel = true: sequence parallelism splits the sequence over the TP ranks, and "
        "parallel.tensor_model_parallel_size is 1; fix: set parallel.sequence_parallel: false, or a "
        "tensor_model_parallel_size of 2 or more"
    ]
    assert (
        problems_of(
            [
                "train.gpus=2",
                "train.batch_size=2",
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
            ]
        )
        == []
    )


def test_expert_parallelism_is_checked_against_the_grid_and_the_model(workdir):
    assert problems_of(["train.gpus=2", "train.batch_size=2", "parallel.expert_model_parallel_size=4"])[0] == (
        "parallel.expert_model_parallel_size = 4: expert TP 1 × EP 4 = 4 does not divide the 2 GPUs of a pipeline "
        "stage (2 GPUs ÷ PP 1): megatron lays each stage's experts out as expert TP × EP × expert DP; fix: choose "
        "expert TP × EP dividing 2: 1, 2"
    )
    dense = problems_of(["train.gpus=2", "train.batch_size=2", "parallel.expert_model_parallel_size=2"])
    assert [line.split(":")[0] for line in dense] == ["parallel.expert_model_parallel_size = 2"], dense
    assert "is dense (model_type 'qwen2', no experts)" in dense[0]


def test_optimizer_cpu_offload_needs_bfloat16_and_the_distributed_optimizer(workdir):
    shown = problems_of(["optim.cpu_offload=true", "optim.use_distributed_optimizer=false"])
    assert [line.split(":")[0] for line in shown] == ["optim.cpu_offload = true"] * 2, shown
    assert "model.dtype is float32" in shown[1] and "optim.use_distributed_optimizer is false" in shown[0]
    assert problems_of(["model.dtype=bfloat16", "optim.cpu_offload=true", "optim.cpu_offload_fraction=0.5"]) == []


def test_virtual_pipeline_needs_a_pipeline_and_micro_batches_in_groups_of_pp(workdir):
    pipeline = ["train.gpus=2", "train.batch_size=16", "parallel.pipeline_model_parallel_size=2"]
    assert problems_of(["parallel.virtual_pipeline_model_parallel_size=2"]) == [
        "parallel.virtual_pipeline_model_parallel_size = 2: virtual stages interleave a pipeline, and "
        "parallel.pipeline_model_parallel_size is 1; fix: set parallel.pipeline_model_parallel_size to 2 or more, "
        "or remove the virtual pipeline size"
    ]
    assert (
        problems_of([*pipeline, "train.micro_batch_size_per_gpu=4", "parallel.virtual_pipeline_model_parallel_size=2"])
        == []
    )
    [problem] = problems_of(
        [*pipeline, "train.micro_batch_size_per_gpu=16", "parallel.virtual_pipeline_model_parallel_size=2"]
    )
    assert problem.startswith("train.micro_batch_size_per_gpu = 16: 16 conversations per rank ÷ 16 = 1 micro-batches")
