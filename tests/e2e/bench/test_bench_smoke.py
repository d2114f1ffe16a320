"""Each `megarl bench` sub-command runs end to end at tiny sizes and writes a complete JSON result.

Smoke only: two repeats, no assertion on any timing (the machine is shared); what is checked is
that the result holds every figure the README table is built from, with the recorded context. `bench step`
is tests/unit/bench/test_bench_step_smoke.py's, on the loop's fake cluster (a whole job here was ~90-120 s of
start-up for 3 steps; the quickstart's whole job is tests/e2e/trainer/test_trainer_e2e.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shm_testing import PrivateShm

from megarl.cli.main import main

MEGARL = str(Path(sys.executable).with_name("megarl"))


def _bench(tmp_path: Path, name: str, *extra: str, shm: PrivateShm | None = None) -> dict:
    """The benchmark's result, run in this process, or with `shm` in a process of its own with that /dev/shm."""
    out = tmp_path / f"{name}.json"
    args = ["bench", name, "--smoke", "--repeats", "2", "--json", str(out), *extra]
    if shm is None:
        assert main(args) == 0
    else:
        finished = subprocess.run(shm.wrap([MEGARL, *args]), capture_output=True, text=True, timeout=900)
        assert finished.returncode == 0, finished.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == name
    assert result["context"]["versions"]["torch"]
    assert result["model"]["parameters"] > 0
    return result


def test_rollout(tmp_path):
    result = _bench(tmp_path, "rollout")
    # Same engine, same seeds: megarl's batch holds exactly the tokens vLLM generated.
    assert result["same_tokens"] is True
    assert result["compiled"] is False  # --smoke: eager; the compiled engine is test_compiled_engine_cpu.py's
    assert set(result["seconds"]) == {"megarl", "vllm", "hf"}
    assert all(len(times) == 2 for times in result["seconds"].values())
    assert result["megarl_over_vllm"] > 0 and result["hf_over_megarl"] > 0


def test_train(tmp_path):
    result = _bench(tmp_path, "train")
    assert set(result["tp1"]["seconds"]) == {"megatron", "pytorch"}
    assert result["tp1"]["threads"] == 1
    assert result["layouts"] == {}  # --smoke skips TP 2 / PP 2 (two more process worlds) to stay within budget
    assert result["megatron_over_pytorch_throughput"] > 0


def test_sync(tmp_path):
    # The benchmark itself checks the bridge's first sync of every plan against the checkpoint, tensor
    # by tensor in-process, by the exact checksums of every worker's shard cross-process: it would
    # have failed otherwise. In a /dev/shm of its own: it leaves nothing there (issue 36).
    shm = PrivateShm.make()
    try:
        result = _bench(tmp_path, "sync", shm=shm)
        assert shm.leftovers() == []
    finally:
        shm.remove()
    in_process, cross = result["in_process"], result["cross_process"]
    assert {(r["train_tp"], r["rollout_tp"], r["bucket_mb"]) for r in in_process} == {(2, 1, 0.05), (2, 1, 1)}
    assert {(r["train_tp"], r["rollout_tp"], r["bucket_mb"]) for r in cross} == {
        (2, rollout_tp, mb) for rollout_tp in (1, 2) for mb in (0.05, 1)
    }
    for record, baseline in [(r, "clone") for r in in_process] + [(r, "raw") for r in cross]:
        assert set(record["seconds"]) == {"bridge", baseline}
        assert all(len(times) == 2 for times in record["seconds"].values())
        assert record["bytes"] == result["model"]["parameters"] * 4  # fp32, every tensor once
        # In-process the bridge builds its buckets; cross-process a sender copies only qkv parts (maybe none).
        assert record["peak_extra_bytes"] <= 2 * max(record["bucket_mb"] * 2**20, record["largest_bucket_bytes"])
        assert record["peak_extra_bytes"] > 0 or baseline == "raw"
    for record in cross:  # every rank sends only what its workers need; each worker gets its shard once
        assert {(s["pp_rank"], s["tp_rank"]) for s in record["senders"]} == {(0, 0), (0, 1)}
        assert all(0 < s["bytes_sent"] <= s["receivers_need"] for s in record["senders"])
        assert [w["worker"] for w in record["workers"]] == list(range(record["rollout_tp"]))
        assert all(w["bytes_received"] == w["bytes_needed"] for w in record["workers"])
        assert sum(s["bytes_sent"] for s in record["senders"]) == sum(w["bytes_needed"] for w in record["workers"])
    small, large = sorted(in_process, key=lambda r: r["bucket_mb"])
    assert small["buckets"] > large["buckets"]
    assert set(result["goals"]) == {
        "in_process_over_clone",
        "in_process_over_clone_paired",
        "cross_process_over_raw",
        "cross_process_over_raw_paired",
        "sent_over_receivers_need",
        "received_over_needed",
        "peak_over_two_buckets",
    }


def test_bad_model_dir_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "train", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
