"""HF checkpoint validation and slice reading; `megarl convert` rejects bad input before any process."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import megarl.parallel.spawn
from megarl.cli.main import main
from megarl.models.hf_checkpoint import HFCheckpoint, check_hf_checkpoint


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _shard_in_two(model_dir):
    """Rewrite a single-file checkpoint as two shards plus an index (as large checkpoints come)."""
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, model_dir / file, metadata={"format": "pt"})
    (model_dir / "model.safetensors").unlink()
    weight_map = {n: file for file, part in files.items() for n in part}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_sharded_checkpoint_reads_slices(tiny_qwen3, tmp_path):
    model_dir = _copy(tiny_qwen3, tmp_path / "m")
    tensors = _shard_in_two(model_dir)
    assert check_hf_checkpoint(model_dir, tp_size=2, pp_size=2).num_layers == 4
    checkpoint = HFCheckpoint(model_dir)
    with checkpoint.reader() as read:
        name = "model.layers.3.self_attn.o_proj.weight"
        assert torch.equal(read(name, (slice(None), slice(16, 32))), tensors[name][:, 16:32])
        assert torch.equal(read("model.norm.weight", (slice(None),)), tensors["model.norm.weight"])


def test_shape_mismatch_names_file_and_tensor(tiny_qwen3, tmp_path):
    model_dir = _copy(tiny_qwen3, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape "
        r"\[100, 128\], config.json implies \[256, 128\]",
    ):
        check_hf_checkpoint(model_dir)


def test_missing_tensor_and_missing_shard_file(tiny_qwen3, tmp_path):
    model_dir = _copy(tiny_qwen3, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'model.layers.2.self_attn.k_norm.weight' is missing"):
        check_hf_checkpoint(model_dir)

    sharded = _copy(tiny_qwen3, tmp_path / "s")
    _shard_in_two(sharded)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lists shard files that do not exist: \['model-00002-of-00002"):
        check_hf_checkpoint(sharded)


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if the CLI gets as far as starting processes."""

    def refuse(*args, **kwargs):
        raise AssertionError("processes were started for bad input")

    monkeypatch.setattr(megarl.parallel.spawn, "run_distributed", refuse)


def test_convert_rejects_bad_input_before_starting_processes(tiny_qwen3, tmp_path, capsys, no_spawn):
    out = str(tmp_path / "out")
    # tiny_qwen3 has 2 KV heads and 4 layers.
    assert main(["convert", "hf-to-mcore", "--hf", str(tiny_qwen3), "--out", out, "--tp", "4"]) == 2
    assert "tensor parallel size 4 does not divide num_key_value_heads=2" in capsys.readouterr().err
    assert main(["convert", "hf-to-mcore", "--hf", str(tiny_qwen3), "--out", out, "--pp", "3"]) == 2
    assert "pipeline parallel size 3 does not divide num_hidden_layers=4" in capsys.readouterr().err

    broken = _copy(tiny_qwen3, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :64].contiguous()
    save_file(tensors, broken / "model.safetensors")
    assert main(["convert", "hf-to-mcore", "--hf", str(broken), "--out", out]) == 2
    assert "tensor 'lm_head.weight' has shape [100, 64]" in capsys.readouterr().err

    assert main(["convert", "mcore-to-hf", "--ckpt", str(tiny_qwen3), "--out", out]) == 2
    assert "megarl_model.json not found" in capsys.readouterr().err
    assert main(["convert", "hf-to-mcore", "--hf", str(tiny_qwen3), "--out", str(tiny_qwen3)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
