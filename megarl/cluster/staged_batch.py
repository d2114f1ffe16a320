"""A step's batch staged once on each Megatron group the step calls; later calls send only what is new.

    with roles.stage(batch, updates=["update_actor"]) as staged:     # nothing travels yet
        staged.keep("compute_log_prob", "old_log_probs", output=0)    # stages the actor's rows; no reply
        batch.values = staged.gather("compute_values", keep="values")  # stages the critic's; GAE reads them here
        batch.advantages, batch.returns = compute_advantages(...)
        metrics = staged.update("update_actor", step)                 # sends the advantages only; drops the rows
    # every group called dropped its staged rows

The first call of a step to a group stages that group's rows of `batch` (`PolicyWorker.stage_batch`, in
the same round trip as the call: a chain, `WorkerGroup.submit`): one part per DP replica, in the
group's DP order, put in Ray's object store once and read by the replica's TP × PP ranks, holding the
tokens, masks and the fields the group's roles read (`READ_BY`); each part is a tensor of its own (a
view would carry the whole batch's storage through Ray's serializer, once per part). A later call
(`PolicyWorker.call_staged`) sends the fields the driver set on `batch` since then that the group's
roles read and it does not hold (the advantages and returns), and the step. The group's last update of
the step (`updates`: the updates the step runs, in order) drops the rows in its round trip
(`PolicyWorker.drop_staged`); a group whose last call is no update drops them at the end, in a round trip
of its own. Only the DP leaders send results back (`is_dp_leader`; an update's metrics: rank 0). A result
can stay where it is produced (`keep`): the old and reference log-probs stay in the actor's group and
reach the driver only when it asks (`fetch`: the KL penalty in the reward); the critic's values and
the reward model's scores come back (GAE and the rewards run in the driver); a
result kept in a group that does not host its reader (the log-probs of a reference with a group of its
own) comes back to the driver and travels on with the next call to its reader's group.

DP order. A group's rows are cut into equal consecutive parts, one per DP replica: as they are, or,
when a role of the group packs its micro-batches (`Roles.packed_roles`), reordered so that the
replicas get about equal tokens (`balance_over_ranks`; a packed rank's time follows its tokens).
Results come back in row order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from megarl.cluster.megatron_group import MegatronGroup, gather_by_dp, is_dp_leader
from megarl.orchestration.worker_group import Call
from megarl.workers.batch import PolicyBatch
from megarl.workers.micro_batches import token_counts
from megarl.workers.packing import balance_over_ranks
from megarl.workers.profiling import ProfileRequest

METHOD_ROLES = {
    "compute_log_prob": "actor",
    "update_actor": "actor",
    "compute_ref_log_prob": "ref",
    "compute_values": "critic",
    "update_critic": "critic",
    "compute_rm_scores": "actor",  # the reward model lives in the actor's processes
}
"""The role whose group runs each per-sample worker method."""
READ_BY = {
    "rollout_log_probs": "actor",
    "old_log_probs": "actor",
    "ref_log_probs": "actor",
    "advantages": "actor",
    "values": "critic",
    "returns": "critic",
    "loss_mask": "actor",
}
"""The role whose methods read each `PolicyBatch` field beyond the tokens and masks (which every role reads;
so does `routed_experts`, which the actor and the reference replay, in one group or two)."""


@dataclasses.dataclass
class GroupStage:
    """What one group holds of the step's batch."""

    group: MegatronGroup
    roles: frozenset[str]
    """The roles the group hosts."""
    order: Tensor
    """`[B]` the batch's rows in the order they are cut into the group's DP parts."""
    held: set[str] = dataclasses.field(default_factory=set)
    """The `PolicyBatch` fields staged there; empty until the group's first call of the step."""
    dropped: bool = False
    """Whether the group dropped its rows (with its last update)."""

    def reads(self, field: str) -> bool:
        return field not in READ_BY or READ_BY[field] in self.roles

    def parts(self, rows: Tensor) -> list[Tensor]:
        """`rows` (`[B, ...]`) cut into the group's DP parts, each a tensor of its own (a view would carry
        the whole batch's storage through Ray's serializer)."""
        return [rows[order] for order in self.order.chunk(self.group.dp_size)]

    def in_row_order(self, per_rank: list) -> Tensor:
        """The DP leaders' results (`[b, ...]` each, in DP order) as `[B, ...]` in the batch's row order."""
        gathered = gather_by_dp(per_rank, self.group.grids)
        in_order = torch.empty_like(gathered)
        in_order[self.order] = gathered
        return in_order


class StagedBatch:
    """The driver's side of one step's staged batch (`Roles.stage`); a context manager that drops it."""

    def __init__(
        self,
        groups: dict[str, MegatronGroup],
        batch: PolicyBatch,
        packed_roles: frozenset[str],
        profile: ProfileRequest | None = None,
        updates: Sequence[str] = (),
    ):
        """`profile`: the step's, sent with each group's staging (`megarl.trainer.profile_schedule`);
        `updates`: the update methods the step runs, in order (a group's last drops its rows)."""
        self.batch = batch
        """The driver's view of the step's batch: the fields it set or received (not those kept in groups)."""
        self.profile = profile
        self.last_update = {id(groups[METHOD_ROLES[method]]): method for method in updates}
        """By `id` of the group: the method of its last update this step."""
        self.groups = groups
        self.packed_roles = packed_roles
        self.stages: dict[int, GroupStage] = {}
        """By `id` of the group: the groups called so far this step."""

    def gather(self, method: str, *, output: int | None = None, keep: str | None = None) -> Tensor:
        """`[B, ...]` rows of a per-sample method (`output` picks one of a tuple), in row order; with
        `keep`, also kept in the group as that field of its staged batch."""
        stage, per_rank = self._call(method, (), keep=keep, output=output, replies=is_dp_leader)
        return stage.in_row_order(per_rank)

    def keep(self, method: str, field: str, *, output: int | None = None) -> None:
        """Run a per-sample method and keep its result as `field` of the staged batch where it is read:
        in the group that ran it, or, when `field`'s reader lives in another group, through the driver
        (`batch.<field>`) with that group's next call."""
        reader = self.groups.get(READ_BY[field])
        elsewhere = reader is not None and reader is not self.groups[METHOD_ROLES[method]]
        stage, per_rank = self._call(
            method, (), keep=field, output=output, replies=is_dp_leader if elsewhere else _no_reply
        )
        if elsewhere:
            setattr(self.batch, field, stage.in_row_order(per_rank))

    def fetch(self, field: str) -> Tensor:
        """`[B, ...]` rows of a field: the driver's, or those a group kept (`keep`)."""
        if getattr(self.batch, field) is None:
            holder = next((stage for stage in self.stages.values() if field in stage.held), None)
            if holder is None:
                raise ValueError(
                    f"PolicyBatch.{field} is neither in the driver nor kept in a worker group this "
                    f"step; compute it first (StagedBatch.keep or gather)"
                )
            per_rank = holder.group.call_by_dp("staged_field", [(field,)] * holder.group.dp_size, replies=is_dp_leader)
            setattr(self.batch, field, holder.in_row_order(per_rank))
        return getattr(self.batch, field)

    def update(self, method: str, step: int) -> dict[str, float]:
        """An update (`update_actor` / `update_critic`) on each DP replica's staged rows; the metrics of
        DP replica 0 (they are reduced over DP inside the update)."""
        stage, results = self._call(method, (step,), keep=None, output=None, replies=lambda grid: grid["rank"] == 0)
        return next(r for g, r in zip(stage.group.grids, results) if g["rank"] == 0)

    def _call(
        self, method: str, args: tuple, *, keep: str | None, output: int | None, replies
    ) -> tuple[GroupStage, list]:
        """`PolicyWorker.call_staged` on every rank of `method`'s group, with the fields new to it: after
        staging its rows on the group's first call, before dropping them on its last update; one round trip."""
        group = self.groups[METHOD_ROLES[method]]
        first = id(group) not in self.stages
        stage = self._stage(group)
        new = {name: stage.parts(rows) for name, rows in self._fields(stage).items()}
        parts = [{name: parts[k] for name, parts in new.items()} for k in range(group.dp_size)]
        if first:  # the rows travel as the replica's staged `PolicyBatch`, with the step's profile request
            per_dp = [
                [
                    Call("stage_batch", (PolicyBatch(**part), self.profile)),
                    Call("call_staged", (method, {}, keep, output, *args)),
                ]
                for part in parts
            ]
        else:
            per_dp = [[Call("call_staged", (method, part, keep, output, *args))] for part in parts]
        stage.held |= set(new) | ({keep} if keep else set())
        stage.dropped = self.last_update.get(id(group)) == method
        if stage.dropped:
            per_dp = [[*calls, Call("drop_staged")] for calls in per_dp]
        results = group.chain_by_dp(per_dp, replies)
        at = int(first)  # the call's result in each rank's chain
        return stage, [None if answers is None else answers[at] for answers in results]

    def _stage(self, group: MegatronGroup) -> GroupStage:
        """The group's stage (cut into its DP parts in its order), made on its first call of the step."""
        if id(group) not in self.stages:
            roles = frozenset(role for role, hosting in self.groups.items() if hosting is group)
            self.stages[id(group)] = GroupStage(group, roles, self._dp_order(roles, group.dp_size))
        return self.stages[id(group)]

    def _fields(self, stage: GroupStage) -> dict[str, Tensor]:
        """The driver's fields that the group's roles read and it does not hold yet."""
        return {
            field.name: rows
            for field in dataclasses.fields(PolicyBatch)
            if (rows := getattr(self.batch, field.name)) is not None
            and field.name not in stage.held
            and stage.reads(field.name)
        }

    def _dp_order(self, roles: frozenset[str], dp_size: int) -> Tensor:
        """`[B]` the rows as they are, or balanced by tokens over `dp_size` parts for a group with a packed role."""
        if not roles & self.packed_roles:
            return torch.arange(len(self.batch))
        per_rank = balance_over_ranks(token_counts(self.batch).sum(dim=1).tolist(), dp_size)
        return torch.tensor([row for rows in per_rank for row in rows], dtype=torch.long)

    def close(self) -> None:
        """Every group called this step that still holds its staged rows drops them (the next step stages
        anew; a stage replaces the last one, so a step cut short by an error leaves no more than one behind)."""
        for stage in self.stages.values():
            if not stage.dropped:
                stage.group.workers.call_all("drop_staged")
        self.stages.clear()

    def __enter__(self) -> StagedBatch:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:  # after a failure the groups may be gone; the next stage replaces the rows anyway
            self.close()


def _no_reply(grid: dict[str, int]) -> bool:
    """No rank sends its result back (it stays in the worker)."""
    return False
