"""`megarl convert mcore-to-hf` on a training checkpoint's `step_<N>` dir: the actor's Megatron shards,
saved at TP=2, read back at TP=1 × PP=2, equal bit for bit what the run's own HF export writes at that
step. Bad inputs (a missing or damaged shard, a critic's part, a save that did not finish, the checkpoint
root, no or the wrong --hf) exit 2 with one line naming the path and the fix, start no process, write nothing.
"""

import json
import shutil
from pathlib import Path

import psutil
import pytest
import torch
from checkpoint_toy import TINY_QWEN2, ToyJob
from safetensors.torch import load_file

from megarl.cli.main import main
from megarl.parallel.spawn import run_distributed

STEP = "step_00000001"


def _train_save_export(root: str, hf_assets: str) -> None:
    """One step of a TP=2 toy run, its checkpoint, then the run's HF export of the same weights (root/hf)."""
    from megarl.workers.checkpoint import export_hf, save_checkpoint

    job = ToyJob(2, seed=5, use_distributed_optimizer=False)
    job.train_step()
    save_checkpoint(root, 1, job.groups, **job.parts(), extra={"step": 1})
    export_hf(job.ddp, root, job.groups, hf_assets_dir=hf_assets)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint.dir of the toy run, its model.path: config.json and a tokenizer file)."""
    hf_assets = tmp_path_factory.mktemp("model_path")
    (hf_assets / "config.json").write_text(json.dumps(TINY_QWEN2))
    (hf_assets / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    root = tmp_path_factory.mktemp("run") / "ckpt"
    run_distributed(_train_save_export, 2, str(root), str(hf_assets))
    return root, hf_assets


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_step_dir_converts_to_the_weights_at_that_step(run, tmp_path):
    root, hf_assets = run
    out = tmp_path / "exported"
    assert (
        main(
            [
                "convert",
                "mcore-to-hf",
                "--ckpt",
                str(root / STEP),
                "--hf",
                str(hf_assets),
                "--out",
                str(out),
                "--pp",
                "2",
            ]
        )
        == 0
    )
    converted, at_step = _hf_tensors(out), _hf_tensors(root / "hf")
    assert converted.keys() == at_step.keys() and "model.embed_tokens.weight" in converted
    for name, tensor in at_step.items():
        assert torch.equal(converted[name], tensor), name
    assert converted["model.embed_tokens.weight"].shape[0] == TINY_QWEN2["vocab_size"]  # padding rows trimmed
    assert (out / "model.safetensors.index.json").is_file()  # PP=2: one file per stage
    assert json.loads((out / "config.json").read_text()) == TINY_QWEN2
    assert (out / "tokenizer_config.json").read_text() == (hf_assets / "tokenizer_config.json").read_text()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left behind"


def _copy(run, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(run[0] / STEP, copy)
    return copy


def _missing_shard(run, tmp_path):
    step = _copy(run, tmp_path, f"ckpt/{STEP}")
    (step / "actor" / "model" / "__0_1.distcp").unlink()
    return step, "is incomplete: actor/model/__0_1.distcp is listed in manifest.json but missing: convert another step"


def _damaged_shard(run, tmp_path):
    step = _copy(run, tmp_path, f"ckpt/{STEP}")
    shard = step / "actor" / "model" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    return step, "is damaged: actor/model/__1_0.distcp has SHA-256"


def _critic_part(run, tmp_path):
    step = _copy(run, tmp_path, f"ckpt/critic/{STEP}")
    manifest = json.loads((step / "manifest.json").read_text())
    (step / "manifest.json").write_text(json.dumps({**manifest, "roles": ["critic"]}))
    return (
        step,
        f"holds the critic model, not the actor: a critic has no HF form; pass the run's actor checkpoint "
        f"({tmp_path / 'ckpt' / STEP})",
    )


def _unfinished_save(run, tmp_path):
    step = _copy(run, tmp_path, f"ckpt/{STEP}.tmp-1a2b3c4d")
    (step / "manifest.json").unlink()
    return step, "is a save that did not finish (no checkpoint): pass a complete step_<N> directory"


def _checkpoint_root(run, tmp_path):
    return (
        run[0],
        f"is a checkpoint root (checkpoint.dir), not a checkpoint: pass one of its step directories, "
        f"e.g. {run[0] / STEP}",
    )


def _no_such_step(run, tmp_path):
    return tmp_path / "ckpt" / STEP, "does not exist or is not a directory: pass a step_<N> directory"


CASES = {
    "no such step": _no_such_step,
    "a missing shard": _missing_shard,
    "a damaged shard": _damaged_shard,
    "a critic's part": _critic_part,
    "a save that did not finish": _unfinished_save,
    "the checkpoint root": _checkpoint_root,
}


def _refused(argv: list[str], capsys) -> str:
    """The one error line of a conversion that must exit 2 before any process starts."""
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    return err


@pytest.mark.parametrize("case", CASES)
def test_bad_step_dir_is_refused_naming_path_and_fix(run, tmp_path, capsys, case):
    path, message = CASES[case](run, tmp_path)
    out = tmp_path / "o"
    err = _refused(["convert", "mcore-to-hf", "--ckpt", str(path), "--hf", str(run[1]), "--out", str(out)], capsys)
    assert f"{path} " in err and message in err, err
    assert not out.exists()


def test_step_dir_without_hf_names_the_flag(run, tmp_path, capsys):
    err = _refused(["convert", "mcore-to-hf", "--ckpt", str(run[0] / STEP), "--out", str(tmp_path / "o")], capsys)
    assert f"{run[0] / STEP} is a training checkpoint" in err and "pass --hf MODEL_DIR, the run's model.path" in err


def test_step_dir_with_another_models_config_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**TINY_QWEN2, "hidden_size": 128, "num_hidden_layers": 4}))
    err = _refused(
        ["convert", "mcore-to-hf", "--ckpt", str(run[0] / STEP), "--hf", str(other), "--out", str(tmp_path / "o")],
        capsys,
    )
    assert (
        f"{run[0] / STEP} was not trained from --hf {other}: its actor has hidden size 64, 256 vocabulary rows "
        "and [2] layers, that model 128, 256 and [4]; pass the run's model.path as --hf" in err
    ), err


def test_uncached_hub_id_as_hf_names_the_download(run, tmp_path, capsys):
    err = _refused(
        [
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(run[0] / STEP),
            "--hf",
            "megarl-tests/not-cached",
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "--hf megarl-tests/not-cached is not in the local HF cache: run `hf download megarl-tests/not-cached`" in err


def test_hf_with_a_converted_checkpoint_is_refused(tmp_path, capsys):
    from megarl.models.mcore_checkpoint import ASSETS_DIR, FORMAT, MODEL_DIR, McoreCheckpointInfo, write_info

    converted = tmp_path / "mcore"
    (converted / MODEL_DIR).mkdir(parents=True)
    (converted / ASSETS_DIR).mkdir()
    write_info(
        converted,
        McoreCheckpointInfo(format=FORMAT, tp_size=1, pp_size=1, vocab_divisible_by=128, hf_config=TINY_QWEN2),
    )
    err = _refused(
        ["convert", "mcore-to-hf", "--ckpt", str(converted), "--hf", str(tmp_path), "--out", str(tmp_path / "o")],
        capsys,
    )
    assert f"--hf is for training checkpoints; {converted} carries its HF config and tokenizer: leave --hf out" in err
