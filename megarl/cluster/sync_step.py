"""The end of every step: the actor's new weights into every rollout engine, then (on verified
steps) the check that the engines now hold exactly the actor's weights and compute its log-probs.

`WeightSync` says which calls each side makes and reads what they answer; the hand-over
(`megarl.cluster.handover`) sends them, each side's in one round trip with the hand-over's own calls
around them (waking the engines' weights before they receive, offloading the actor's parameters after
it sent): the engines' (`receive`: on checked syncs checksumming the load, `checksum_loads`; starting
the receive from the sync's weight source, `start_receive`; waiting for it,
`finish_receive`) and the policy's (`send`: `send_weights`) at once, since each waits for the other. A
shared transport first opens the rings the engines read (`opening`: every ring-hosting trainer rank's
`begin_weight_sync`, and each engine starts from the rings its workers read: `megarl.bridge.ring_routes`),
with the policy's call before.

The check is split in two, because the hand-over moves the actor's parameters off the devices before
the engines' KV cache comes back. With the send (`send`, checked syncs), while the parameters are there,
the trainer ranks' checksums of their shards and the actor's log-probs of the probe batch; once the
engines are fully awake (`engine_checks`, `check_engines`), every engine worker's checksums of what its
loader received (`megarl.bridge.checksum`, exact, in the engines' dtype, naming any tensor that differs),
then the engines' probe log-probs, within `rollout.sync.logprob_gap_threshold`. `rollout.sync.verify_every
= k` runs the check on steps that are multiples of k, on the last step and always on the first sync
of a run (a resumed run's too: its engines are new); the engines checksum only the loads of checked
syncs.
"""

from __future__ import annotations

from torch import Tensor

from megarl.bridge.checksum import check_checksums, combine
from megarl.bridge.plan import LayoutPair
from megarl.bridge.transports.sources import CollectivePlan, RankRings, SharedRings, WeightSource
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.cluster.metric_reduce import reduce_metrics
from megarl.config.config import Config
from megarl.config.rollout import logprob_gap_threshold, rollout_dtype
from megarl.orchestration.worker_group import Call

SYNC_TIMEOUT_S = 300.0
"""How long an engine waits on a weight-sync operation (connecting the group; a receive, the send it waits
for included)."""


class WeightSync:
    """Syncs the policy group's weights into the rollout group, verifying every `verify_every` steps."""

    def __init__(self, roles, config: Config, *, vocab_size: int, total_steps: int):
        """`roles`: the run's worker groups (`policy`, `rollout`); `vocab_size`: the tokenizer's, for
        the probe batch."""
        self.policy, self.rollout = roles.policy, roles.rollout
        self.routes = roles.routes
        """Which ring each engine worker reads (None: the collective transport)."""
        self.settings = config.rollout.sync
        self.dtype = rollout_dtype(config.rollout, config.model.dtype)
        """The engines' dtype, which the weights are cast to on the way: the exact check's."""
        self.threshold = logprob_gap_threshold(self.settings, config.model.dtype, self.dtype)
        self.total_steps = total_steps
        self.probe = probe_token_ids(vocab_size, sequences=self.settings.probe_batch_size)
        self.layout = LayoutPair(
            config.actor.parallel.tensor_model_parallel_size,
            config.actor.parallel.pipeline_model_parallel_size,
            config.rollout.tensor_model_parallel_size,
            config.actor.parallel.virtual_pipeline_model_parallel_size or 1,
        )
        # The plan is fixed for the run: fetch it once, not on every sync.
        self.plan = None if self.routes else self.policy.call_rank0("sync_plan")
        self.verified_once = False
        self.engines_checksum = True
        """What the engines' `checksum_loads` is set to (they start checksumming: the first sync is checked)."""
        self.actor_side: tuple[dict, Tensor] | None = None
        """The actor's checksums and probe log-probs of the last sync, until `check_engines` uses them."""

    def verifies(self, step: int) -> bool:
        """Whether the sync after `step` is checked."""
        return not self.verified_once or step % self.settings.verify_every == 0 or step == self.total_steps

    def opening(self) -> list[Call]:
        """The policy's calls that open a sync, before the engines receive: a shared transport's rings
        (each rank's, None where it hosts none: `receive`'s `opened`); none for the collective."""
        return [] if self.routes is None else [Call("begin_weight_sync")]

    def receive(self, checked: bool, opened: list | None) -> list[list[Call]]:
        """Each engine's calls that receive one sync (answering with its weight version last), checksumming
        the load when `checked`; `opened`: per policy rank, what `opening` answered (the rings)."""
        toggle = [Call("checksum_loads", (checked,))] if checked != self.engines_checksum else []
        self.engines_checksum = checked
        finish = Call("finish_receive", (SYNC_TIMEOUT_S,))
        return [[*toggle, Call("start_receive", (source,)), finish] for source in self.sources(opened)]

    def sources(self, opened: list | None) -> list[WeightSource]:
        """Each engine's weight source of one sync: the plan over the sync group, or the rings its workers read."""
        if self.routes is None:
            return [CollectivePlan(self.plan)] * self.rollout.world_size
        by_engine = [self.routes.engine_rings(k, opened) for k in range(self.rollout.world_size)]
        if self.routes.rank_layout:  # per-rank tensors ("per_rank", "scheduled"): {tp_rank: [ring per trainer stage]}
            return [RankRings(engine) for engine in by_engine]
        return [SharedRings({tp: ring for tp, (ring,) in engine.items()}) for engine in by_engine]  # gathered

    def send(self, checked: bool) -> list[Call]:
        """The policy's calls of one sync: the send; when `checked`, then the actor's side of the check,
        while its parameters are on the devices."""
        check = [Call("weight_checksums", (self.dtype,)), Call("probe_log_probs", (self.probe,))]
        return [Call("send_weights"), *(check if checked else [])]

    def sent(self, checked: bool, sent: list[list], received: list[list]) -> dict[str, float]:
        """`sync/*` transfer metrics of a sync from what the policy ranks answered `send`'s calls and
        the engines `receive`'s; a checked sync keeps the actor's side of the check for `check_engines`."""
        metrics = reduce_metrics([answers[0] for answers in sent])
        metrics["sync/weight_version"] = float(min(answers[-1] for answers in received))
        if checked:
            self.actor_side = (combine([answers[1] for answers in sent]), sent[0][2])
        return metrics

    def engine_checks(self) -> list[Call]:
        """After a checked sync, with the engines awake: their side of the check (none after an unchecked one)."""
        return [] if self.actor_side is None else [Call("loaded_checksums"), Call("prompt_logprobs", (self.probe,))]

    def check_engines(self, answers: list[list]) -> dict[str, float]:
        """After a checked sync, from what each engine answered `engine_checks`: every tensor every engine
        loaded against the actor's shards (`sync/checksum_tensors`), then the engines' probe log-probs
        against the actor's (`sync/logprob_*`, worst engine); raises `SyncVerificationError` /
        `WeightChecksumError` on a bad sync. Nothing (`{}`) after an unchecked sync."""
        if self.actor_side is None:
            return {}
        (expected, actor_lp), self.actor_side = self.actor_side, None
        checks = [
            check_checksums(expected, loaded, dtype=self.dtype, layout=self.layout, engine=f"rollout engine {i}")
            for i, (loaded, _) in enumerate(answers)
        ]
        gaps = [
            check_sync(engine_lp, actor_lp, threshold=self.threshold, layout=self.layout) for _, engine_lp in answers
        ]
        self.verified_once = True
        return reduce_metrics(checks) | reduce_metrics(gaps)
