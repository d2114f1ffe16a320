"""`megarl init-tiny-model`: write a tiny random-init HF checkpoint (char tokenizer) for tests and the quickstart."""

import argparse
import sys
from pathlib import Path

from megarl.cli.arguments import output_dir_problem
from megarl.models.arch import supported_model_types

TOOL_VOCAB = 104
"""The char tokenizer's vocabulary with tool tokens (`megarl.models.tiny`), the larger of its two."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "init-tiny-model",
        help="write a tiny random-init HF checkpoint (any supported architecture) with a char-level tokenizer "
        "(no download)",
        description="Write a tiny random-init HF checkpoint dir (config.json, model.safetensors, tokenizer files).",
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="output directory (created; must be empty unless --overwrite)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into a non-empty --out, replacing the files of the same names"
    )
    parser.add_argument(
        "--arch",
        choices=supported_model_types(),
        default="qwen2",
        help="architecture, an HF model_type (default: qwen2)",
    )
    parser.add_argument("--hidden-size", type=int, default=128, help="hidden size (default: 128)")
    parser.add_argument("--num-layers", type=int, default=2, help="number of transformer layers (default: 2)")
    parser.add_argument(
        "--num-heads", type=int, default=4, help="attention heads; head_dim = hidden / heads must be >= 32 (default: 4)"
    )
    parser.add_argument("--num-kv-heads", type=int, default=2, help="key/value heads (GQA groups) (default: 2)")
    parser.add_argument("--intermediate-size", type=int, default=256, help="MLP intermediate size (default: 256)")
    parser.add_argument("--tie-word-embeddings", action="store_true", help="share the input embedding and the LM head")
    parser.add_argument("--seed", type=int, default=0, help="random-init seed (default: 0)")
    parser.add_argument(
        "--tool-tokens",
        action="store_true",
        help="add <tool_call>, </tool_call>, <tool_response>, </tool_response> as single tokens "
        "(vocab 104) and a chat template that renders tools= and tool messages (agent runs)",
    )
    parser.set_defaults(func=run)


def _head_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with how --hidden-size splits into --num-heads and those into --num-kv-heads groups."""
    problems = []
    if args.hidden_size % args.num_heads:
        problems.append(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}")
    elif args.hidden_size // args.num_heads < 32:
        problems.append(
            f"head_dim = --hidden-size / --num-heads = {args.hidden_size // args.num_heads} < 32 "
            "(vLLM on CPU rejects it): raise --hidden-size or lower --num-heads"
        )
    if args.num_heads % args.num_kv_heads:
        problems.append(f"--num-heads {args.num_heads} is not divisible by --num-kv-heads {args.num_kv_heads}")
    return problems


def parameter_count(args: argparse.Namespace, vocab_size: int) -> int:
    """The model's parameters (embeddings, attention with biases at most, MLP, norms), computed from the
    sizes: the model is never built to count them."""
    head_dim = args.hidden_size // args.num_heads
    attention = 2 * args.hidden_size * args.hidden_size + 2 * args.hidden_size * args.num_kv_heads * head_dim
    attention += args.hidden_size + 2 * args.num_kv_heads * head_dim  # q, k, v biases (qwen2)
    layer = attention + 3 * args.hidden_size * args.intermediate_size + 2 * args.hidden_size
    embeddings = vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    return args.num_layers * layer + embeddings + args.hidden_size


def _memory_problems(args: argparse.Namespace) -> list[str]:
    """Sizes whose float32 weights (built, then written: twice their bytes at the peak) do not fit in the
    memory available now: refused before anything is allocated."""
    import psutil

    needed = 2 * 4 * parameter_count(args, TOOL_VOCAB)
    available = psutil.virtual_memory().available
    if needed <= available:
        return []
    return [
        f"--hidden-size {args.hidden_size}, --num-layers {args.num_layers}, --intermediate-size "
        f"{args.intermediate_size} make {parameter_count(args, TOOL_VOCAB):.3g} parameters, {needed / 2**30:.3g} GiB "
        f"to build and write in float32, more than the {available / 2**30:.3g} GiB of memory available: use smaller "
        "sizes (the defaults make a test model of 0.32 M parameters)"
    ]


def run(args: argparse.Namespace) -> int:
    sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
    problems = [
        f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
        for name in sizes
        if getattr(args, name) < 1
    ]
    if not problems:  # the divisions below need positive sizes
        problems += _head_problems(args)
    if not problems:
        problems += _memory_problems(args)
    out_problem = output_dir_problem(args.out, overwrite=args.overwrite)
    if out_problem is not None:
        problems.append(out_problem)
    if problems:
        for problem in problems:
            print(f"megarl init-tiny-model: error: {problem}", file=sys.stderr)
        return 2
    # Imported here: torch + transformers would slow every other `megarl` command's start.
    from transformers.utils import logging as transformers_logging

    from megarl.models.tiny import describe, make_tiny_model

    transformers_logging.disable_progress_bar()  # one tiny file: a progress bar is noise in the quickstart
    out = make_tiny_model(
        args.out,
        args.arch,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        intermediate_size=args.intermediate_size,
        tie_word_embeddings=args.tie_word_embeddings,
        tool_tokens=args.tool_tokens,
    )
    print(f"wrote {out} ({describe(out)})")
    return 0
