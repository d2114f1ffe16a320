"""The end of every step: the actor's new weights into every rollout engine, then (on verified
steps) the check that the engines now hold exactly the actor's weights and compute its log-probs.

A sync is three Ray round trips (`start_receive`, `send_weights`, `finish_receive`), four with a
shared transport (every ring-hosting trainer rank opens its ring in `begin_weight_sync`, and each
engine starts from the rings its workers read: `megarl.bridge.ring_routes`). Waking sleeping engines is the hand-over's
(`megarl.trainer.handover`): their weights before the sync, their KV cache after it.

The check is split in two, because the hand-over moves the actor's parameters off the devices before
the engines' KV cache comes back. At the sync (`__call__`), while the parameters are there, the
trainer ranks' checksums of their shards and the actor's log-probs of the probe batch; once the
engines are fully awake (`check_engines`), every engine worker's checksums of what its loader
received (`megarl.bridge.checksum`, exact, in the engines' dtype, naming any tensor that differs), then
the engines' probe log-probs, within `rollout.sync.logprob_gap_threshold`. `rollout.sync.verify_every
= k` runs the check on steps that are multiples of k, on the last step and always on the first sync
of a run (a resumed run's too: its engines are new); the engines checksum only the loads of checked
syncs (`checksum_loads`).
"""

from __future__ import annotations

from torch import Tensor

from megarl.bridge.checksum import check_checksums, combine
from megarl.bridge.plan import LayoutPair
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.config import Config
from megarl.config.rollout import logprob_gap_threshold, rollout_dtype
from megarl.trainer.metrics import reduce_metrics

SYNC_TIMEOUT_S = 300.0
"""How long the driver waits on a weight-sync call of the engines (connecting the group, finishing a receive)."""


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

    def __call__(self, step: int) -> dict[str, float]:
        """Sync the weights trained up to `step`: `sync/*` transfer metrics. When `verifies(step)`, also
        take the actor's side of the check now, for `check_engines` to complete."""
        checked = self.verifies(step)
        if checked != self.engines_checksum:
            self.rollout.call_all("checksum_loads", checked)
            self.engines_checksum = checked
        if self.routes is None:
            self.rollout.call_all("start_receive", self.plan)
        else:
            self.start_shared_receive()
        metrics = reduce_metrics(self.policy.call_all("send_weights"))
        versions = self.rollout.call_all("finish_receive", SYNC_TIMEOUT_S)
        metrics["sync/weight_version"] = float(min(versions))
        if checked:
            self.actor_side = (
                combine(self.policy.call_all("weight_checksums", self.dtype)),
                self.policy.call_all("probe_log_probs", self.probe)[0],
            )
        return metrics

    def start_shared_receive(self) -> None:
        """Open every ring-hosting rank's ring and start each engine on the rings its workers read:
        per-rank tensors ("per_rank", "scheduled"), `{tp_rank: [ring per trainer stage]}`; gathered,
        `{tp_rank: ring}`."""
        rings = self.policy.call_all("begin_weight_sync")
        by_engine = [self.routes.engine_rings(k, rings) for k in range(self.rollout.world_size)]
        if self.routes.rank_layout:
            self.rollout.call_each("start_rank_receive", [(engine,) for engine in by_engine])
        else:
            self.rollout.call_each(
                "start_shared_receive", [({tp: ring for tp, (ring,) in engine.items()},) for engine in by_engine]
            )

    def check_engines(self) -> dict[str, float]:
        """After a checked sync, with the engines awake: every tensor every engine loaded against the
        actor's shards (`sync/checksum_tensors`), then the engines' probe log-probs against the actor's
        (`sync/logprob_*`, worst engine); raises `SyncVerificationError` / `WeightChecksumError` on a
        bad sync. Nothing (`{}`) after an unchecked sync."""
        if self.actor_side is None:
            return {}
        (expected, actor_lp), self.actor_side = self.actor_side, None
        checks = [
            check_checksums(expected, loaded, dtype=self.dtype, layout=self.layout, engine=f"rollout engine {i}")
            for i, loaded in enumerate(self.rollout.call_all("loaded_checksums"))
        ]
        gaps = [
            check_sync(engine_lp, actor_lp, threshold=self.threshold, layout=self.layout)
            for engine_lp in self.rollout.call_all("prompt_logprobs", self.probe)
        ]
        self.verified_once = True
        return reduce_metrics(checks) | reduce_metrics(gaps)
