"""`megarl convert`: HF → Megatron dist checkpoint at TP=2 × PP=2 → HF read back at TP=1 is bit-exact."""

import json

import torch
from safetensors.torch import load_file

from megarl.cli.main import main


def test_hf_to_mcore_to_hf_round_trip_with_resharding(tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]  # 4 layers, 4 KV groups, vocab padded to 256 at TP=2
    ckpt, out = tmp_path / "mcore", tmp_path / "hf"
    assert main(["convert", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(ckpt), "--tp", "2", "--pp", "2"]) == 0
    info = json.loads((ckpt / "megarl_model.json").read_text())
    assert (info["tp_size"], info["pp_size"], info["hf_config"]["model_type"]) == (2, 2, "qwen3")
    assert (ckpt / "hf_assets" / "tokenizer.json").is_file() and (ckpt / "model" / "metadata.json").is_file()

    # Read back in one process: dist_checkpointing reshards TP=2 × PP=2 shards into TP=1.
    assert main(["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left behind"
