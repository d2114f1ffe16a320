"""`megarl sft` end to end on CPU: a tiny model with tool tokens (vocab 104, padded by Megatron), the example
recipe with TP 2 on two Ray-placed gloo ranks, two micro-batches per step; the exported checkpoint loads in
transformers and vLLM and is a valid `megarl train` model."""

import contextlib
import io
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.config.loader import load_config
from megarl.config.sft import SFT_MARKER, output_dir_problems
from megarl.config.validate import validate
from megarl.data.sft import sft_batches
from megarl.models.tiny import make_tiny_model
from megarl.rewards.tasks import calc_tool_demo_rows
from megarl.trainer.sft import SftTrainer
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

from .conftest import QUICKSTART, REPO

STEPS = 40
BATCH = 8


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = make_tiny_model(root / "model", tool_tokens=True)
    demos = root / "demos.jsonl"
    demos.write_text("".join(json.dumps(row) + "\n" for row in calc_tool_demo_rows(64, random.Random(0))))
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{demos}]",
        f"train.output_dir={root / 'out'}",
        "parallel.tensor_model_parallel_size=2",
        f"train.batch_size={BATCH}",
        "train.micro_batch_size_per_gpu=4",
        "train.epochs=5",
        f"train.total_steps={STEPS}",
    ]
    trainer = SftTrainer.from_config(REPO / "configs" / "sft_tiny.yaml", overrides)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = trainer.fit()
    return root, trainer, result, printed.getvalue()


def assistant_nll(model_dir, samples) -> float:
    """Mean NLL per loss-masked token of `samples` under the HF model in `model_dir` (what SFT minimises)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.input_ids])
            log_probs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            picked = log_probs.gather(1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(sample.loss_mask[1:])
            total -= picked[mask].sum().item()
            tokens += int(mask.sum())
    return total / tokens


def test_sft_trains_the_assistant_tokens_and_exports_a_usable_model(sft_run):
    root, trainer, result, printed = sft_run
    assert trainer.total_steps == STEPS and len(result.metrics) == STEPS  # 64 demos ÷ 8 = 8 steps per epoch, 5 epochs
    lines = [line for line in printed.splitlines() if line.startswith("sft step ")]
    assert len(lines) == STEPS and lines[0].startswith(f"sft step 1/{STEPS} | loss ") and "| tok/s " in lines[0]
    losses = [m["loss"] for m in result.metrics]
    assert all(m["skipped_steps"] == 0 for m in result.metrics)
    assert losses[-1] < 0.7 * losses[0], losses

    # Step 1's loss is the initial model's mean NLL of the first batch's assistant tokens, as HF computes it:
    # Megatron (TP 2, micro-batched, padded vocabulary) and the loss mask agree with the reference.
    first = next(sft_batches(trainer.samples, batch_size=BATCH, epochs=1, seed=0, shuffle=True))
    assert result.metrics[0]["tokens"] == sum(sum(s.loss_mask[1:]) for s in first)
    assert result.metrics[0]["loss"] == pytest.approx(assistant_nll(root / "model", first), abs=1e-4)

    out = result.output_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 104
    assert not list(out.parent.glob(".out.*")), "the export's temporary dir was left behind"
    # Its marker lists what it wrote, so a later run with train.overwrite: true may replace it (and only it).
    assert json.loads((out / SFT_MARKER).read_text())["files"] == sorted(
        p.name for p in out.iterdir() if p.name != SFT_MARKER
    )
    assert output_dir_problems(str(out), str(root / "model"), [str(root / "demos.jsonl")], overwrite=True) == []
    # The trained model gives the demonstrations a higher likelihood than the initial one.
    trained, initial = assistant_nll(out, trainer.samples), assistant_nll(root / "model", trainer.samples)
    assert trained < 0.7 * initial, (trained, initial)

    # It learned the format: asked a new sum, it opens a tool call (one token, id 100) in HF and in vLLM.
    tokenizer = AutoTokenizer.from_pretrained(out)
    tools = calc_tool_demo_rows(1, random.Random(0))[0]["tools"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+31"}], tools=tools, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        hf_log_probs = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    assert hf_log_probs[-1].argmax().item() == tokenizer.convert_tokens_to_ids("<tool_call>") == 100
    engine = make_rollout_engine("vllm", EngineArgs(out, dtype="float32", max_model_len=256))
    try:
        (vllm_log_probs,) = engine.prompt_logprobs([prompt_ids + [100]])
    finally:
        engine.shutdown()
    expected = hf_log_probs.gather(1, torch.tensor(prompt_ids[1:] + [100])[:, None])[:, 0]
    torch.testing.assert_close(vllm_log_probs, expected, atol=1e-4, rtol=0)


def test_the_exported_model_is_a_valid_model_path_of_a_train_recipe(sft_run):
    root, _, result, _ = sft_run
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc", "answer": "a"}) + "\n")
    config = load_config(
        QUICKSTART,
        [
            f"model.path={result.output_dir}",
            f"data.train_files=[{prompts}]",
            f"data.val_files=[{prompts}]",
            f"trainer.output_dir={root / 'rl'}",
            f"checkpoint.dir={root / 'rl' / 'checkpoints'}",
        ],
    )
    assert validate(config) == []


def test_layout_and_micro_batching_do_not_change_the_training(sft_run):
    """DP 2 with one micro-batch per rank, PP 2 with four per step and TP 2 with sequence parallelism (rows
    padded to even widths) train the same trajectory (the loss is normalised by the step's token count, never
    per micro-batch or per rank)."""
    root = sft_run[0]
    common = [
        f"model.path={root / 'model'}",
        f"data.train_files=[{root / 'demos.jsonl'}]",
        "train.batch_size=8",
        "train.total_steps=3",
        "optim.lr_warmup_steps=0",
    ]
    layouts = {
        "dp2": ["train.micro_batch_size_per_gpu=4"],
        "pp2": ["parallel.pipeline_model_parallel_size=2", "train.micro_batch_size_per_gpu=2"],
        "tp2-sp": [
            "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true",
            "train.micro_batch_size_per_gpu=4",
        ],
    }
    runs = {}
    for name, layout in layouts.items():
        trainer = SftTrainer.from_config(
            REPO / "configs" / "sft_tiny.yaml", common + layout + [f"train.output_dir={root / name}"]
        )
        with contextlib.redirect_stdout(io.StringIO()):
            runs[name] = trainer.fit()
    dp2, pp2, tp2_sp = (
        [value for m in runs[name].metrics for value in (m["loss"], m["grad_norm"], m["tokens"])] for name in layouts
    )
    assert dp2 == pytest.approx(pp2, rel=1e-5) and dp2 == pytest.approx(tp2_sp, rel=1e-5)
    assert dp2[-3] < dp2[0]  # it trained: the last step's loss is below the first's
    weights = {name: AutoModelForCausalLM.from_pretrained(runs[name].output_dir).state_dict() for name in layouts}
    # Adam turns float rounding of tiny gradients into steps of up to ~lr: 1e-4 is 5 % of one step (lr 2e-3).
    for key, tensor in weights["dp2"].items():
        torch.testing.assert_close(weights["pp2"][key], tensor, atol=1e-4, rtol=0)
        torch.testing.assert_close(weights["tp2-sp"][key], tensor, atol=1e-4, rtol=0)
