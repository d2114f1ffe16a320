"""The MoE quickstart end to end on CPU (configs/quickstart_moe.yaml, `bash scripts/quickstart.sh --moe`,
shortened): a tiny Qwen3-MoE whose experts are split over the two actor ranks (EP 2), every sync checked
exactly into the engines (experts included), and rollout routing replay on. The reward rises, and every
step logs the routers' metrics and how far the routers' own choice and log-probs are from the rollout's."""

from pathlib import Path

import pytest
from safetensors import safe_open

from megarl import Trainer
from megarl.cli.main import main

from .conftest import REPO, overrides, read_metrics

STEPS = 12
MOE_METRICS = {
    "actor/moe/aux_loss",
    "actor/moe/routing_agreement",
    "actor/moe/logprob_gap_no_replay",
    "actor/moe/logprob_gap_replay",
    "actor/moe/layer_0/tokens_per_expert",
    "actor/moe/layer_1/load_cv",
}


@pytest.fixture(scope="module")
def moe_run(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = root / "tiny-moe-model"
    assert main(["init-tiny-model", "--arch", "qwen3_moe", "--out", str(model)]) == 0
    trainer = Trainer.from_config(
        REPO / "configs" / "quickstart_moe.yaml",
        overrides(assets, root / "runs", **{"model.path": model, "trainer.total_steps": STEPS}),
    )
    trainer.fit()
    return trainer, model, read_metrics(trainer.run_dir / "metrics.jsonl")


def _tensors(model: Path) -> int:
    with safe_open(model / "model.safetensors", "pt") as weights:
        return len(list(weights.keys()))


def test_the_moe_quickstart_learns_with_its_experts_split_and_synced_exactly(moe_run):
    trainer, model, metrics = moe_run
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    half = STEPS // 2
    first, second = (sum(m["reward/mean"] for m in part) / half for part in (metrics[:half], metrics[half:]))
    assert second > first, [m["reward/mean"] for m in metrics]
    tensors = _tensors(model)
    for m in metrics:
        assert set(m) >= MOE_METRICS, sorted(MOE_METRICS - set(m))
        # Every tensor, each expert's included, arrived bit for bit on every sync.
        assert m["sync/checksum_tensors"] == tensors
        assert m["sync/logprob_max_abs_diff"] <= trainer.cluster.sync.threshold
        # fp32 engines and actor: the routers agree with the rollout's routing, and the replayed pass's
        # log-probs are as close to the engines' as the checked sync's.
        assert 0 < m["actor/moe/routing_agreement"] <= 1
        assert m["actor/moe/logprob_gap_replay"] <= trainer.cluster.sync.threshold
