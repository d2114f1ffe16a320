"""`megarl bench step --peer trl` runs each TRL contender over the settings a TRL user tunes (micro-batch
with gradient accumulation to the same batch; vLLM eager or compiled) and compares megarl with the
fastest run. The runs are stand-ins that answer with a time per setting: what is run and what is picked."""

from __future__ import annotations

import pytest

from megarl.bench import peer
from megarl.bench.peer import PeerSettings, fastest_runs, markdown, megarl_runs, peer_sweep
from megarl.bench.trl_peer import batching


def test_the_sweep_splits_the_batch_in_1_2_4_8_micro_batches_and_tries_vllm_eager_and_compiled():
    assert peer_sweep("trl_vllm", 128) == {
        f"trl_vllm.mb{micro}.{mode}": PeerSettings(micro, mode == "eager")
        for micro in (128, 64, 32, 16)
        for mode in ("eager", "compiled")
    }
    assert peer_sweep("trl", 128) == {f"trl.mb{micro}": PeerSettings(micro, None) for micro in (128, 64, 32, 16)}
    assert list(peer_sweep("trl_vllm_bf16", 4)) == [
        f"trl_vllm_bf16.mb{m}.{mode}" for m in (4, 2, 1) for mode in ("eager", "compiled")
    ]  # 8 does not divide 4


def test_trl_gets_one_generation_and_one_optimizer_step_per_batch_at_any_micro_batch():
    spec = dict(prompts_per_step=16, samples_per_prompt=8)
    assert batching(spec | {"micro_batch": 32}) == dict(
        per_device_train_batch_size=32, gradient_accumulation_steps=4, steps_per_generation=4
    )
    assert batching(spec | {"micro_batch": 128}) == dict(
        per_device_train_batch_size=128, gradient_accumulation_steps=1, steps_per_generation=1
    )
    with pytest.raises(ValueError, match="micro_batch 48 does not divide the step's batch of 128 samples"):
        batching(spec | {"micro_batch": 48})


def test_the_fastest_finished_run_of_each_contender_is_picked():
    runs = {
        "megarl": {"step_seconds": 1.0},
        "trl.mb4": {"step_seconds": 9.0},
        "trl.mb2": {"step_seconds": 7.0},
        "trl_vllm.mb4.eager": {"step_seconds": 5.0},
        "trl_vllm.mb2.compiled": {"error": "boom"},
        "trl_vllm.mb2.eager": {"step_seconds": 4.0},
        "trl_vllm_bf16.mb4.eager": {"error": "boom"},
    }
    assert fastest_runs(runs, peer.TRL_CONTENDERS) == {"trl": "trl.mb2", "trl_vllm": "trl_vllm.mb2.eager"}


def test_megarl_is_compared_with_each_peer_at_its_best_and_the_sweep_is_printed(tmp_path, monkeypatch):
    seconds = {(4, True): 6.0, (4, False): 5.0, (2, True): 3.0, (2, False): 4.0, (1, True): 8.0, (1, False): 9.0}

    def trl(spec, out):
        return dict(
            step_seconds=seconds[spec["micro_batch"], spec["enforce_eager"]],
            generate_ms_per_token=1.0,
            reward_per_step=[0.0, 1.0],
            response_length_per_step=[3.0, 3.0],
        )

    monkeypatch.setattr(
        peer,
        "_megarl",
        lambda *args: dict(
            step_seconds=6.0, generate_ms_per_token=2.0, reward_per_step=[0.0, 1.0], response_length_per_step=[3.0]
        ),
    )
    monkeypatch.setattr(peer, "_trl", trl)
    result = peer.run("configs/quickstart.yaml", 1, tmp_path, True, names=("megarl", "trl_vllm"))
    assert len([run for run in result["contenders"] if run.startswith("trl_vllm.")]) == 6  # micro-batches 4, 2, 1
    assert result["fastest_peers"] == {"trl_vllm": "trl_vllm.mb2.eager"}
    ratios = result["megarl_over_peer_step_ratio"]
    assert ratios["megarl/trl_vllm"] == 6.0 / 3.0  # against the fastest run, not the whole-batch one
    assert ratios["megarl/trl_vllm.mb4.compiled"] == 6.0 / 5.0
    assert result["megarl_over_peer_generation_ratio"] == {"megarl/trl_vllm": 2.0}
    table = markdown(result)
    assert "| trl_vllm.mb1.compiled | 9.00 |" in table and "| trl_vllm.mb4.eager | 6.00 |" in table
    assert "trl_vllm at its best: trl_vllm.mb2.eager, 3.00 s/step; megarl ÷ it 2.00" in table


def test_megarl_sweeps_its_own_micro_batch_and_its_default_stays_the_figure_of_the_ratios(tmp_path, monkeypatch):
    assert megarl_runs("megarl", sweep=False) == {"megarl": peer.MICRO_BATCH}
    assert megarl_runs("megarl_tuned", sweep=True) == {
        "megarl_tuned.mb16": 16,
        "megarl_tuned": 32,
        "megarl_tuned.mb64": 64,
    }
    megarl_seconds = {16: 7.0, 32: 6.0, 64: 5.0}
    given = []

    def megarl(config_path, model, data, shape, steps, micro_batch, extra):
        given.append(micro_batch)
        return dict(
            step_seconds=megarl_seconds[micro_batch],
            generate_ms_per_token=2.0,
            reward_per_step=[0.0, 1.0],
            response_length_per_step=[3.0],
        )

    def trl(spec, out):
        return dict(
            step_seconds=10.0 / spec["micro_batch"],
            generate_ms_per_token=1.0,
            reward_per_step=[0.0, 1.0],
            response_length_per_step=[3.0],
        )

    monkeypatch.setattr(peer, "_megarl", megarl)
    monkeypatch.setattr(peer, "_trl", trl)
    result = peer.run("configs/quickstart.yaml", 1, tmp_path, True, names=("megarl", "trl"), sweep_megarl=True)
    assert given == [16, 32, 64]
    assert result["fastest_megarl"] == {"megarl": "megarl.mb64"}
    assert result["fastest_peers"] == {"trl": "trl.mb4"}  # 10 / 4 = 2.5 s, the smoke batch's largest micro-batch
    ratios = result["megarl_over_peer_step_ratio"]
    assert ratios["megarl/trl"] == 6.0 / 2.5  # the default run (32 samples per micro-batch)
    assert ratios["megarl.mb64/trl"] == 5.0 / 2.5  # megarl at its best beside the peer at its best
    table = markdown(result)
    assert "| megarl.mb16 | 7.00 |" in table
    assert "megarl at its best: megarl.mb64, 5.00 s/step; ÷ trl at its best 2.00" in table
