"""The whole sync path on a real model, end to end (`megarl check-sync` and the e2e tests).

`run_distributed` spawns the training ranks, which load the HF checkpoint into a Megatron actor of
the given (TP, PP) and take a few optimizer steps per round (so the weights really change); each
round then syncs and checks each engine two ways: exactly, every tensor it loaded against the
actor's own shards (`checksum`), and by its probe log-probs against the actor's (`verify`). Two set-ups:
`run_sync_check` drives engines in this process, and every training rank sends each engine's
workers the pieces of its own shards they need, over a gloo/NCCL sync group per engine (the
training ranks first; the engine's workers follow);
`run_colocated_check` puts a TP-1 engine inside training rank 0's process (in-process transport).

    engines = {1: make_rollout_engine("vllm", EngineArgs(hf_dir, dtype="float32")), 2: ...(tensor_parallel_size=2)}
    rounds = run_sync_check(hf_dir, train_tp=2, train_pp=1, engines=engines, threshold=1e-4)
    rounds[-1].metrics[2]["sync/logprob_max_abs_diff"], rounds[-1].metrics[2]["sync/checksum_tensors"]
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.bridge import ShardSender
from megarl.bridge.checksum import LoadedChecksums, check_checksums, combine, rank_checksums
from megarl.bridge.collect import conversion_errors, local_params_by_plan_name, sync_rank
from megarl.bridge.plan import LayoutPair, build_plan
from megarl.bridge.sync import WeightSender, receiving, sync_in_process
from megarl.bridge.sync_group import create_weight_sync_group, listen_weight_sync_store
from megarl.bridge.transports import InProcessTransport
from megarl.bridge.verify import check_sync, probe_token_ids
from megarl.models.hf_config import read_model_dims
from megarl.parallel.spawn import run_distributed
from megarl.workers.rollout.base import RolloutEngine
from megarl.workers.rollout.engine_args import EngineArgs
from megarl.workers.sync_probe import actor_probe_logprobs, probe_policy_batch

HOST = "127.0.0.1"
ENGINE_DTYPE = "float32"
"""The engines' dtype here, and so the dtype of the exact check (the actor trains in fp32)."""


@dataclass(frozen=True)
class TrainSettings:
    """How the check moves the actor's weights before each sync."""

    steps_per_round: int = 2
    """Optimizer steps between syncs."""
    lr: float = 1e-2
    """Adam learning rate (large, so a couple of steps visibly change the log-probs)."""
    seed: int = 0
    """Seed of the training batch's tokens and advantages."""


@dataclass
class RoundResult:
    """One train-then-sync round."""

    actor_logprobs: torch.Tensor
    """`[B, T-1]` the actor's probe log-probs right before the sync."""
    engine_logprobs: dict[int, torch.Tensor]
    """Rollout TP → `[B, T-1]` that engine's probe log-probs right after the sync."""
    metrics: dict[int, dict[str, float]]
    """Rollout TP → the verification metrics (`sync/logprob_*_abs_diff`, `sync/checksum_tensors`)."""
    sync_metrics: dict[str, float]
    """The sender's `SyncStats.metrics()`."""


def train_a_little(actor, vocab_size: int, settings: TrainSettings, round_index: int) -> None:
    """`settings.steps_per_round` PPO steps of `actor` on a seeded random batch with random
    advantages: no task, just a deterministic, layout-independent change of every weight."""
    from megarl.config.roles import ActorConfig
    from megarl.workers.actor import PolicyLoss

    generator = torch.Generator().manual_seed(settings.seed + round_index)
    tokens = torch.randint(0, vocab_size, (4, 12), generator=generator).tolist()
    batch = probe_policy_batch(tokens)
    # One sample per micro-batch: 4 micro-batches, which megatron's interleaved schedule runs at any PP <= 4.
    batch.old_log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=1)
    batch.advantages = torch.randn(batch.responses.shape, generator=generator)
    for _ in range(settings.steps_per_round):
        actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=len(tokens), micro_batch_size=1)


def trained_actor_and_plan(model_dir: str, layout: LayoutPair, bucket_mb: float, settings: TrainSettings):
    """This rank's actor loaded from `model_dir` (on a fresh grid), the plan and the model dims."""
    from megarl.config.roles import OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor

    groups = initialize_model_parallel(
        layout.train_tp,
        layout.train_pp,
        seed=settings.seed,
        vpp=layout.train_vpp,
        ep=layout.train_ep,
        etp=layout.train_etp,
    )
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=settings.lr, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False),
        sequence_parallel=layout.train_tp > 1 and read_model_dims(model_dir).num_experts > 0,
        model=ModelConfig(dtype="float32", transformer_impl="local"),
    )
    dims = read_model_dims(model_dir)
    return groups, actor, dims, build_plan(dims, layout, bucket_mb=bucket_mb)


def model_in_dtype(model_dir: str, groups, dtype: str) -> torch.nn.Module:
    """This rank's GPTModel stage with the checkpoint's weights in `dtype` ("float32" or "bfloat16"),
    built as the Megatron roles build it (`load_model` with that `model.dtype`). A forward-only actor,
    for measuring what the dtype alone does to the sync's log-prob gap
    (`benchmarks/sync_logprob_gap.py`) and checking a sync in it."""
    from megarl.config.roles import RecomputeConfig
    from megarl.config.sections import ModelConfig
    from megarl.workers.megatron_train import load_model

    (model,), _ = load_model(
        model_dir,
        groups,
        model=ModelConfig(dtype=dtype, transformer_impl="auto"),
        recompute=RecomputeConfig(),
        value_head=False,
        sequence_parallel=False,
    )
    return model


def trainer_main(
    model_dir: str,
    layout: LayoutPair,
    ports: dict[int, int],
    bucket_mb: float,
    rounds: int,
    settings: TrainSettings,
    timeout_s: float,
) -> list[dict]:
    """One training rank of `run_sync_check`: per round, train, record the actor's probe log-probs,
    send each engine the pieces of its shards that engine's workers need (one sync group per rollout
    TP of `ports`, every rank at its sender rank), list parameters whose conversion does not invert,
    and checksum its shards. Every rank returns its rounds (the log-probs and the sync metrics, of
    the first engine's sync, are rank 0's). `layout.rollout_tp` is unused: each engine's is its own."""
    groups, actor, dims, plan = trained_actor_and_plan(model_dir, layout, bucket_mb, settings)
    rank = sync_rank(layout, groups)  # None: a rank outside DP replica 0 and the first expert-DP replica
    senders = [
        ShardSender(
            build_plan(dims, dataclasses.replace(layout, rollout_tp=tp), bucket_mb=bucket_mb),
            actor.named_parameters_for_sync,
            groups,
            None if rank is None else create_weight_sync_group(HOST, port, rank, layout.senders + tp, timeout_s),
        )
        for tp, port in ports.items()
    ]
    probe = probe_token_ids(dims.vocab_size)
    results = []
    for round_index in range(rounds):
        train_a_little(actor, dims.vocab_size, settings, round_index)
        logprobs = actor_probe_logprobs(actor, probe)
        stats, *_others = [sender.send() for sender in senders]  # every sender sends; the first one's stats
        local = local_params_by_plan_name(plan, actor.named_parameters_for_sync(), groups)
        suspects = conversion_errors(plan, local, groups)
        checksums = rank_checksums(plan, actor.named_parameters_for_sync(), groups, ENGINE_DTYPE)
        results.append(
            dict(actor_logprobs=logprobs.tolist(), sync_metrics=stats.metrics(), suspects=suspects, checksums=checksums)
        )
    return results


def colocated_main(
    model_dir: str, layout: LayoutPair, backend: str, bucket_mb: float, rounds: int, settings: TrainSettings
) -> list[dict]:
    """One training rank of `run_colocated_check`: every rank owns a TP-1 rollout engine in its own
    process (a colocated deployment; vLLM also needs every rank of an existing world to build its
    groups) and syncs into it in-process. Per round each rank returns what `trainer_main` does plus
    its engine's probe log-probs and loaded checksums after the sync."""
    from megarl.workers.rollout import make_rollout_engine

    groups, actor, dims, plan = trained_actor_and_plan(model_dir, layout, bucket_mb, settings)
    engine = make_rollout_engine(backend, EngineArgs(model_dir, dtype=ENGINE_DTYPE))
    sender = WeightSender(plan, actor.named_parameters_for_sync, groups, InProcessTransport(engine), every_rank=True)
    probe = probe_token_ids(dims.vocab_size)
    results = []
    try:
        for round_index in range(rounds):
            train_a_little(actor, dims.vocab_size, settings, round_index)
            logprobs = actor_probe_logprobs(actor, probe)
            stats = sync_in_process(engine, sender)
            suspects = sender.conversion_errors()
            after = {1: torch.stack(engine.prompt_logprobs(probe)).tolist()}
            results.append(
                dict(
                    actor_logprobs=logprobs.tolist(),
                    sync_metrics=stats.metrics(),
                    suspects=suspects,
                    after=after,
                    checksums=rank_checksums(plan, actor.named_parameters_for_sync(), groups, ENGINE_DTYPE),
                    loaded={1: engine.loaded_checksums()},
                )
            )
    finally:
        engine.shutdown()
    return results


def run_sync_check(
    model_dir: str | Path,
    *,
    train_tp: int,
    train_pp: int,
    train_vpp: int = 1,
    train_ep: int = 1,
    train_etp: int | None = None,
    engines: dict[int, RolloutEngine],
    threshold: float,
    rounds: int = 2,
    bucket_mb: float = 64,
    settings: TrainSettings = TrainSettings(),
    timeout_s: float = 300.0,
) -> list[RoundResult]:
    """Train-and-sync `rounds` times from a (train_tp, train_pp, train_vpp; a mixture of experts's
    train_ep, train_etp) Megatron actor into `engines` (rollout TP → engine, all started from
    `model_dir` in `ENGINE_DTYPE`), over one sync group per engine (the pieces each worker receives
    depend on its engine's TP). The trainer world is the fewest ranks the layout fits (`train_world`).
    Raises `SyncVerificationError` for the first engine that loaded a tensor other than the actor's
    (`WeightChecksumError`) or whose gap exceeds `threshold` (after the training ranks have finished)."""
    model_dir = str(model_dir)
    dims = read_model_dims(model_dir)
    train = LayoutPair(train_tp, train_pp, 1, train_vpp, train_ep=train_ep, train_etp=train_etp)
    senders = train.senders
    # The stores listen before any rank starts: engines joining a store that trainer rank 0 would host
    # only once spawned and past its imports wait out TCPStore's connect backoff (up to a minute a try).
    stores = {tp: listen_weight_sync_store(HOST, senders + tp, timeout_s) for tp in engines}
    ports = {tp: store.port for tp, store in stores.items()}
    probe = probe_token_ids(dims.vocab_size)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-check-sync") as pool:
        trainers = pool.submit(
            run_distributed,
            trainer_main,
            train_world(train),
            model_dir,
            train,
            ports,
            bucket_mb,
            rounds,
            settings,
            timeout_s,
            timeout_s=timeout_s,
        )
        joined = [
            engine.init_weight_sync(HOST, ports[tp], senders + tp, timeout_s, rank_offset=senders)
            for tp, engine in engines.items()
        ]
        wait_for_joins(joined, trainers, timeout_s)
        plans = {tp: build_plan(dims, dataclasses.replace(train, rollout_tp=tp), bucket_mb=bucket_mb) for tp in engines}
        engine_logprobs, loaded = [], []
        for _ in range(rounds):
            with ExitStack() as stack:
                for tp, engine in engines.items():
                    stack.enter_context(receiving(engine, plans[tp], timeout_s))
            engine_logprobs.append({tp: torch.stack(e.prompt_logprobs(probe)).tolist() for tp, e in engines.items()})
            loaded.append({tp: e.loaded_checksums() for tp, e in engines.items()})
        per_rank = trainers.result(timeout=timeout_s)
    return _verified(_merged(per_rank, engine_logprobs, loaded), train, threshold)


def run_colocated_check(
    model_dir: str | Path,
    *,
    train_tp: int,
    train_pp: int,
    train_vpp: int = 1,
    backend: str,
    threshold: float,
    rounds: int = 2,
    bucket_mb: float = 64,
    settings: TrainSettings = TrainSettings(),
    timeout_s: float = 300.0,
) -> list[list[RoundResult]]:
    """Like `run_sync_check`, with one TP-1 rollout engine (`backend` "vllm" or "hf") colocated in
    each training rank's process and the in-process transport. Returns per rank (in rank order)
    its rounds; every rank's engine is checked."""
    per_rank = run_distributed(
        colocated_main,
        train_tp * train_pp,
        str(model_dir),
        LayoutPair(train_tp, train_pp, 1, train_vpp),
        backend,
        bucket_mb,
        rounds,
        settings,
        timeout_s=timeout_s,
    )
    expected = [combine(rank_rounds[i]["checksums"] for rank_rounds in per_rank) for i in range(rounds)]
    for rank_rounds in per_rank:
        for trained, checksums in zip(rank_rounds, expected):
            trained["checksums"] = checksums
    return [_verified(rank_rounds, LayoutPair(train_tp, train_pp, 1, train_vpp), threshold) for rank_rounds in per_rank]


def train_world(layout: LayoutPair) -> int:
    """The fewest trainer ranks `layout` fits: per stage, a multiple of both TP (the dense grid, TP × DP)
    and expert TP × EP (the experts', ETP × EP × expert-DP)."""
    return layout.train_pp * math.lcm(layout.train_tp, layout.expert_tp * layout.train_ep)


def _merged(per_rank: list[list[dict]], engine_logprobs: list[dict], loaded: list[dict]) -> list[dict]:
    """Rank 0's rounds, each with every rank's checksums combined and the engines' side added."""
    rounds = per_rank[0]
    for index, trained in enumerate(rounds):
        trained["checksums"] = combine(rank_rounds[index]["checksums"] for rank_rounds in per_rank)
        trained["after"], trained["loaded"] = engine_logprobs[index], loaded[index]
    return rounds


def _verified(trainer_rounds: list[dict], train: LayoutPair, threshold: float) -> list[RoundResult]:
    """`RoundResult`s of the rounds, each engine checked exactly (`check_checksums`), then by its
    log-prob gap (`check_sync` raises over `threshold`).
    Log-probs arrive from the ranks as nested lists: tensors sent through multiprocessing queues
    are shared by file descriptor, which dangles when the rank exits before the parent reads it."""
    results = []
    for trained in trainer_rounds:
        actor = torch.tensor(trained["actor_logprobs"])
        after = {tp: torch.tensor(logprobs) for tp, logprobs in trained["after"].items()}
        metrics = {}
        for tp, logprobs in after.items():
            layout = dataclasses.replace(train, rollout_tp=tp)
            loaded: list[LoadedChecksums] = trained["loaded"][tp]
            metrics[tp] = check_checksums(
                trained["checksums"], loaded, dtype=ENGINE_DTYPE, layout=layout, engine=f"the rollout TP-{tp} engine"
            )
            metrics[tp] |= check_sync(
                list(logprobs), actor, threshold=threshold, layout=layout, suspects=trained["suspects"]
            )
        results.append(RoundResult(actor, after, metrics, trained["sync_metrics"]))
    return results


def wait_for_joins(joins: list[Future], trainers: Future, timeout_s: float) -> None:
    """Wait for the engines to join the sync group; a trainer failure meanwhile is raised at once."""
    deadline = time.monotonic() + timeout_s
    for join in joins:
        while not join.done():
            if trainers.done():
                trainers.result()  # raises the ranks' failure
                raise RuntimeError("the training ranks finished before the rollout engines joined the sync group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the rollout engines did not join the weight-sync group within {timeout_s:.0f} s")
            wait([join, trainers], timeout=1.0, return_when=FIRST_COMPLETED)
        join.result()
