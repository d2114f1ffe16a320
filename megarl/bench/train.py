"""Actor update: `MegatronActor.update_policy` with `PolicyLoss` vs the same model and loss in plain
PyTorch (HF model, `torch.optim.AdamW`, the same `compute_policy_loss`), and Megatron TP 2 / PP 2.

Both TP-1 contenders run in one process of a `run_distributed` world of 1 (one intra-op thread),
one optimizer step over the same batch cut into the same micro-batches, timed in turn. TP 2 and PP 2
run in a 2-process world each (one thread per rank, so twice the cores); their time per token is
reported beside TP 1's, measured in its own world just before, not interleaved.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainShape:
    """One optimizer step's batch."""

    samples: int = 16
    """Rows per optimizer step (one mini-batch)."""
    micro_batch: int = 4
    """Rows per forward/backward."""
    prompt_length: int = 32
    response_length: int = 32

    @property
    def tokens(self) -> int:
        return self.samples * (self.prompt_length + self.response_length)


def make_batch(shape: TrainShape, vocab_size: int):
    """A deterministic `PolicyBatch` with every field the policy loss reads (full masks)."""
    import torch

    from megarl.workers.batch import PolicyBatch

    g = torch.Generator().manual_seed(0)
    b, p, r = shape.samples, shape.prompt_length, shape.response_length
    return PolicyBatch(
        prompts=torch.randint(3, vocab_size, (b, p), generator=g),
        prompt_mask=torch.ones(b, p, dtype=torch.bool),
        responses=torch.randint(3, vocab_size, (b, r), generator=g),
        response_mask=torch.ones(b, r, dtype=torch.bool),
        old_log_probs=-torch.rand(b, r, generator=g) - 4.0,
        advantages=torch.randn(b, r, generator=g),
    )


def _compare_tp1(model_dir: str, shape: TrainShape, repeats: int) -> dict:
    """In a world of 1: megatron actor vs plain PyTorch, interleaved."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.algorithms.policy_loss import compute_policy_loss
    from megarl.bench.common import time_interleaved
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    vocab = read_model_dims(model_dir).vocab_size
    batch = make_batch(shape, vocab)
    groups = initialize_model_parallel(1, 1, seed=0)
    optim = OptimizerConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=False)
    actor = MegatronActor.from_hf(
        model_dir, groups, optim=optim, model=ModelConfig(dtype="float32", transformer_impl="local")
    )
    settings = ActorConfig()
    loss = PolicyLoss(settings)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    adamw = torch.optim.AdamW(
        hf.parameters(),
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    tokens = batch.response_mask.sum()

    def megatron_step():
        actor.update_policy(batch, loss, mini_batch_size=shape.samples, micro_batch_size=shape.micro_batch)

    def pytorch_step():
        adamw.zero_grad(set_to_none=True)
        for micro in batch.split(shape.samples // shape.micro_batch):
            logits = hf(input_ids=micro.input_ids).logits[:, micro.prompt_length - 1 : -1].float()
            log_softmax = logits.log_softmax(-1)
            log_probs = log_softmax.gather(-1, micro.responses.unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():  # megarl's loss reports the entropy too
                entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            out = compute_policy_loss(
                settings.policy_loss,
                micro.old_log_probs,
                log_probs,
                micro.advantages,
                micro.response_mask,
                clip_ratio_low=settings.clip_ratio_low,
                clip_ratio_high=settings.clip_ratio_high,
                clip_ratio_c=settings.clip_ratio_c,
                loss_agg_mode=settings.loss_agg_mode,
                global_normalizer=tokens,
            )
            out.loss.backward()
            del entropy
        torch.nn.utils.clip_grad_norm_(hf.parameters(), optim.clip_grad)
        adamw.step()

    timings = time_interleaved({"megatron": megatron_step, "pytorch": pytorch_step}, repeats)
    return dict(seconds=timings.seconds, threads=torch.get_num_threads())


def _time_layout(model_dir: str, shape: TrainShape, repeats: int, tp: int, pp: int) -> list[float]:
    """Seconds of each `update_policy` on this rank (a world of tp × pp), after one warm-up."""
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    batch = make_batch(shape, read_model_dims(model_dir).vocab_size)
    groups = initialize_model_parallel(tp, pp, seed=0)
    optim = OptimizerConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=False)
    actor = MegatronActor.from_hf(
        model_dir, groups, optim=optim, model=ModelConfig(dtype="float32", transformer_impl="local")
    )
    loss = PolicyLoss(ActorConfig())
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        actor.update_policy(batch, loss, mini_batch_size=shape.samples, micro_batch_size=shape.micro_batch)
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


def run(
    model_dir: str, shape: TrainShape, repeats: int, layouts: tuple[tuple[int, int], ...] = ((2, 1), (1, 2))
) -> dict:
    from megarl.bench.common import context, model_summary
    from megarl.parallel.spawn import run_distributed

    tp1 = run_distributed(_compare_tp1, 1, model_dir, shape, repeats, timeout_s=1800)[0]
    megatron = statistics.median(tp1["seconds"]["megatron"])
    pytorch = statistics.median(tp1["seconds"]["pytorch"])
    paired = statistics.median(p / m for m, p in zip(tp1["seconds"]["megatron"], tp1["seconds"]["pytorch"]))
    result = dict(
        benchmark="train",
        context=context(),
        model=model_summary(model_dir),
        shape=dict(shape.__dict__, tokens=shape.tokens),
        repeats=repeats,
        tp1=tp1,
        tokens_per_second=dict(megatron=shape.tokens / megatron, pytorch=shape.tokens / pytorch),
        megatron_over_pytorch_throughput=pytorch / megatron,
        megatron_over_pytorch_throughput_paired=paired,
        layouts={},
    )
    for tp, pp in layouts:
        per_rank = run_distributed(_time_layout, tp * pp, model_dir, shape, repeats, tp, pp, timeout_s=1800)
        seconds = [max(rank[i] for rank in per_rank) for i in range(repeats)]
        median = statistics.median(seconds)
        result["layouts"][f"tp{tp}_pp{pp}"] = dict(
            seconds=seconds,
            microseconds_per_token=median / shape.tokens * 1e6,
            over_tp1_megatron=median / megatron,
        )
    return result


def markdown(result: dict) -> str:
    s = result["shape"]
    tps = result["tokens_per_second"]
    lines = [
        f"train: one optimizer step of {s['samples']} samples × {s['prompt_length']}+{s['response_length']} tokens "
        f"in micro-batches of {s['micro_batch']}, median of {result['repeats']}",
        "| contender | tokens/s | µs/token | ÷ TP 1 Megatron time |",
        "|---|---|---|---|",
        f"| Megatron TP 1 | {tps['megatron']:.0f} | {1e6 / tps['megatron']:.0f} | 1.00 |",
        f"| PyTorch (HF + AdamW) | {tps['pytorch']:.0f} | {1e6 / tps['pytorch']:.0f} | "
        f"{tps['megatron'] / tps['pytorch']:.2f} |",
    ]
    for name, layout in result["layouts"].items():
        lines.append(
            f"| Megatron {name.replace('_', ' ').upper()} (2 processes) | {1e6 / layout['microseconds_per_token']:.0f} | "
            f"{layout['microseconds_per_token']:.0f} | {layout['over_tp1_megatron']:.2f} |"
        )
    lines.append(
        f"Megatron ÷ PyTorch throughput: {result['megatron_over_pytorch_throughput']:.2f}× "
        f"(paired per repeat: {result['megatron_over_pytorch_throughput_paired']:.2f}×; goal ≥ 0.8×)"
    )
    return "\n".join(lines)
