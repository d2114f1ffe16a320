"""Save and restore what a training job needs to continue exactly where it stopped.

Collective over every rank of one training world (the roles one worker group hosts, one grid; a
critic in a group of its own saves its own checkpoint, `megarl.workers.checkpoint_files.part_dir`):

    step_dir = save_checkpoint(cfg.checkpoint.dir, step, groups,
                               models={"actor": [actor_model]}, optimizers={"actor": actor_optimizer},
                               schedulers={"actor": actor_scheduler}, extra={"step": step, "data": loader.state_dict()})
    extra = load_checkpoint(step_dir, groups, models=..., optimizers=..., schedulers=...)

On disk (`checkpoint_files` explains the temp dir, the manifest and the rename):

    step_00000050/
      manifest.json           written last by rank 0: step, roles, files with sizes and SHA-256s, layout,
                              megarl version (the ranks hash a share of the files each)
      extra.json              the driver's `extra` (JSON), identical on every rank
      actor/model/            megatron dist_checkpointing (torch_dist) of the model chunks: loadable at any TP/PP
      actor/optimizer/        megatron dist_checkpointing of `optimizer.sharded_state_dict(...)`
      actor/scheduler.json    OptimizerParamScheduler.state_dict()
      rng/rank_00000.pt       per-rank RNG states: python, numpy, torch, CUDA, megatron's tracked streams

Model weights load at another (TP, PP) through megatron's resharding (`weights_only=True`); a full
resume (optimizer, scheduler, RNG) needs the layout it was saved from, which is what makes it exact.

Processes. A save starts megatron's file-writer processes (forked, one or two per rank) and waits
for them; none outlives it (`_keep_write_results_in_process`).

Failures. Every step of a save ends with an exchange of each rank's outcome on a gloo group of its
own, so a rank that failed (no space, read-only file system, permission) makes every rank raise the
same `CheckpointError`, naming the checkpoint and the OS reason, and rank 0 removes the temp dir.
Earlier checkpoints are never touched by a save. Inside a megatron save, rank 0 alone writes the
common state before the collectives of the sharded save; every rank exchanges outcomes once more
there (`_AgreedShardedSave`), so rank 0 failing alone (no space) does not leave its peers waiting in
megatron's gather. A rank that fails *inside* one of megatron's own collectives leaves its peers
waiting there until the collective timeout, then they report too.
"""

from __future__ import annotations

import errno
import functools
import io
import json
import os
import queue
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint import CheckpointException

from megarl.models.checkpoint import export_hf_weights
from megarl.parallel.device import uses_cuda
from megarl.parallel.distributed import ProcessGroups
from megarl.workers.checkpoint_files import (
    EXTRA_FILE,
    CheckpointError,
    build_manifest,
    checkpoint_files,
    commit,
    describe_os_error,
    fault_point,
    file_digests,
    new_nonce,
    read_manifest,
    remove_stale_tmp_dirs,
    step_dir_name,
    tmp_dir_for,
    write_durably,
)

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
SCHEDULER_FILE = "scheduler.json"
RNG_DIR = "rng"
HF_EXPORT_DIR = "hf"
FULL_DISK_BYTES = 1 << 20
"""Less free space than this (less than a checkpoint of the smallest model) counts as a full disk (`_is_full`)."""
_OS_ERROR_TEXT = re.compile(r"\[Errno (?P<errno>\d+)\] (?P<reason>[^:]+): '(?P<file>[^']+)'")
# Megatron-LM's choice for the distributed optimizer: each DP rank writes its own buffer shards, no
# gather (reshardable over DP only; an exact resume needs the saved layout anyway). megatron 0.16's
# "fully_sharded_model_space" needs ShardedTensor.flattened_range, which it no longer supports.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "chained_optim_avoid_prefix": True}


def save_checkpoint(
    root: str | Path,
    step: int,
    groups: ProcessGroups,
    *,
    models: dict[str, list[torch.nn.Module]],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    extra: dict[str, Any],
) -> Path:
    """Write `<root>/step_<step>` atomically and return it. Collective over all training ranks.

    models: role -> this rank's model chunks (Megatron modules, DDP-wrapped or not).
    optimizers / schedulers: role -> Megatron optimizer / OptimizerParamScheduler (roles without
    one, e.g. a frozen reference, are left out). extra: JSON-serialisable driver state (step,
    data-loader position, ...), the same on every rank. RNG states are taken from each rank.

    Raises CheckpointError (on every rank) when anything cannot be written; earlier checkpoints stay.
    """
    _keep_write_results_in_process()
    rng_state = _rng_state()
    extra_json = _encode_extra(extra)
    step_dir = Path(root).expanduser() / step_dir_name(step)
    group = _bookkeeping_group(dist.group.WORLD)
    nonce = [new_nonce()]
    dist.broadcast_object_list(nonce, src=0, group=group)
    tmp_dir = tmp_dir_for(step_dir, nonce[0])
    is_writer = dist.get_rank() == 0
    layout = _layout(groups)

    doing = f"saving checkpoint {step_dir}"

    def run(what: str, action: Callable[[], None], on_every_rank: bool = True) -> None:
        _run_agreed(doing, what, action if on_every_rank or is_writer else None, group, tmp_dir.parent)

    def save_sharded(what: str, state: Callable[[], dict], path: Path) -> None:
        run(
            what,
            lambda: dist_checkpointing.save(
                state(), str(path), sharded_strategy=_AgreedShardedSave(doing, what, group)
            ),
        )

    try:
        run("creating the directory", lambda: _create_dirs(tmp_dir, models, optimizers), on_every_rank=False)
        for role, chunks in models.items():
            save_sharded(f"the {role} model", lambda chunks=chunks: _model_state(chunks), tmp_dir / role / MODEL_DIR)
            fault_point("after_model")
            if role in optimizers:
                save_sharded(
                    f"the {role} optimizer",
                    lambda role=role, chunks=chunks: _optimizer_state(optimizers[role], chunks, is_loading=False),
                    tmp_dir / role / OPTIMIZER_DIR,
                )
                fault_point("after_optimizer")
        run("the RNG states", lambda: write_durably(tmp_dir / RNG_DIR / _rng_file(), _to_bytes(rng_state)))
        run(
            "the scheduler and driver states",
            lambda: _write_rank0_states(tmp_dir, schedulers, extra_json),
            on_every_rank=False,
        )
        digests: dict[str, str] = {}
        run("the checksums", lambda: digests.update(_share_of_digests(tmp_dir)))
        digests = _gather_digests(digests, group)
        fault_point("before_manifest")
        run(
            "the manifest",
            lambda: commit(
                tmp_dir,
                step_dir,
                build_manifest(tmp_dir, step=step, roles=list(models), layout=layout, digests=digests),
            ),
            on_every_rank=False,
        )
    except CheckpointError:
        if is_writer:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return step_dir


def load_checkpoint(
    ckpt_dir: str | Path,
    groups: ProcessGroups,
    *,
    models: dict[str, list[torch.nn.Module]],
    optimizers: dict[str, Any],
    schedulers: dict[str, Any],
    weights_only: bool = False,
) -> dict[str, Any]:
    """Restore a complete checkpoint in place and return its `extra`. Collective over all ranks.

    Full resume (default): model weights, optimizer and scheduler states of the given roles, and
    this rank's RNG states; needs the (TP, PP, DP, EP, expert TP) layout the checkpoint was saved from.
    `weights_only=True`: only the model weights, at any layout megatron can reshard to (the given
    optimizers keep their state and take the loaded weights as their main params).
    Raises CheckpointError naming the dir when it is incomplete or does not match.
    """
    ckpt_dir = Path(ckpt_dir).expanduser()
    manifest = read_manifest(ckpt_dir)
    missing = sorted(set(models) - set(manifest.roles))
    if missing:
        raise CheckpointError(f"{ckpt_dir} has no {missing} model (it holds {manifest.roles})")
    layout = _layout(groups)
    if not weights_only and manifest.layout != layout:
        raise CheckpointError(
            f"{ckpt_dir} was saved with layout {manifest.layout}, this job runs {layout}: an exact resume "
            "(optimizer, RNG) needs the same TP/PP/VPP/CP/DP/EP/expert TP; use the saved layout, or load the weights "
            "only"
        )
    for role, chunks in models.items():
        state = dist_checkpointing.load(_model_state(chunks), str(ckpt_dir / role / MODEL_DIR))
        for index, chunk in enumerate(chunks):
            unwrap_model(chunk).load_state_dict(state[f"chunk{index}"])
    if weights_only:
        for optimizer in optimizers.values():
            optimizer.reload_model_params()  # mixed precision: main (fp32) params copy the loaded weights
    else:
        for role, optimizer in optimizers.items():
            if not (ckpt_dir / role / OPTIMIZER_DIR).is_dir():
                raise CheckpointError(f"{ckpt_dir} has no optimizer state for {role}")
            sharded = _optimizer_state(optimizer, models[role], is_loading=True)
            state = dist_checkpointing.load(sharded, str(ckpt_dir / role / OPTIMIZER_DIR))
            # In fp32 the distributed optimizer's main params are views of the model's (autograd leaves).
            with torch.no_grad():
                optimizer.load_state_dict(state)
            _restore_adam_steps(optimizer)
        for role, scheduler in schedulers.items():
            scheduler.load_state_dict(json.loads((ckpt_dir / role / SCHEDULER_FILE).read_text()))
        _set_rng_state(torch.load(ckpt_dir / RNG_DIR / _rng_file(), weights_only=True))
    return json.loads((ckpt_dir / EXTRA_FILE).read_text())


def export_hf(
    actor_model: torch.nn.Module | list[torch.nn.Module],
    root: str | Path,
    groups: ProcessGroups,
    *,
    hf_assets_dir: str | Path,
) -> Path | None:
    """Write the actor as an HF safetensors checkpoint to `<root>/hf` (`checkpoint.export_hf`).

    Collective over the actor's ranks; delegates to `megarl.models.checkpoint.export_hf_weights`
    (appears complete or not at all). `hf_assets_dir`: the source HF dir (config.json, tokenizer).
    Returns the dir on the ranks that wrote, None on the others.
    """
    return export_hf_weights(actor_model, Path(root).expanduser() / HF_EXPORT_DIR, groups, hf_assets_dir=hf_assets_dir)


def _keep_write_results_in_process() -> None:
    """megatron's torch_dist writer passes each save's write results back through a queue served by a
    `multiprocessing` Manager, spawned at the first save and kept for the life of the process, so that
    an asynchronous save's writer process can reach it: a whole interpreter (~300 MiB) per rank. Our
    saves are synchronous, the results are put and taken in this process: a plain queue does it, and
    a save leaves no process behind (its forked file writers are joined before it returns)."""
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _model_state(chunks: list[torch.nn.Module]) -> dict:
    """The sharded state dict of a role: `chunk<i>` -> chunk i's (tensor keys are megatron's global
    names, e.g. absolute layer numbers, which is what lets another TP/PP read them)."""
    return {f"chunk{index}": unwrap_model(chunk).sharded_state_dict() for index, chunk in enumerate(chunks)}


def _optimizer_state(optimizer: Any, chunks: list[torch.nn.Module], *, is_loading: bool) -> dict:
    if is_loading:
        _ensure_adam_state(optimizer)
    return optimizer.sharded_state_dict(_model_state(chunks), is_loading=is_loading, metadata=_OPTIMIZER_METADATA)


def _ensure_adam_state(optimizer: Any) -> None:
    """megatron's DistributedOptimizer builds its loading state dict from its current one, which with
    torch's Adam (no Transformer Engine / Apex) needs each parameter's `step`: a fresh optimizer has
    none yet. Give it the zero state Adam starts from; the load overwrites all of it.

    The offloading optimizer (`HybridDeviceOptimizer`, `optim.cpu_offload`) gets its state from a step of
    its own (`_initialize_hybrid_state`), on GPU too."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if (
            isinstance(inner, distrib_optimizer.DistributedOptimizer)
            and not inner.optimizer.state
            and isinstance(inner.optimizer, HybridDeviceOptimizer)
        ):
            _initialize_hybrid_state(inner.optimizer)
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, distrib_optimizer.DistributedOptimizer) and not inner.optimizer.state:
            for group in inner.optimizer.param_groups:
                for param in group["params"]:
                    inner.optimizer.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }


def _initialize_hybrid_state(hybrid: HybridDeviceOptimizer) -> None:
    """A fresh `HybridDeviceOptimizer` has no state (its fp32 `master_param`s among it) for the loading
    state dict to be built from; megatron's own remedy, `dummy_step` (which `DistributedOptimizer.
    load_state_dict` calls only when the state is empty, after `state_dict()` has needed it), steps on
    random gradients and copies its fp32 copies, taken when the optimizer was built, into the model's
    parameters, already loaded from the checkpoint. Refreshed from the loaded parameters first and
    stepped at learning rate 0 (AdamW's update and decay both scale with it), they change no parameter,
    and the step leaves the state the load overwrites."""
    hybrid.update_fp32_param_by_new_param()
    rates = [group["lr"] for group in hybrid.param_groups]
    for group in hybrid.param_groups:
        group["lr"] = 0.0
    hybrid.dummy_step()
    for group, rate in zip(hybrid.param_groups, rates):
        group["lr"] = rate


def _restore_adam_steps(optimizer: Any) -> None:
    """With torch's Adam, megatron's DistributedOptimizer keeps Adam's `step` in its param groups
    ("step") and means to copy it to every parameter on load; 0.16 ends up with one tensor shared by
    all parameters holding a stale value, which Adam then increments once per parameter per step
    (wrong bias correction). Give each parameter its own copy of the group's step."""
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        # A HybridDeviceOptimizer's state dicts are its sub-optimizers' (torch's AdamW on CPU): the same fix.
        if isinstance(inner, distrib_optimizer.DistributedOptimizer):
            for group in inner.optimizer.param_groups:
                step = group.pop("step")  # the group key is megatron's carrier only, torch's Adam has none
                for param in group["params"]:
                    inner.optimizer.state[param]["step"] = torch.tensor(float(step))


def _create_dirs(tmp_dir: Path, models: dict, optimizers: dict) -> None:
    """Rank 0: remove temp dirs of crashed saves, then create this save's tree (megatron's save
    wants existing dirs)."""
    tmp_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp_dirs(tmp_dir.parent)
    (tmp_dir / RNG_DIR).mkdir(parents=True)
    for role in models:
        (tmp_dir / role / MODEL_DIR).mkdir(parents=True)
        if role in optimizers:
            (tmp_dir / role / OPTIMIZER_DIR).mkdir()


def _write_rank0_states(tmp_dir: Path, schedulers: dict, extra_json: str) -> None:
    for role, scheduler in schedulers.items():
        write_durably(tmp_dir / role / SCHEDULER_FILE, json.dumps(scheduler.state_dict(), indent=1).encode())
    write_durably(tmp_dir / EXTRA_FILE, extra_json.encode())


def _share_of_digests(tmp_dir: Path) -> dict[str, str]:
    """The SHA-256 of this rank's share of the checkpoint's files (every world-size-th, from its rank),
    so that the whole checkpoint is read once, by every rank in parallel."""
    names = checkpoint_files(tmp_dir)
    return file_digests(tmp_dir, names[dist.get_rank() :: dist.get_world_size()])


def _gather_digests(share: dict[str, str], group: dist.ProcessGroup) -> dict[str, str]:
    shares: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, share, group=group)
    return {name: digest for part in shares for name, digest in part.items()}


def _encode_extra(extra: dict[str, Any]) -> str:
    try:
        return json.dumps(extra, indent=1, sort_keys=True)
    except TypeError as e:
        raise CheckpointError(
            f"checkpoint extra state must be JSON-serialisable (numbers, strings, lists, dicts): {e}"
        ) from None


def _layout(groups: ProcessGroups) -> dict[str, int]:
    """The layout an exact resume needs; virtual stages too (the distributed optimizer shards each chunk's
    buffer) and context parallelism (it shards over DP × CP), each recorded only when there is some, so
    checkpoints from before VPP or CP existed compare equal."""
    virtual = {"vpp": groups.vpp_size} if groups.vpp_size > 1 else {}
    virtual |= {"cp": groups.cp_size} if groups.cp_size > 1 else {}
    return {
        "world_size": dist.get_world_size(),
        "tp": groups.tp_size,
        "pp": groups.pp_size,
        "dp": groups.dp_size,
        "ep": groups.ep_size,
        "etp": groups.etp_size,
        **virtual,
    }


def _rng_file() -> str:
    return f"rank_{dist.get_rank():05d}.pt"


def _rng_state() -> dict[str, Any]:
    """Every RNG stream of this rank: python, numpy, torch CPU (and CUDA), megatron's tracked streams,
    as tensors and plain numbers only, so that loading needs no pickled objects (`weights_only=True`)."""
    version, python_keys, python_gauss = random.getstate()
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    return {
        "python": [version, torch.tensor(python_keys, dtype=torch.int64), python_gauss],
        "numpy": [numpy_kind, torch.from_numpy(numpy_keys.astype(np.int64)), numpy_pos, numpy_has_gauss, numpy_gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if uses_cuda() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, python_keys, python_gauss = state["python"]
    random.setstate((version, tuple(python_keys.tolist()), python_gauss))
    numpy_kind, numpy_keys, *numpy_rest = state["numpy"]
    np.random.set_state((numpy_kind, numpy_keys.numpy().astype(np.uint32), *numpy_rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@functools.lru_cache(maxsize=1)
def _bookkeeping_group(world: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the world, used only to agree on outcomes: a rank that failed must not
    meet its peers inside one of megatron's collectives on the default group (cached per world)."""
    return dist.new_group(backend="gloo")


class _AgreedFailure(Exception):
    """A failure every rank has already learned of in an exchange (`_agree`): raised without another."""


class _AgreedShardedSave(SaveShardedStrategy):
    """megatron's sharded save (its default strategy), entered after an exchange of outcomes. In
    `dist_checkpointing.save` rank 0 alone writes the common state (`common.pt`) before the sharded
    save's gathers (megatron/core/dist_checkpointing/serialization.py: save, strategies/common.py:
    TorchCommonSaveStrategy.save_common); failing there (no space), rank 0 leaves for `_run_agreed`'s
    exchange while its peers wait in the first gather, each for the other. This exchange is the one
    rank 0 meets: every rank raises the same failure, and `_run_agreed` exchanges no more."""

    def __init__(self, doing: str, what: str, group: dist.ProcessGroup):
        self.inner = get_default_save_sharded_strategy()
        super().__init__(self.inner.backend, self.inner.version)
        self.doing, self.what, self.group = doing, what, group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.inner.can_handle_sharded_objects

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        _agree(self.doing, self.what, None, self.group, error=_AgreedFailure)
        self.inner.save(sharded_state_dict, checkpoint_dir)


def _run_agreed(doing: str, what: str, action: Callable[[], None] | None, group: dist.ProcessGroup, root: Path) -> None:
    """Run `action` (None: nothing on this rank) writing under `root`, then exchange outcomes: if any rank
    failed, raise the same CheckpointError on every rank, preferring a rank whose failure has an OS reason."""
    failure: BaseException | None = None
    try:
        if action is not None:
            action()
    except _AgreedFailure as agreed:
        raise CheckpointError(str(agreed)) from None
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        failure = (
            e if _describe(e)[0] or not _is_full(root) else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))
        )
    _agree(doing, what, failure, group)


def _is_full(root: Path) -> bool:
    """Whether `root`'s file system has no space left. torch.save's C++ writer (megatron's common state)
    reports a full disk as `basic_ios::clear: iostream error`, without the errno: a failure without an OS
    reason on a full file system is taken for the full disk."""
    try:
        return shutil.disk_usage(root).free < FULL_DISK_BYTES
    except OSError:
        return False


def _agree(
    doing: str,
    what: str,
    failure: BaseException | None,
    group: dist.ProcessGroup,
    error: type[Exception] = CheckpointError,
) -> None:
    """Exchange this rank's outcome (`failure`: None for success); raise `error` on every rank if any failed."""
    outcomes: list[tuple[bool, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, None if failure is None else _describe(failure), group=group)
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if not failed:
        return
    rank, (_, reason) = min(failed, key=lambda item: (not item[1][0], item[0]))
    os_caused = failure is not None and _describe(failure)[0]
    message = f"{doing} failed while writing {what} (rank {rank}): {reason}; earlier checkpoints are untouched"
    raise error(message) from (None if failure is None or os_caused else failure)


def _describe(failure: BaseException) -> tuple[bool, str]:
    """(has an OS reason, one-line reason): the OSError behind a failure when there is one."""
    pending, seen = [failure], []
    while pending:
        error = pending.pop()
        seen.append(error)
        if isinstance(error, OSError):
            return True, describe_os_error(error)
        if isinstance(error, CheckpointException):
            pending += [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]
    for error in seen:
        # megatron's writer processes hand failures back as text ("Worker failure: [Errno 28] No space
        # left on device: '<file>'"), the OSError itself does not survive the trip.
        found = _OS_ERROR_TEXT.search(str(error))
        if found:
            return True, describe_os_error(OSError(int(found["errno"]), found["reason"], found["file"]))
    if isinstance(failure, CheckpointException):  # its str() is every rank's whole traceback
        return False, "; ".join(
            f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in sorted(failure.failures.items())
        ) or "a peer rank failed"
    return False, f"{type(failure).__name__}: {failure}"
