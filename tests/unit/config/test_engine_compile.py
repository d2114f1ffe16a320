"""`rollout.enforce_eager: auto` resolved for a run (megarl.config.engine_compile): compiled on GPU; on CPU
compiled only when the run's generated tokens per engine repay the compile, and `megarl validate` says which."""

import pytest
from config_testing import CONFIGS, run_validate

from megarl.config.batch_plan import plan_batches
from megarl.config.engine_compile import CPU_BREAK_EVEN_TOKENS, engines_eager, tokens_per_engine, validate_lines
from megarl.config.loader import load_config

QUICKSTART = str(CONFIGS / "quickstart.yaml")


def quickstart(*overrides: str):
    config = load_config(QUICKSTART, list(overrides))
    return config, plan_batches(config)


def test_the_break_even_is_the_measured_compile_over_the_measured_saving():
    # benchmarks/README.md: 12 s more per start; 8,192 tokens in 2.19 s eager, 1.96 s compiled.
    assert pytest.approx(12.0 / ((2.19 - 1.96) / 8192), rel=1e-6) == CPU_BREAK_EVEN_TOKENS


def test_the_quickstart_and_the_tests_stay_eager_on_cpu():
    config, plan = quickstart()
    assert plan.rollout_engines == 2
    choice = engines_eager(config, plan, config.trainer.total_steps, "cpu")
    assert choice.eager
    assert tokens_per_engine(100, 128, 2, 2) == 12_800 < CPU_BREAK_EVEN_TOKENS
    assert "auto → eager: ~12,800 generated tokens per engine over the run" in choice.reason


@pytest.mark.parametrize(("steps", "eager"), [(3_339, True), (3_340, False)])
def test_a_cpu_run_compiles_once_its_tokens_repay_the_compile(steps, eager):
    # 128 samples × 2 tokens ÷ 2 engines = 128 tokens per engine and step: break-even between 3,339 and 3,340 steps.
    config, plan = quickstart()
    assert (tokens_per_engine(steps, 128, 2, 2) < CPU_BREAK_EVEN_TOKENS) is eager
    choice = engines_eager(config, plan, steps, "cpu")
    assert choice.eager is eager
    assert ("would not repay" in choice.reason) is eager


def test_gpu_engines_compile_and_a_set_value_is_kept():
    config, plan = quickstart()
    assert engines_eager(config, plan, 1, "cuda").eager is False
    for setting in (True, False):
        config, plan = quickstart(f"rollout.enforce_eager={str(setting).lower()}", "trainer.total_steps=100000")
        assert {engines_eager(config, plan, 100_000, device).eager for device in ("cpu", "cuda")} == {setting}


def test_an_unknown_run_length_names_the_steps_from_which_a_cpu_run_compiles():
    config, plan = quickstart("trainer.total_steps=null", "trainer.device=auto")
    gpu, cpu = validate_lines(config, plan)
    assert gpu == "rollout.enforce_eager auto → compiled on GPU (torch.compile and CUDA graphs)"
    assert "on CPU eager below 3,340 steps, compiled from there" in cpu


def test_validate_prints_the_choice_and_why(capsys):
    code, out, err = run_validate(capsys, QUICKSTART, "--no-file-checks")
    assert (code, err) == (0, "")
    assert (
        "rollout.enforce_eager auto → eager: ~12,800 generated tokens per engine over the run (100 steps × 128 "
        "samples × 2 new tokens ÷ 2 engines) would not repay the ~12 s compile of a CPU engine"
    ) in out
