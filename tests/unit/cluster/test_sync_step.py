"""`WeightSync`: which syncs run the checks (`rollout.sync.verify_every`), that the engines checksum
only the loads of checked syncs, and that a bad sync is caught on a checked step, by the exact check
(naming the tensor) or by the log-prob gap. The hand-over (`HandOver.to_rollout`, engines that do not
sleep) sends the sync's calls to worker groups of stand-in ranks that record them
(`recorded_transfers.RecordingWorkers`)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from recorded_transfers import RecordingWorkers

from megarl.bridge.checksum import LoadedChecksums, WeightChecksumError
from megarl.bridge.ring_routes import route_rings
from megarl.bridge.transports.sources import CollectivePlan, RankRings, SharedRings
from megarl.bridge.verify import SyncVerificationError
from megarl.cluster.handover import HandOver
from megarl.cluster.sync_step import WeightSync
from megarl.cluster.timing import PhaseTimer
from megarl.config.loader import load_config

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
ACTOR_LOG_PROBS = -torch.rand(4, 7) - 1.0
RANK_CHECKSUMS = [{"model.norm.weight": 5, "lm_head.weight": 3}, {"lm_head.weight": 4}]
"""Two trainer ranks' partial checksums (the quickstart trains in float32): the engines must load these sums."""


class PolicyRank:
    """A trainer rank (`PolicyWorker`) of TP 2: its shards' checksums, the probe's log-probs."""

    def __init__(self, rank: int):
        self.rank = rank
        self.checksum_dtypes: list[str] = []

    def sync_plan(self):
        return ["the plan"]

    def begin_weight_sync(self) -> str:
        return f"ring {self.rank}"

    def send_weights(self) -> dict[str, float]:
        return {"sync/seconds": 0.01}

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        self.checksum_dtypes.append(dtype)
        return RANK_CHECKSUMS[self.rank]

    def probe_log_probs(self, token_ids) -> torch.Tensor:
        return ACTOR_LOG_PROBS

    def memory_stats(self) -> dict[str, float]:
        return {}

    offload_training_state = offload_params = memory_stats


class EngineRank:
    """One rollout engine (`RolloutWorker`) whose weights count syncs; `broken_from` makes its log-probs
    wrong from that sync on (as an engine that silently missed a tensor would), `wrong_tensor_from`
    makes it load a wrong `lm_head.weight` from that sync on, its log-probs unchanged (a small error
    the gap misses)."""

    def __init__(self, broken_from: int | None = None, wrong_tensor_from: int | None = None, dtype: str = "float32"):
        self.version, self.broken_from, self.wrong_tensor_from, self.dtype = 0, broken_from, wrong_tensor_from, dtype
        self.source = None
        """What the last `start_receive` was given."""

    def checksum_loads(self, enabled: bool) -> None:
        pass

    def start_receive(self, source) -> None:
        self.source = source

    def finish_receive(self, timeout_s: float) -> int:
        self.version += 1
        return self.version

    def prompt_logprobs(self, token_ids) -> list[torch.Tensor]:
        return list(ACTOR_LOG_PROBS + (0.5 if self._broken() else 0.0))

    def loaded_checksums(self) -> list[LoadedChecksums]:
        wrong = self.wrong_tensor_from is not None and self.version >= self.wrong_tensor_from
        return [LoadedChecksums(self.dtype, full={"model.norm.weight": 5, "lm_head.weight": 8 if wrong else 7})]

    def memory_stats(self) -> dict[str, float]:
        return {}

    def _broken(self) -> bool:
        return self.broken_from is not None and self.version >= self.broken_from


def group(*ranks) -> RecordingWorkers:
    workers = RecordingWorkers(len(ranks), ())
    workers.ranks = list(ranks)
    return workers


GRIDS = [
    dict(rank=0, tp_rank=0, pp_rank=0, dp_rank=0, dp_size=1, sync_sender=0),
    dict(rank=1, tp_rank=1, pp_rank=0, dp_rank=0, dp_size=1, sync_sender=1),
]
"""The actor's grid (`PolicyWorker.grid`): TP 2, two ranks."""


def weight_sync(
    verify_every: int, total_steps: int, engine: EngineRank | None = None, routes=None, overrides=()
) -> HandOver:
    """The hand-over of a split run (engines that never sleep) driving a `WeightSync` of the quickstart."""
    config = load_config(QUICKSTART, [f"rollout.sync.verify_every={verify_every}", *overrides])
    policy = group(PolicyRank(0), PolicyRank(1))
    roles = SimpleNamespace(
        groups={"actor": SimpleNamespace(workers=policy)},
        policy=policy,
        rollout=group(engine or EngineRank()),
        routes=routes,
    )
    sync = WeightSync(roles, config, vocab_size=64, total_steps=total_steps)
    return HandOver(roles, sync, engines_sleep=False, timer=PhaseTimer())


def sync_and_check(handover: HandOver, step: int) -> dict[str, float]:
    """One step's sync and its check (`to_rollout`)."""
    return handover.to_rollout(step)


def checked_steps(handover: HandOver, steps) -> list[int]:
    return [step for step in steps if "sync/logprob_max_abs_diff" in sync_and_check(handover, step)]


def methods(workers: RecordingWorkers) -> list[str]:
    return [call.method for call in workers.calls]


def test_checks_the_first_sync_every_kth_step_and_the_last():
    handover = weight_sync(verify_every=3, total_steps=8)
    assert checked_steps(handover, range(1, 9)) == [1, 3, 6, 8]
    # Each checked sync checksums and probes the actor and every engine once; every sync sends and receives.
    policy, rollout = methods(handover.sync.policy), methods(handover.sync.rollout)
    assert policy.count("probe_log_probs") == policy.count("weight_checksums") == 4
    assert rollout.count("prompt_logprobs") == rollout.count("loaded_checksums") == 4
    assert rollout.count("finish_receive") == policy.count("send_weights") == 8
    assert policy.count("sync_plan") == 1  # fetched once per run
    # The engines checksum the loads of checked syncs only: off after step 1, on for 3, off, on for 6, 8.
    assert rollout.count("checksum_loads") == 6


def test_every_sync_is_checked_by_default():
    handover = weight_sync(verify_every=1, total_steps=5)
    assert checked_steps(handover, range(1, 6)) == [1, 2, 3, 4, 5]


def test_a_resumed_run_checks_its_first_sync():
    handover = weight_sync(verify_every=4, total_steps=10)
    # The resume sync loads the step-5 checkpoint's weights into new engines, then steps 6.. follow.
    assert checked_steps(handover, [5, 6, 7, 8, 9, 10]) == [5, 8, 10]


def test_a_sync_is_received_then_checked_in_order():
    handover = weight_sync(verify_every=1, total_steps=1)
    metrics = sync_and_check(handover, 1)
    policy, rollout = handover.sync.policy, handover.sync.rollout
    # The actor's side of the check with its send, while its parameters are on the devices; the
    # engines' once they are awake, after the actor's parameters left.
    assert methods(policy) == [
        "sync_plan",
        "memory_stats",
        "offload_training_state",
        "send_weights",
        "weight_checksums",
        "probe_log_probs",
        "offload_params",
    ]
    assert methods(rollout) == [
        "memory_stats",
        "start_receive",
        "finish_receive",
        "loaded_checksums",
        "prompt_logprobs",
    ]
    assert rollout.ranks[0].source == CollectivePlan(["the plan"])
    # One round trip per group per phase: the policy's offload, then its send with the engines' receive, then the engines' check.
    assert [call.trip for call in policy.calls] == [0, 1, 1, 2, 2, 2, 2]
    assert [call.trip for call in rollout.calls] == [0, 0, 0, 1, 1]
    assert metrics["sync/weight_version"] == 1.0
    assert metrics["sync/checksum_tensors"] == 2.0
    assert metrics["sync/logprob_max_abs_diff"] == 0.0


def test_an_unchecked_sync_asks_for_no_check():
    handover = weight_sync(verify_every=2, total_steps=5)
    sync_and_check(handover, 1)  # a run's first sync: checked
    policy, rollout = handover.sync.policy, handover.sync.rollout
    policy.calls.clear(), rollout.calls.clear()
    assert "sync/logprob_max_abs_diff" not in sync_and_check(handover, 3)
    assert methods(policy) == ["memory_stats", "offload_training_state", "send_weights", "offload_params"]
    # The engines stop checksumming with the receive, and are not called again.
    assert methods(rollout) == ["memory_stats", "checksum_loads", "start_receive", "finish_receive"]


def test_a_gathered_shared_sync_starts_each_engine_worker_on_its_own_devices_ring():
    # Colocated, one TP-2 engine over the two ranks' devices; with per_rank off every rank hosts the
    # gathered buckets, and worker r reads rank r's.
    routes = route_rings(GRIDS, engines=1, rollout_tp=2, colocated=True, per_rank=False, experts_split=False)
    handover = weight_sync(verify_every=1, total_steps=1, routes=routes)
    sync_and_check(handover, 1)
    rollout, policy = handover.sync.rollout, handover.sync.policy
    assert methods(rollout)[1:] == ["start_receive", "finish_receive", "loaded_checksums", "prompt_logprobs"]
    assert rollout.ranks[0].source == SharedRings({0: "ring 0", 1: "ring 1"})
    # The rings open with the policy's offload, before the engines start on them.
    assert methods(policy) == [
        "memory_stats",
        "offload_training_state",
        "begin_weight_sync",
        "send_weights",
        "weight_checksums",
        "probe_log_probs",
        "offload_params",
    ]
    assert [call.trip for call in policy.calls] == [0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("train_tp, mode", [(2, "per_rank"), (1, "scheduled")])
def test_a_per_rank_layout_sync_starts_each_engine_worker_on_its_ranks_rings(train_tp, mode):
    # Actor TP 2 (GRIDS): each rank's own shards; as if TP 1 × PP 2: the schedule's pieces, in the same
    # per-rank layout, so the same per-rank load.
    grids = GRIDS if train_tp == 2 else [dict(g, tp_rank=0, pp_rank=g["tp_rank"]) for g in GRIDS]
    routes = route_rings(grids, engines=1, rollout_tp=2, colocated=True, per_rank=True, experts_split=False)
    assert routes.mode == mode
    handover = weight_sync(verify_every=1, total_steps=1, routes=routes)
    sync_and_check(handover, 1)
    rollout = handover.sync.rollout
    assert methods(rollout)[1:] == ["start_receive", "finish_receive", "loaded_checksums", "prompt_logprobs"]
    assert rollout.ranks[0].source == RankRings({0: ["ring 0"], 1: ["ring 1"]})


def test_a_bad_sync_is_caught_on_the_next_checked_step():
    handover = weight_sync(verify_every=2, total_steps=10, engine=EngineRank(broken_from=3))
    assert checked_steps(handover, [1, 2]) == [1, 2]
    assert "sync/logprob_max_abs_diff" not in sync_and_check(handover, 3)  # unchecked: the broken weights pass unseen
    with pytest.raises(SyncVerificationError, match="differ from the actor's by 0.5"):
        sync_and_check(handover, 4)


def test_a_wrong_tensor_is_named_by_the_exact_check_where_the_log_probs_agree():
    handover = weight_sync(verify_every=1, total_steps=3, engine=EngineRank(wrong_tensor_from=2))
    assert sync_and_check(handover, 1)["sync/checksum_tensors"] == 2.0
    with pytest.raises(
        WeightChecksumError,
        match=r"rollout engine 0 \(float32\).* 1 of 2 tensors: lm_head.weight: "
        r"rollout worker 0 loaded checksum 0x8, the actor's is 0x7",
    ):
        sync_and_check(handover, 2)


def test_the_gap_threshold_is_measured_per_dtype_unless_set():
    from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE

    assert weight_sync(verify_every=1, total_steps=1).sync.threshold == LOGPROB_GAP_BY_DTYPE[("float32", "float32")]
    overrides = ["model.dtype=bfloat16", "rollout.sync.logprob_gap_threshold=0.25"]
    assert weight_sync(verify_every=1, total_steps=1, overrides=overrides).sync.threshold == 0.25


def test_bf16_engines_beside_an_fp32_actor_are_checked_in_bf16_with_the_pairs_threshold():
    """`rollout.dtype=bfloat16` with `model.dtype=float32`: the engines hold the actor's weights cast to
    bf16, so the exact check casts the actor's side to bf16 too, and the gap threshold is the mixed pair's."""
    from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE

    handover = weight_sync(
        verify_every=1,
        total_steps=1,
        engine=EngineRank(dtype="bfloat16"),
        overrides=["model.dtype=float32", "rollout.dtype=bfloat16"],
    )
    sync = handover.sync
    assert sync.dtype == "bfloat16" and sync.threshold == LOGPROB_GAP_BY_DTYPE[("float32", "bfloat16")]
    sync_and_check(handover, 1)
    assert [rank.checksum_dtypes for rank in sync.policy.ranks] == [["bfloat16"], ["bfloat16"]]


def test_the_probe_has_probe_batch_size_sequences():
    sync = weight_sync(verify_every=1, total_steps=1, overrides=["rollout.sync.probe_batch_size=3"]).sync
    assert len(sync.probe) == 3 and all(0 <= token < 64 for sequence in sync.probe for token in sequence)
