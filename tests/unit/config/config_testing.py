"""Helpers of the config tests: a tiny HF-style config.json, the `megarl validate` CLI in-process, snapshots."""

import json
from pathlib import Path

from megarl.cli.main import main

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "configs"
SFT_RECIPES = sorted(CONFIGS.glob("sft_*.yaml"))
"""`megarl sft` recipes (schema `megarl.config.sft.SftConfig`)."""
RL_RECIPES = sorted(p for p in CONFIGS.glob("*.yaml") if p not in SFT_RECIPES)
"""`megarl train` recipes (schema `Config`)."""

TINY_MODEL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "vocab_size": 100,
    "intermediate_size": 256,
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def write_model(directory: Path, **overrides) -> Path:
    """A checkpoint directory holding config.json, a tokenizer.json of `TINY_MODEL`'s 100 ids and a chat
    template (data.chat_template defaults to true); validation never reads weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_MODEL, **overrides}))
    write_tokenizer(directory, TINY_MODEL["vocab_size"])
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return directory


def write_tokenizer(directory: Path, size: int) -> None:
    """A word-level tokenizer.json with ids 0 to size - 1 (a format the `tokenizers` library loads)."""
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, size)}}
    model = {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "added_tokens": [], "model": model}))


def run_validate(capsys, *argv: str) -> tuple[int, str, str]:
    """`megarl validate ARGV...` in-process: (exit code, stdout, stderr)."""
    code = main(["validate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under `directory` with its size and mtime, to prove nothing was written."""
    paths = [directory, *directory.rglob("*")]
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]
