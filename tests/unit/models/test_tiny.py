"""Tiny random-init checkpoints: loadable by transformers, char tokenizer identical for every arch."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.cli.main import main
from megarl.models.tiny import CHARACTERS, SPECIAL_TOKENS, TOOL_TOKENS, make_tiny_model

TEXT = "Q: 12+30=?\nA: 42. (ok!)"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_loads_and_generates_with_a_char_tokenizer(tmp_path, arch):
    model_dir = make_tiny_model(tmp_path / arch, arch)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == len(SPECIAL_TOKENS) + len(CHARACTERS) and cfg["vocab_size"] % 128 != 0
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32 and cfg["num_key_value_heads"] == 2
    assert not cfg["tie_word_embeddings"]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT).input_ids
    assert ids == [len(SPECIAL_TOKENS) + CHARACTERS.index(c) for c in TEXT], "one token per character"
    assert tokenizer.decode(ids) == TEXT
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > len(ids)


def test_seed_fixes_the_weights_and_overrides_apply(tmp_path):
    a = make_tiny_model(tmp_path / "a", "llama", seed=3, tie_word_embeddings=True)
    b = make_tiny_model(tmp_path / "b", "llama", seed=3, tie_word_embeddings=True)
    c = make_tiny_model(tmp_path / "c", "llama", seed=4, tie_word_embeddings=True)

    def weights(d):
        with safe_open(d / "model.safetensors", "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    wa, wb, wc = weights(a), weights(b), weights(c)
    assert "lm_head.weight" not in wa, "tied embeddings store no LM head"
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_init_tiny_model_cli(tmp_path, capsys):
    out = tmp_path / "m"
    rc = main(
        [
            "init-tiny-model",
            "--out",
            str(out),
            "--arch",
            "qwen3",
            "--hidden-size",
            "64",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--num-layers",
            "3",
        ]
    )
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == ("qwen3", 64, 3, 32)
    assert main(["init-tiny-model", "--out", str(tmp_path / "bad"), "--hidden-size", "64", "--num-heads", "4"]) == 2
    assert "head_dim = --hidden-size / --num-heads = 16 < 32" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_tool_tokens_are_single_tokens_after_the_char_vocabulary(tmp_path, capsys):
    out = tmp_path / "agent"
    assert main(["init-tiny-model", "--out", str(out), "--tool-tokens"]) == 0
    assert "vocab 104" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 104 and cfg["vocab_size"] % 128 != 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    call = '<tool_call>{"a": 1}</tool_call>'
    ids = tokenizer(call + "<tool_response>2</tool_response>", add_special_tokens=False).input_ids
    assert ids[0] == 100 and ids[len(call) - len("<tool_call></tool_call>") + 1] == 101 and ids[-1] == 103
    assert [tokenizer.convert_tokens_to_ids(t) for t in TOOL_TOKENS] == [100, 101, 102, 103]
    # Kept by decode(skip_special_tokens=True): tool-call parsers read decoded text.
    assert tokenizer.decode(ids, skip_special_tokens=True) == call + "<tool_response>2</tool_response>"
    tools = [
        {"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expression": {}}}}},
        {"name": "now"},
    ]
    messages = [
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "tools: calc(expression), now()\nuser: 1+1\nassistant: " + call + "\n"
        "tool: <tool_response>2</tool_response>\nassistant: "
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape[0] == 104


def test_default_models_keep_the_100_token_vocabulary_and_plain_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "plain"))
    assert len(tokenizer) == 100
    assert tokenizer("<tool_call>", add_special_tokens=False).input_ids == [
        4 + CHARACTERS.index(c) for c in "<tool_call>"
    ]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"name": "now"}], tokenize=False)
    assert text == "user: hi\n"
