"""`megarl bench step --peer trl`: what it refuses before running anything (exit 2, one line naming the
argument and the fix), how a workload's lengths reach both systems, and the table and curves it writes
from a result, contenders that failed included."""

import importlib.util
import json

import pytest

from megarl.bench import peer
from megarl.bench.peer import markdown
from megarl.bench.peer_plot import plot_rewards
from megarl.cli.main import main
from megarl.models.tiny import make_tiny_model
from megarl.rewards.tasks import REPEAT_ALPHABET


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "train", "--peer", "trl"], "--peer trl compares whole steps only; use megarl bench step --peer trl"),
        (["bench", "step", "--peer", "trl", "--model", "."], "the comparison makes its own model"),
        (["bench", "step", "--workload", "variable"], "add --peer trl"),
        (["bench", "step", "--contenders", "megarl"], "add --peer trl"),
        (["bench", "step", "--sweep-megarl"], "add --peer trl"),
        (["bench", "step", "--seed", "3"], "--seed seeds the runs of a comparison; add --peer trl or --modes"),
        (
            ["bench", "step", "--peer", "trl", "--contenders", "megarl,verl"],
            "--contenders 'megarl,verl': unknown verl; choose among megarl, megarl_tuned",
        ),
    ],
)
def test_a_peer_outside_its_benchmark_is_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_missing_trl_is_one_error_naming_the_bench_extra(monkeypatch, capsys):
    """Without TRL (it is an optional extra) the command stops before making the model or starting Ray."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    assert main(["bench", "step", "--peer", "trl"]) == 2
    err = capsys.readouterr().err
    assert "needs TRL" in err and "megarl[bench]" in err and "Traceback" not in err


def test_unknown_peer_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "step", "--peer", "openrlhf"])
    assert exit_.value.code == 2 and "invalid choice: 'openrlhf'" in capsys.readouterr().err


def _result() -> dict:
    ran = dict(
        generate_ms_per_token=2.0,
        reward_per_step=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
        response_length_per_step=[30.0, 32.0] * 4,
    )
    return {
        "model": {"parameters": 23.7e6},
        "workload": {"prompts_per_step": 16, "samples_per_prompt": 8, "max_new_tokens": 64},
        "lengths": {"name": "variable", "min_new_tokens": 8, "stop_ids": [1, 2, 3]},
        "measured_steps": 7,
        "seed": 3,
        "contenders": {
            "megarl": {
                "step_seconds": 10.0,
                "launch_to_end_seconds": 80.0,
                "update_mfu": 0.25,
                "peak_tflops": 0.04,
                **ran,
            },
            "megarl_bf16": {
                "step_seconds": 4.0,
                "launch_to_end_seconds": 90.0,
                "update_mfu": 0.26,
                "peak_tflops": 0.04,
                **ran,
                "generate_ms_per_token": 1.0,
            },
            "trl": {"step_seconds": 8.0, "launch_to_end_seconds": 50.0, **ran, "generate_ms_per_token": 4.0},
            "trl_vllm": {
                "error": "Traceback ...\n[rank0]: RuntimeError: no engine\n  0%|   | 0/2 [00:08<?, ?it/s]\n",
                "launch_to_end_seconds": 9.0,
            },
        },
        "megarl_over_peer_step_ratio": {"megarl/trl": 1.25, "megarl_bf16/trl": 0.5},
        "megarl_over_peer_generation_ratio": {"megarl_bf16/trl_vllm_bf16": 0.8},
    }


def test_the_table_shows_each_contender_its_ratio_and_a_failure_with_its_last_error_line():
    table = markdown(_result())
    assert "8 to 64 new tokens (variable lengths), seed 3;" in table
    assert (
        "| system | s/step | generate ms/token | mean response tokens | reward, first → last quarter of steps | "
        "megarl ÷ system | megarl_bf16 ÷ system | launch→end s |"
    ) in table
    assert "| trl | 8.00 | 4.00 | 31.0 | 0.05 → 0.65 | 1.25 | 0.50 | 50 |" in table
    assert "| megarl | 10.00 | 2.00 | 31.0 | 0.05 → 0.65 | — | — | 80 |" in table
    assert "| trl_vllm | failed: RuntimeError: no engine | — | — | — | — | — | 9 |" in table
    assert "generation per token, megarl_bf16 ÷ trl_vllm_bf16: 0.80" in table
    assert "megarl's actor update: MFU 25.0% of a 40.0 GFLOP/s measured matmul peak" in table
    assert "megarl_bf16's actor update: MFU 26.0%" in table


def test_the_curves_png_draws_the_contenders_that_ran(tmp_path):
    path = plot_rewards(_result(), tmp_path / "peer.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_generation_ratios_pair_engines_of_the_same_dtype_and_skip_what_did_not_run():
    contenders = {
        "megarl": {"generate_ms_per_token": 3.0},
        "megarl_bf16": {"generate_ms_per_token": 1.0},
        "trl_vllm": {"generate_ms_per_token": 2.0},
        "trl_vllm_bf16": {"error": "..."},
    }
    assert peer._ratios(contenders, "generate_ms_per_token", peer.GENERATION_PEERS.items()) == {"megarl/trl_vllm": 1.5}
    assert peer.ms_per_token([1.0, 2.0, 3.0], [1000, 1000, 1000]) == 2.0


def test_the_variable_workload_gives_both_systems_the_same_stops(tmp_path):
    """megarl gets them as rollout settings; TRL reads them from generation_config.json's `eos_token_id` list
    (trl/trainer/grpo_trainer.py: `eos_token_ids` from `model.generation_config.eos_token_id`), which vLLM
    also turns into stop tokens (vllm/sampling_params.py: `update_from_generation_config`)."""
    model = make_tiny_model(tmp_path / "model")
    stops = peer._stop_on(model, peer.WORKLOADS["variable"].stop_chars)
    generation = json.loads((model / "generation_config.json").read_text())
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    assert len(set(stops)) == 3 and generation["eos_token_id"] == [eos, *stops]
    assert peer._megarl_lengths(8, stops) == ("rollout.min_new_tokens=8", f"rollout.stop=[{','.join(map(str, stops))}]")
    assert not set(peer.WORKLOADS["variable"].stop_chars) & set(REPEAT_ALPHABET)  # no stop is a right answer


def test_the_full_workload_runs_every_response_to_the_cap_in_both_systems(tmp_path, monkeypatch):
    """No stop may end a response before the cap: megarl's `rollout.min_new_tokens` and TRL's `min_tokens`
    equal max_new_tokens (the smoke shape's too), so both systems generate the same number of tokens."""
    runs = []
    monkeypatch.setattr(
        peer, "_megarl", lambda config, model, data, shape, steps, micro, extra: runs.append(extra) or {}
    )
    monkeypatch.setattr(peer, "_trl", lambda spec, out: runs.append(spec) or {})
    for smoke in (False, True):
        runs.clear()
        result = peer.run("configs/quickstart.yaml", 1, tmp_path / str(smoke), smoke, "full", names=("megarl", "trl"))
        cap = result["workload"]["max_new_tokens"]
        assert result["lengths"] == dict(name="full", min_new_tokens=cap, stop_ids=[])
        (megarl_run, *trl_runs) = runs  # megarl's overrides, then every run of TRL's sweep
        assert f"rollout.min_new_tokens={cap}" in megarl_run
        assert trl_runs and all(spec["min_new_tokens"] == cap for spec in trl_runs)


def test_the_seed_reaches_every_run_and_the_model_and_prompts_stay(tmp_path, monkeypatch):
    """`--seed` moves what TRL's `seed` decides (samples, prompt order) in both systems: megarl's three seeds
    and the TRL spec's; the model and the prompt file are the same bytes for any seed."""
    runs = []
    monkeypatch.setattr(
        peer, "_megarl", lambda config, model, data, shape, steps, micro, extra: runs.append(extra) or {}
    )
    monkeypatch.setattr(peer, "_trl", lambda spec, out: runs.append(spec) or {})
    made = {}
    for seed in (0, 7):
        runs.clear()
        result = peer.run("configs/quickstart.yaml", 1, tmp_path / str(seed), True, names=("megarl", "trl"), seed=seed)
        made[seed] = [(tmp_path / str(seed) / name).read_bytes() for name in ("model/model.safetensors", "train.jsonl")]
        assert result["seed"] == seed
        (megarl_run, *trl_runs) = runs  # megarl's overrides, then every run of TRL's sweep
        assert {f"trainer.seed={seed}", f"data.seed={seed}", f"rollout.seed={seed}"} <= set(megarl_run)
        assert trl_runs and all(spec["seed"] == seed for spec in trl_runs)
    assert made[0] == made[7]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="the bench extra (TRL) is not installed")
def test_trl_runs_with_the_spec_seed(tmp_path, monkeypatch):
    """trl_peer builds its `GRPOConfig` with the spec's seed (caught at the constructor, before any training)."""
    import trl
    from transformers import GenerationMixin

    from megarl.bench import trl_peer

    monkeypatch.setattr(GenerationMixin, "generate", GenerationMixin.generate)  # trl_peer wraps it to time calls
    seen = {}

    class Built(Exception):
        """Stops main at the config."""

    def config(**kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(trl, "GRPOConfig", config)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "a", "answer": "a"}) + "\n")
    spec = dict(
        model=str(tmp_path),
        data=str(data),
        steps=1,
        samples_per_prompt=2,
        prompts_per_step=1,
        max_new_tokens=4,
        min_new_tokens=0,
        learning_rate=1e-3,
        seed=7,
        vllm_dtype=None,
        micro_batch=1,
        enforce_eager=None,
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(Built):
        trl_peer.main(str(tmp_path / "spec.json"), str(tmp_path / "result.json"))
    assert seen["seed"] == 7
    assert (seen["per_device_train_batch_size"], seen["gradient_accumulation_steps"], seen["steps_per_generation"]) == (
        1,
        2,
        2,
    )
