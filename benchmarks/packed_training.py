"""Training tokens/s with packed micro-batches (`actor.max_tokens_per_micro_batch`) against padded ones
(`actor.micro_batch_size_per_gpu`) on a variable-length workload, in one run:

    python benchmarks/packed_training.py --repeats 7 --json benchmarks/results/extra/packed_training.json

64 samples (prompts of 12–24 tokens left-padded to 24, responses of 8–64 tokens right-padded to 64,
uniform, seeded), one optimizer step per update (`MegatronActor.update_policy`, PPO clip loss), and
the forward-only log-prob pass (`compute_log_prob`), on the bench model (`megarl bench train`'s
4-layer Qwen2) in a `run_distributed` world of 1. Padded: micro-batches of 8 samples (8 × 88 = 704
token slots). Packed: budgets of 3, 4 and 8 rows of 88 tokens (264, 352, 704; the last is a padded
micro-batch's shape): samples are packed into rows no wider than the padded batch
(`megarl.workers.packing.pack_rows`), since the local spec's attention is dense over a row (the mask
hides the other samples, their scores are still computed). Contenders run in turn every round (order
rotating); tokens/s counts real tokens (prompt + response, no padding), the same for every contender.

Two clocks per call: wall time, and the process's CPU time (`time.process_time`; one intra-op thread,
so it is the work done). The development machine is shared (load average 10–30 on 2 cores): wall
times swing several-fold between calls there, CPU time far less, so the CPU-time ratio is the
headline and the paired wall ratio (median of per-round ratios) stands beside it.
Prints a markdown table; writes every repeat and the context as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

SAMPLES, PROMPT_LEN, RESPONSE_LEN = 64, 24, 64
PADDED_MICRO_BATCH = 8
BUDGETS = (264, 352, 704)


def variable_length_batch(vocab_size: int):
    """The workload's `PolicyBatch` (seeded): every field the policy loss reads."""
    import torch

    from megarl.workers.batch import PolicyBatch

    g = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(12, PROMPT_LEN + 1, (SAMPLES,), generator=g)
    response_lens = torch.randint(8, RESPONSE_LEN + 1, (SAMPLES,), generator=g)
    return PolicyBatch(
        prompts=torch.randint(3, vocab_size, (SAMPLES, PROMPT_LEN), generator=g),
        prompt_mask=torch.arange(PROMPT_LEN)[None] >= (PROMPT_LEN - prompt_lens)[:, None],
        responses=torch.randint(3, vocab_size, (SAMPLES, RESPONSE_LEN), generator=g),
        response_mask=torch.arange(RESPONSE_LEN)[None] < response_lens[:, None],
        old_log_probs=-torch.rand(SAMPLES, RESPONSE_LEN, generator=g) - 4.0,
        advantages=torch.randn(SAMPLES, RESPONSE_LEN, generator=g),
    )


def _time_interleaved(contenders: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{"wall": ..., "cpu": ...} seconds of each contender per repeat, called in turn (one warm-up round)."""
    from megarl.bench.common import interleaved_order

    seconds = {clock: {name: [] for name in contenders} for clock in ("wall", "cpu")}
    for index, name in enumerate(interleaved_order(list(contenders), repeats)):
        wall, cpu = time.perf_counter(), time.process_time()
        contenders[name]()
        if index >= len(contenders):
            seconds["wall"][name].append(time.perf_counter() - wall)
            seconds["cpu"][name].append(time.process_time() - cpu)
    return seconds


def _experiment(model_dir: str, repeats: int) -> dict:
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.models.hf_config import read_model_dims
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.micro_batches import cut_micro_batches
    from megarl.workers.packing import TokenBudget

    batch = variable_length_batch(read_model_dims(model_dir).vocab_size)
    actor = MegatronActor.from_hf(
        model_dir,
        initialize_model_parallel(1, 1, seed=0),
        optim=OptimizerConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=False),
        model=ModelConfig(dtype="float32", transformer_impl="local"),
    )
    loss = PolicyLoss(ActorConfig())
    cuts = {"padded": PADDED_MICRO_BATCH} | {
        f"packed {budget}": TokenBudget(budget, "actor.max_tokens_per_micro_batch") for budget in BUDGETS
    }
    contenders = {}
    for name, cut in cuts.items():
        contenders[f"update, {name}"] = lambda cut=cut: actor.update_policy(
            batch, loss, mini_batch_size=SAMPLES, micro_batch_size=cut
        )
        contenders[f"log-prob, {name}"] = lambda cut=cut: actor.compute_log_prob(batch, micro_batch_size=cut)
    seconds = _time_interleaved(contenders, repeats)
    real_tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    layouts = {}
    for name, cut in cuts.items():
        micro_batches = cut_micro_batches(batch, cut, fixed_shape=False)
        layouts[name] = dict(
            micro_batches=len(micro_batches), token_slots=sum(m.input_ids.numel() for m in micro_batches)
        )
    cpu, wall = seconds["cpu"], seconds["wall"]

    def padded(name):
        return name.split(",")[0] + ", padded"

    return dict(
        real_tokens=real_tokens,
        layouts=layouts,
        seconds=seconds,
        median_cpu_seconds={name: statistics.median(cpu[name]) for name in contenders},
        tokens_per_cpu_second={name: real_tokens / statistics.median(cpu[name]) for name in contenders},
        cpu_speedup_over_padded={
            name: statistics.median(cpu[padded(name)]) / statistics.median(cpu[name]) for name in contenders
        },
        paired_wall_speedup_over_padded={
            name: statistics.median(p / c for p, c in zip(wall[padded(name)], wall[name])) for name in contenders
        },
    )


def markdown(result: dict) -> str:
    lines = [
        "| pass | cut | micro-batches per step | token slots computed | tokens per CPU-second | "
        "× padded, CPU time | × padded, wall (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in result["median_cpu_seconds"]:
        pass_, cut = name.split(", ")
        layout = result["layouts"][cut]
        lines.append(
            f"| {pass_} | {cut} | {layout['micro_batches']} | {layout['token_slots']} | "
            f"{result['tokens_per_cpu_second'][name]:.0f} | {result['cpu_speedup_over_padded'][name]:.2f}× | "
            f"{result['paired_wall_speedup_over_padded'][name]:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    from megarl.bench.common import context, model_summary, write_json
    from megarl.cli.bench import BENCH_MODEL
    from megarl.models.tiny import make_tiny_model
    from megarl.parallel.spawn import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="where to write the result (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(tmp, "qwen2", **BENCH_MODEL))
        result = run_distributed(_experiment, 1, model_dir, args.repeats, timeout_s=3000)[0]
        report = dict(
            benchmark="packed_training",
            context=context(),
            model=model_summary(model_dir),
            workload=dict(
                samples=SAMPLES,
                prompt_tokens="12-24 (padded to 24)",
                response_tokens="8-64 (padded to 64)",
                padded_micro_batch=PADDED_MICRO_BATCH,
                budgets=list(BUDGETS),
                repeats=args.repeats,
            ),
            result=result,
        )
    write_json(args.json, report)
    print(markdown(result))


if __name__ == "__main__":
    main()
