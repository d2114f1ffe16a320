"""Where the Megatron actor update loses to plain PyTorch: `python benchmarks/profile_train_gap.py`.

In a `run_distributed` world of 1 (one thread), on the bench model (`megarl bench train`'s), times in
turn: the Megatron update; plain PyTorch with SDPA and with eager attention (HF's own attention gap,
for scale); and each model's forward + backward alone on the same micro-batches (a `logits.sum()`
loss: no log-probs, no policy loss, no optimizer; Megatron's DDP gradient hooks included). Also
reports the Megatron step's parts (schedule = forward/backward of all micro-batches, apply =
finiteness check + optimizer step, finite = the check alone, log_probs and loss = megarl's
vocab-parallel log-probs and policy loss, summed over the micro-batches). A profiling aid: it wraps
methods with timers.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time


def _experiment(model_dir: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.algorithms.policy_loss import compute_policy_loss
    from megarl.bench.common import time_interleaved
    from megarl.bench.train import TrainShape, make_batch
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers import actor as actor_module
    from megarl.workers import megatron_train
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.megatron_train import TrainEngine
    from megarl.workers.micro_batches import cut_micro_batches

    shape = TrainShape()
    batch = make_batch(shape, read_model_dims(model_dir).vocab_size)
    actor = MegatronActor.from_hf(
        model_dir,
        initialize_model_parallel(1, 1, seed=0),
        optim=OptimizerConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=False),
        model=ModelConfig(dtype="float32", transformer_impl="local"),
    )
    loss = PolicyLoss(ActorConfig())
    parts: dict[str, list[float]] = {"schedule": [], "apply": [], "finite": [], "log_probs": [], "loss": []}
    in_step: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            in_step[name] = in_step.get(name, 0.0) + time.perf_counter() - start
            return result

        return wrapper

    megatron_train.run_schedule = timed("schedule", megatron_train.run_schedule)
    TrainEngine._apply_or_skip = timed("apply", TrainEngine._apply_or_skip)
    TrainEngine._local_grads_finite = timed("finite", TrainEngine._local_grads_finite)
    actor_module.response_log_probs = timed("log_probs", actor_module.response_log_probs)
    PolicyLoss.__call__ = timed("loss", PolicyLoss.__call__)
    micro_batches = cut_micro_batches(batch, shape.micro_batch, fixed_shape=False)

    def megatron():
        in_step.clear()
        actor.update_policy(batch, loss, mini_batch_size=shape.samples, micro_batch_size=shape.micro_batch)
        for name, seconds in in_step.items():
            parts[name].append(seconds)

    def megatron_model_only():
        ddp = actor.engine.model
        ddp.zero_grad_buffer()
        for micro in micro_batches:
            megatron_train.run_model(ddp, micro).sum().backward()

    tokens = batch.response_mask.sum()

    def pytorch(attention: str):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attention
        ).train()
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)

        def step():
            adamw.zero_grad(set_to_none=True)
            for micro in batch.split(shape.samples // shape.micro_batch):
                log_softmax = (
                    model(input_ids=micro.input_ids).logits[:, micro.prompt_length - 1 : -1].float().log_softmax(-1)
                )
                log_probs = log_softmax.gather(-1, micro.responses.unsqueeze(-1)).squeeze(-1)
                with torch.no_grad():  # the entropy megarl's loss reports
                    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
                del entropy
                compute_policy_loss(
                    "vanilla",
                    micro.old_log_probs,
                    log_probs,
                    micro.advantages,
                    micro.response_mask,
                    loss_agg_mode="token-mean",
                    global_normalizer=tokens,
                ).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            adamw.step()

        return step

    hf_sdpa = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").train()

    def pytorch_model_only():
        hf_sdpa.zero_grad(set_to_none=True)
        for micro in micro_batches:
            hf_sdpa(input_ids=micro.input_ids).logits.sum().backward()

    contenders = {
        "megatron": megatron,
        "pytorch_sdpa": pytorch("sdpa"),
        "pytorch_eager": pytorch("eager"),
        "megatron_model_only": megatron_model_only,
        "pytorch_model_only": pytorch_model_only,
    }
    timings = time_interleaved(contenders, repeats)
    return dict(
        median_seconds={name: timings.median(name) for name in timings.seconds},
        paired_over_megatron={name: timings.paired_ratio(name, "megatron") for name in timings.seconds},
        megatron_parts_median_seconds={name: statistics.median(v) for name, v in parts.items() if v},
    )


def main() -> None:
    from megarl.cli.bench import BENCH_MODEL
    from megarl.models.tiny import make_tiny_model
    from megarl.parallel.spawn import run_distributed

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(tmp, "qwen2", **BENCH_MODEL))
        print(json.dumps(run_distributed(_experiment, 1, model_dir, repeats, timeout_s=1800)[0], indent=2))


if __name__ == "__main__":
    main()
