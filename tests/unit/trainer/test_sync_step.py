"""`WeightSync`: which syncs run the checks (`rollout.sync.verify_every`), that the engines checksum
only the loads of checked syncs, and that a bad sync is caught on a checked step, by the exact check
(naming the tensor) or by the log-prob gap. The worker groups are stand-ins that record the calls
they get."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.bridge.checksum import LoadedChecksums, WeightChecksumError
from megarl.bridge.ring_routes import route_rings
from megarl.bridge.verify import SyncVerificationError
from megarl.config import load_config
from megarl.trainer.sync_step import WeightSync

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
ACTOR_LOG_PROBS = -torch.rand(4, 7) - 1.0
RANK_CHECKSUMS = [{"model.norm.weight": 5, "lm_head.weight": 3}, {"lm_head.weight": 4}]
"""Two trainer ranks' partial checksums (the quickstart trains in float32): the engines must load these sums."""


class Group:
    """A worker group: `call_all` / `call_rank0` answer from `replies` and record the method names."""

    world_size = 1

    def __init__(self, **replies):
        self.replies = replies
        self.calls: list[str] = []
        self.args: dict[str, list] = {}

    def call_all(self, method, *args):
        self.calls.append(method)
        return self.replies[method]()

    def call_rank0(self, method, *args):
        return self.call_all(method, *args)[0]

    def call_each(self, method, per_rank_args):
        self.args[method] = per_rank_args
        return self.call_all(method)


class Engines(Group):
    """One rollout engine whose weights count syncs; `broken_from` makes its log-probs wrong from
    that sync on (as an engine that silently missed a tensor would), `wrong_tensor_from` makes it load
    a wrong `lm_head.weight` from that sync on, its log-probs unchanged (a small error the gap misses)."""

    def __init__(self, broken_from: int | None = None, wrong_tensor_from: int | None = None, dtype: str = "float32"):
        self.version, self.broken_from, self.wrong_tensor_from = 0, broken_from, wrong_tensor_from
        super().__init__(
            checksum_loads=lambda: [None],
            start_receive=lambda: [None],
            start_shared_receive=lambda: [None],
            start_rank_receive=lambda: [None],
            finish_receive=self._receive,
            prompt_logprobs=lambda: [list(ACTOR_LOG_PROBS + (0.5 if self._broken() else 0.0))],
            loaded_checksums=lambda: [[LoadedChecksums(dtype, full=self._loaded())]],
        )

    def _loaded(self) -> dict[str, int]:
        wrong = self.wrong_tensor_from is not None and self.version >= self.wrong_tensor_from
        return {"model.norm.weight": 5, "lm_head.weight": 8 if wrong else 7}

    def _receive(self):
        self.version += 1
        return [self.version]

    def _broken(self) -> bool:
        return self.broken_from is not None and self.version >= self.broken_from


GRIDS = [
    dict(rank=0, tp_rank=0, pp_rank=0, dp_rank=0, dp_size=1),
    dict(rank=1, tp_rank=1, pp_rank=0, dp_rank=0, dp_size=1),
]
"""The actor's grid (`PolicyWorker.grid`): TP 2, two ranks."""


def weight_sync(verify_every: int, total_steps: int, engines: Engines | None = None, routes=None) -> WeightSync:
    config = load_config(QUICKSTART, [f"rollout.sync.verify_every={verify_every}"])
    policy = Group(
        sync_plan=lambda: ["the plan"],
        send_weights=lambda: [{"sync/seconds": 0.01}] * 2,
        probe_log_probs=lambda: [ACTOR_LOG_PROBS] * 2,
        begin_weight_sync=lambda: ["ring 0", "ring 1"],
        weight_checksums=lambda: RANK_CHECKSUMS,
    )
    roles = SimpleNamespace(policy=policy, rollout=engines or Engines(), routes=routes)
    return WeightSync(roles, config, vocab_size=64, total_steps=total_steps)


def sync_and_check(sync: WeightSync, step: int) -> dict[str, float]:
    """One step's sync, then the engines' side of its check (the hand-over runs the two apart)."""
    return sync(step) | sync.check_engines()


def checked_steps(sync: WeightSync, steps) -> list[int]:
    return [step for step in steps if "sync/logprob_max_abs_diff" in sync_and_check(sync, step)]


def test_checks_the_first_sync_every_kth_step_and_the_last():
    sync = weight_sync(verify_every=3, total_steps=8)
    assert checked_steps(sync, range(1, 9)) == [1, 3, 6, 8]
    # Each checked sync checksums and probes the actor and every engine once; every sync sends and receives.
    assert sync.policy.calls.count("probe_log_probs") == sync.policy.calls.count("weight_checksums") == 4
    assert sync.rollout.calls.count("prompt_logprobs") == sync.rollout.calls.count("loaded_checksums") == 4
    assert sync.rollout.calls.count("finish_receive") == 8
    assert sync.policy.calls.count("sync_plan") == 1  # fetched once per run
    # The engines checksum the loads of checked syncs only: off after step 1, on for 3, off, on for 6, 8.
    assert sync.rollout.calls.count("checksum_loads") == 6


def test_every_sync_is_checked_by_default():
    sync = weight_sync(verify_every=1, total_steps=5)
    assert checked_steps(sync, range(1, 6)) == [1, 2, 3, 4, 5]


def test_a_resumed_run_checks_its_first_sync():
    sync = weight_sync(verify_every=4, total_steps=10)
    # The resume sync loads the step-5 checkpoint's weights into new engines, then steps 6.. follow.
    assert checked_steps(sync, [5, 6, 7, 8, 9, 10]) == [5, 8, 10]


def test_a_sync_is_received_then_checked_in_order():
    sync = weight_sync(verify_every=1, total_steps=1)
    metrics = sync(1)
    # At the sync: the actor's side of the check, while its parameters are on the devices.
    assert sync.rollout.calls == ["start_receive", "finish_receive"]
    assert sync.policy.calls == ["sync_plan", "send_weights", "weight_checksums", "probe_log_probs"]
    assert "sync/checksum_tensors" not in metrics
    metrics |= sync.check_engines()  # once the engines are awake: theirs
    assert sync.rollout.calls == ["start_receive", "finish_receive", "loaded_checksums", "prompt_logprobs"]
    assert metrics["sync/weight_version"] == 1.0
    assert metrics["sync/checksum_tensors"] == 2.0
    assert metrics["sync/logprob_max_abs_diff"] == 0.0


def test_a_gathered_shared_sync_starts_each_engine_worker_on_its_own_devices_ring():
    # Colocated, one TP-2 engine over the two ranks' devices; with per_rank off every rank hosts the
    # gathered buckets, and worker r reads rank r's.
    routes = route_rings(GRIDS, engines=1, rollout_tp=2, colocated=True, per_rank=False)
    sync = weight_sync(verify_every=1, total_steps=1, routes=routes)
    sync_and_check(sync, 1)
    assert sync.rollout.calls == ["start_shared_receive", "finish_receive", "loaded_checksums", "prompt_logprobs"]
    assert sync.rollout.args["start_shared_receive"] == [({0: "ring 0", 1: "ring 1"},)]
    assert sync.policy.calls == ["begin_weight_sync", "send_weights", "weight_checksums", "probe_log_probs"]


@pytest.mark.parametrize("train_tp, mode", [(2, "per_rank"), (1, "scheduled")])
def test_a_per_rank_layout_sync_starts_each_engine_worker_on_its_ranks_rings(train_tp, mode):
    # Actor TP 2 (GRIDS): each rank's own shards; as if TP 1 × PP 2: the schedule's pieces, in the same
    # per-rank layout, so the same per-rank load.
    grids = GRIDS if train_tp == 2 else [dict(g, tp_rank=0, pp_rank=g["tp_rank"]) for g in GRIDS]
    routes = route_rings(grids, engines=1, rollout_tp=2, colocated=True, per_rank=True)
    assert routes.mode == mode
    sync = weight_sync(verify_every=1, total_steps=1, routes=routes)
    sync_and_check(sync, 1)
    assert sync.rollout.calls == ["start_rank_receive", "finish_receive", "loaded_checksums", "prompt_logprobs"]
    assert sync.rollout.args["start_rank_receive"] == [({0: ["ring 0"], 1: ["ring 1"]},)]


def test_a_bad_sync_is_caught_on_the_next_checked_step():
    sync = weight_sync(verify_every=2, total_steps=10, engines=Engines(broken_from=3))
    assert checked_steps(sync, [1, 2]) == [1, 2]
    assert "sync/logprob_max_abs_diff" not in sync_and_check(sync, 3)  # unchecked: the broken weights pass unseen
    with pytest.raises(SyncVerificationError, match="differ from the actor's by 0.5"):
        sync_and_check(sync, 4)


def test_a_wrong_tensor_is_named_by_the_exact_check_where_the_log_probs_agree():
    sync = weight_sync(verify_every=1, total_steps=3, engines=Engines(wrong_tensor_from=2))
    assert sync_and_check(sync, 1)["sync/checksum_tensors"] == 2.0
    with pytest.raises(
        WeightChecksumError,
        match=r"rollout engine 0 \(float32\).* 1 of 2 tensors: lm_head.weight: "
        r"rollout worker 0 loaded checksum 0x8, the actor's is 0x7",
    ):
        sync_and_check(sync, 2)


def test_the_gap_threshold_is_measured_per_dtype_unless_set():
    from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE

    assert weight_sync(verify_every=1, total_steps=1).threshold == LOGPROB_GAP_BY_DTYPE[("float32", "float32")]
    config = load_config(QUICKSTART, ["model.dtype=bfloat16", "rollout.sync.logprob_gap_threshold=0.25"])
    roles = SimpleNamespace(policy=Group(sync_plan=lambda: ["the plan"]), rollout=Engines(), routes=None)
    assert WeightSync(roles, config, vocab_size=64, total_steps=1).threshold == 0.25


def test_bf16_engines_beside_an_fp32_actor_are_checked_in_bf16_with_the_pairs_threshold():
    """`rollout.dtype=bfloat16` with `model.dtype=float32`: the engines hold the actor's weights cast to
    bf16, so the exact check casts the actor's side to bf16 too, and the gap threshold is the mixed pair's."""
    from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE

    config = load_config(QUICKSTART, ["model.dtype=float32", "rollout.dtype=bfloat16"])
    asked = []

    class Policy(Group):
        def call_all(self, method, *args):
            asked.extend(args if method == "weight_checksums" else ())
            return super().call_all(method)

    policy = Policy(
        sync_plan=lambda: ["the plan"],
        weight_checksums=lambda: RANK_CHECKSUMS,
        send_weights=lambda: [{"sync/seconds": 0.01}] * 2,
        probe_log_probs=lambda: [ACTOR_LOG_PROBS] * 2,
    )
    sync = WeightSync(
        SimpleNamespace(policy=policy, rollout=Engines(dtype="bfloat16"), routes=None),
        config,
        vocab_size=64,
        total_steps=1,
    )
    assert sync.dtype == "bfloat16" and sync.threshold == LOGPROB_GAP_BY_DTYPE[("float32", "bfloat16")]
    sync_and_check(sync, 1)
    assert asked == ["bfloat16"]


def test_the_probe_has_probe_batch_size_sequences():
    config = load_config(QUICKSTART, ["rollout.sync.probe_batch_size=3"])
    roles = SimpleNamespace(policy=Group(sync_plan=lambda: ["the plan"]), rollout=Engines(), routes=None)
    sync = WeightSync(roles, config, vocab_size=64, total_steps=1)
    assert len(sync.probe) == 3 and all(0 <= token < 64 for sequence in sync.probe for token in sequence)
