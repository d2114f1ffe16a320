"""The RL loop: one plain function per step that reads like the algorithm.

    trainer = Trainer.from_config("configs/quickstart.yaml", overrides=["trainer.total_steps=20"])
    trainer.fit()

rollout (`trainer.rollout_mode`: one_step_off generates the next step's batch while this one trains:
`rollout_stream`; async, batches ahead under a staleness bound: `async_stream`) → (engines sleep, Megatron onloads) → the batch staged on the worker groups → rewards →
old/ref log-probs (+ values) → advantages → critic/actor updates → checkpoint → (Megatron offloads,
weight sync verified every `rollout.sync.verify_every` steps, engines wake: `megarl.cluster.handover`) → metrics.
An exactly on-policy update takes the old log-probs from its own forward (`BatchPlan.old_log_prob_pass`).

The worker groups are the loop's `megarl.cluster.protocol.Cluster`: the rollout phase generates on its
engines, and every other call to a group is one of its methods (hand-over, staging, checkpoint save and
load, export, profiling, shutdown). The batch crosses to each worker group once per step (`Cluster.stage`);
the old and reference log-probs stay in the actor's group unless the KL penalty in the reward reads them
here, and the driver sends the groups only what it computes (advantages, returns). The distributed
mechanics live in the worker groups.
"""

from __future__ import annotations

from contextlib import closing, nullcontext
from functools import partial
from pathlib import Path

from transformers import AutoTokenizer

from megarl import interrupt
from megarl.algorithms.advantages import compute_advantages
from megarl.algorithms.dapo import filtered_loss_mask, truncated_samples
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty
from megarl.cluster.protocol import Cluster
from megarl.cluster.ray_node import WORKER_ENV, ray_cpus
from megarl.cluster.running import start_cluster
from megarl.cluster.timing import STARTUP_PHASES, PhaseTimer, startup_line
from megarl.config.batch_plan import plan_batches
from megarl.config.config import Config
from megarl.config.hub import resolve_hub_ids
from megarl.config.problems import ConfigError, Problem
from megarl.config.rollout import response_length
from megarl.config.validate import checked_config
from megarl.data import load_prompts, train_loader
from megarl.models.flops import training_flops
from megarl.models.hf_checkpoint import check_hf_checkpoint
from megarl.models.hf_config import read_model_dims
from megarl.orchestration.cluster import init_ray, shutdown_ray
from megarl.orchestration.search_actor import SearchActor
from megarl.orchestration.worker_group import round_trips
from megarl.rewards.scorer import RewardScorer
from megarl.rollout import AgentLoop, ObservationEncoder, single_turn
from megarl.rollout.carry import CarryOver
from megarl.rollout.multi_turn import TrajectoriesInFlight
from megarl.rollout.partial import RowsInFlight, partial_single_turn
from megarl.tools import ToolSet, parser_for
from megarl.trainer import rollout_batch as rb
from megarl.trainer.async_stream import AsyncRolloutStream
from megarl.trainer.checkpoint_manager import Checkpoint, CheckpointManager
from megarl.trainer.generated import GeneratedBatch
from megarl.trainer.metrics import (
    agent_metrics,
    rollout_metrics,
    throughput_metrics,
    update_mfu_metrics,
    worker_metrics,
)
from megarl.trainer.profile_schedule import profile_request
from megarl.trainer.resume_check import IDENTITY_KEY, resume_problems, run_identity
from megarl.trainer.rollout import RolloutPhase
from megarl.trainer.rollout_stream import RolloutStream
from megarl.trainer.settings import sampling_config, step_seed, stop_token_ids
from megarl.trainer.sinks import METRICS_FILE, JsonlSink, MetricsLogger

ROLLOUTS_FILE = "rollouts.jsonl"
"""In the run directory, multi-turn only: one sample's trajectory every `rollout.multi_turn.log_freq` steps."""


class BadStepsError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for a non-finite loss or gradient."""


def _check_weights(model_path: str) -> None:
    """Raise `ConfigError` naming model.path when its safetensors do not hold the model config.json
    describes (a missing tensor, a wrong shape, an integer dtype): the workers would fail on them only
    after Ray and vLLM started. Reads the safetensors headers only."""
    try:
        check_hf_checkpoint(model_path)
    except (OSError, ValueError, KeyError) as error:  # KeyError: an index file without its weight_map
        raise ConfigError(
            [
                Problem(
                    "model.path",
                    model_path,
                    f"the weights do not match config.json: {error}",
                    "restore the checkpoint's files (or download it again), or point model.path at "
                    "a complete checkpoint",
                )
            ]
        ) from None


class Trainer:
    """GRPO / PPO / DAPO on megatron-core + vLLM + Ray, driven from one process."""

    def __init__(self, config: Config):
        self.config = config = resolve_hub_ids(config)  # workers and tokenizer get directories, never hub ids
        _check_weights(config.model.path)
        self.plan = plan_batches(config)
        self.model_dims = read_model_dims(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(
            config.model.tokenizer_path or config.model.path, trust_remote_code=config.model.trust_remote_code
        )
        self.multi_turn = config.rollout.multi_turn
        tools = self._tool_schemas() if self.multi_turn.enable else None  # for the chat template
        self.loader, self.load_report = train_loader(config.data, self.tokenizer, tools)
        self.val_prompts = (
            load_prompts(config.data.val_files, self.tokenizer, config.data, tools)[0] if config.data.val_files else []
        )
        steps_by_epochs = config.trainer.total_epochs * self.loader.steps_per_epoch
        self.total_steps = min(config.trainer.total_steps or steps_by_epochs, steps_by_epochs)
        self.checkpoints = CheckpointManager(
            config.checkpoint.dir,
            max_keep=config.checkpoint.max_keep,
            parts=tuple(r.role for r in self.plan.own_groups if r.update),
        )
        self.identity = run_identity(config, self.model_dims)
        self.resume_from = self._checked_resume()
        """The intact checkpoint this run continues (None: a fresh run), checked against the config now,
        before any worker starts (`resume_check`)."""
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (
            AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
            if kl.type == "adaptive"
            else FixedKLController(kl.kl_coef)
        )
        self.stop_ids = stop_token_ids(self.tokenizer, config.rollout.stop)
        self.timer = PhaseTimer()
        self.step_in_progress: int | None = None
        """The training step running now (None during start-up)."""
        self.resumed_record: dict[str, float] | None = None
        """The record the resumed checkpoint kept of its step (`MetricsLogger.restore`)."""
        self.resumed_stream: dict | None = None
        """The resumed checkpoint's `RolloutStream.state_dict` (the batch generated ahead)."""
        self.cluster: Cluster | None = None
        """The job's worker groups as the loop drives them (`megarl.cluster.protocol`), once `fit` started them."""
        self.stream: RolloutStream | AsyncRolloutStream | None = None
        """Each step's batch, generated in time (`trainer.rollout_mode`), once the workers run."""
        self.carry: CarryOver | None = None
        """`rollout.over_sampling`: the groups carried from one step's generation into the next, once the workers run."""

    @classmethod
    def from_config(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Trainer:
        """Load and validate a recipe; raises `ConfigError` listing every problem."""
        return cls(checked_config(path, overrides))

    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last step's metrics."""
        startup = PhaseTimer(phases=STARTUP_PHASES)
        with RewardScorer.from_config(self.config.reward) as scorer, self._tool_set() as tools:
            with startup("reward"):
                scorer.wait_ready()  # a reward or tool module that fails to import stops the run here, before Ray starts
                if tools:
                    tools.wait_ready()
            with startup("ray"):
                init_ray(num_cpus=ray_cpus(self.plan), env_vars=WORKER_ENV)
            try:
                if tools:
                    tools.start_shared(SearchActor)
                self.cluster = start_cluster(
                    self.config,
                    self.plan,
                    self.total_steps,
                    WORKER_ENV,
                    startup,
                    timer=self.timer,
                    vocab_size=len(self.tokenizer),
                )
                return self._train(scorer, self._rollout_function(tools), startup)
            finally:
                if self.cluster is not None:
                    self.cluster.shutdown()
                if self.stream is not None:  # after the engines stopped: a generation in flight ends at once
                    self.stream.close()
                shutdown_ray()

    def _tool_schemas(self) -> list[dict]:
        """The tools' schemas for the chat template, read in their isolated workers (no user code runs
        here); a tool that does not resolve stops the run now."""
        with ToolSet(self.multi_turn) as tools:
            tools.wait_ready()
            return tools.schemas()

    def _tool_set(self):
        return ToolSet(self.multi_turn) if self.multi_turn.enable else nullcontext()

    def _rollout_function(self, tools):
        """Single turn, or the agent loop with the run's tools (`megarl.rollout`); with partial rollouts (async
        only, validate) in segments, between which the stream lets weight loads in."""
        segment = self.config.rollout.partial_rollout
        between_segments = (lambda: self.stream.between_segments()) if segment else None
        if self.multi_turn.enable:
            return AgentLoop(
                self.cluster.engines,
                tools,
                parser_for(self.multi_turn.tool_format, tools.schemas()),
                ObservationEncoder(self.tokenizer),
                self._decode_turn,
                self.multi_turn,
                segment=segment,
                between_segments=between_segments,
            )
        if segment:
            return partial(partial_single_turn, self.cluster.engines, segment, between_segments)
        return partial(single_turn, self.cluster.engines)

    def _carry_over(self, exact) -> CarryOver | None:
        """`rollout.over_sampling`: the training rounds' rollout that carries groups between steps (async only),
        of single-turn rows or the agent loop's trajectories (`exact`, the run's rollout function)."""
        rollout = self.config.rollout
        if not rollout.over_sampling:
            return None
        flight = (
            TrajectoriesInFlight(exact)
            if self.multi_turn.enable
            else RowsInFlight(self.cluster.engines, rollout.partial_rollout, lambda: self.stream.between_segments())
        )
        return CarryOver(
            flight,
            exact,
            lambda: self.stream.oldest_allowed_version(),
            lambda: next(self.loader),
            rollout.over_sampling,
        )

    def _train(self, scorer: RewardScorer, rollout, startup: PhaseTimer) -> dict[str, float]:
        mode = self.config.trainer.rollout_mode
        gen_timer = self.timer if mode == "sync" else PhaseTimer()  # the others generate in a thread of their own
        self.carry = self._carry_over(rollout)
        phase = RolloutPhase(
            self.config, rollout, scorer, self._decode, lambda: next(self.loader), gen_timer, self.carry
        )
        start = self._resume(startup)
        generate = partial(self._generate, phase)
        self.stream = (
            AsyncRolloutStream(
                generate,
                gen_timer,
                self.timer,
                max_staleness=self.config.trainer.max_staleness,
                last_step=self.total_steps,
                version=start,
                carried_room=1 if self.carry else 0,
            )
            if mode == "async"
            else RolloutStream(
                generate,
                gen_timer,
                self.timer,
                lookahead=int(mode == "one_step_off"),
                last_step=self.total_steps,
                version=start,
            )
        )
        self.stream.load_state_dict(self.resumed_stream, self.loader.prompts)
        self.peak_flops = self.config.trainer.peak_flops or self._measure_peak(startup)
        print(startup_line(startup.pop()), flush=True)
        metrics, bad_steps = {}, 0
        # The run that saved the checkpoint wrote here (its file exists), unless this resume starts a new run dir.
        continuing = (self.run_dir / METRICS_FILE).exists()
        with (
            MetricsLogger.from_config(self.config, self.plan, self.total_steps, start or None) as logger,
            self._open_rollout_log(start) as self.rollout_log,
        ):
            if start and continuing and self.resumed_record is not None:
                logger.restore(start, self.resumed_record)
            for step in range(start + 1, self.total_steps + 1):
                interrupt.check()
                self.step_in_progress = step
                calls_before = round_trips()
                with self.timer("step"):
                    metrics = self._train_step(step)
                    bad_steps = bad_steps + 1 if metrics.get("actor/skipped_steps") else 0
                    self._maybe_save(step, metrics)  # while the trained state is on the devices
                    metrics |= self.stream.sync(step, self.cluster.to_rollout)
                    if profile_request(self.config.trainer.profile, self.run_dir, step) is not None:  # after its sync
                        self.cluster.stop_profiles()
                    self._maybe_validate(step, phase, metrics)
                metrics |= self.timer.pop() | self.cluster.pop_memory()
                metrics |= throughput_metrics(metrics.pop("_tokens"), metrics["timing/step"])
                metrics["perf/round_trips"] = float(round_trips() - calls_before)
                if "_update_flops" in metrics:
                    metrics |= update_mfu_metrics(
                        metrics.pop("_update_flops"), metrics["timing/update_actor"], self.peak_flops
                    )
                logger.log(step, metrics)
                if bad_steps >= self.config.trainer.max_bad_steps:
                    raise BadStepsError(
                        f"{bad_steps} consecutive steps had a non-finite loss or gradient (trainer.max_bad_steps="
                        f"{self.config.trainer.max_bad_steps}); lower the learning rate or check the data"
                    )
        if self.config.checkpoint.export_hf:
            self.cluster.to_training()
            self.cluster.export_hf(str(self.checkpoints.root))
        return metrics

    def _measure_peak(self, startup: PhaseTimer) -> float:
        """The actor group's matmul peak, FLOP/s: every rank benchmarks at once (ranks sharing a device or
        cores share them as in training), the group's peak is the sum."""
        with startup("matmul_peak"):
            return self.cluster.matmul_peak()

    @property
    def run_dir(self) -> Path:
        return Path(self.config.trainer.output_dir) / self.config.trainer.experiment_name

    def _generate(self, phase: RolloutPhase, step: int, policy_version: int) -> GeneratedBatch:
        """`step`'s samples and rewards (and ReMax's greedy baselines) from the engines as they are."""
        config = self.config
        sampling = sampling_config(config, self.stop_ids, seed=step_seed(config, self.plan, step))
        samples, scores, metrics = phase(sampling, step)
        baselines = phase.greedy_baseline(samples, sampling) if config.algorithm.adv_estimator == "remax" else None
        return GeneratedBatch(samples, scores, metrics, baselines, policy_version)

    def _train_step(self, step: int) -> dict[str, float]:
        config, timer = self.config, self.timer
        generated = self.stream.take(step)
        samples, scores, metrics, baselines = (
            generated.samples,
            generated.scores,
            generated.metrics,
            generated.baselines,
        )
        self.cluster.to_training()  # the engines idle: their side of the hand-over does not wait for a generation
        self.stream.start_next(step)  # one_step_off: the next step's batch, generated while this one trains
        batch = rb.policy_batch(samples, response_length(config.rollout))
        profile = profile_request(config.trainer.profile, self.run_dir, step)  # the ranks start at the staging
        updates = ["update_critic"] * config.critic.enable + ["update_actor"] * (step > config.critic.warmup_steps)
        # The batch crosses to each group once; dropped with the group's last update.
        with self.cluster.stage(batch, profile, updates) as staged:
            if config.reward.reward_model:
                with timer("reward"):
                    rm_scores = staged.gather("compute_rm_scores")
                scores = scores + rm_scores
                metrics["reward/rm_mean"] = rm_scores.mean().item()
            scores_t = rb.token_level_scores(scores, batch.response_mask)
            if self.plan.old_log_prob_pass:  # else the exactly on-policy update takes them from its own forward
                with timer("old_log_prob"):
                    staged.keep("compute_log_prob", "old_log_probs", output=0)  # read by the actor update, there
            if self.plan.ref is not None:
                with timer("ref"):
                    staged.keep("compute_ref_log_prob", "ref_log_probs")
            rewards = scores_t
            if config.algorithm.use_kl_in_reward:
                rewards, kl = apply_kl_penalty(
                    scores_t,
                    staged.fetch("old_log_probs"),
                    staged.fetch("ref_log_probs"),
                    batch.response_mask,
                    self.kl_ctrl.value,
                    config.algorithm.kl_penalty,
                )
                self.kl_ctrl.update(kl.item(), len(batch))
                metrics |= {"actor/reward_kl_penalty": kl.item(), "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
            if config.critic.enable:
                with timer("values"):
                    batch.values = staged.gather("compute_values", keep="values")
            with timer("adv"):
                batch.advantages, batch.returns = compute_advantages(
                    config.algorithm.adv_estimator,
                    rewards,
                    batch.response_mask,
                    index=samples.index,
                    values=batch.values,
                    reward_baselines=baselines,
                    gamma=config.algorithm.gamma,
                    lam=config.algorithm.lam,
                    norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
                )
            if config.algorithm.overlong.filter_truncated:  # DAPO's overlong filtering (after the advantages)
                truncated = truncated_samples(samples.finish_reasons)
                batch.loss_mask = filtered_loss_mask(batch.response_mask, truncated)
                metrics["actor/overlong_filtered"] = truncated.float().mean().item()
            if config.critic.enable:
                with timer("update_critic"):  # the new fields the critic reads travel now: returns
                    metrics |= worker_metrics("critic", staged.update("update_critic", step))
            if step > config.critic.warmup_steps:
                with timer("update_actor"):  # ... and the actor's: advantages
                    metrics |= worker_metrics("actor", staged.update("update_actor", step))
        lengths, prompt_lengths = [len(r) for r in samples.response_ids], [len(p.token_ids) for p in samples.prompts]
        if step > config.critic.warmup_steps:
            metrics["_update_flops"] = config.actor.ppo_epochs * sum(
                training_flops(self.model_dims, p + r) for p, r in zip(prompt_lengths, lengths)
            )
        metrics |= rollout_metrics(scores.tolist(), lengths, response_length(config.rollout), prompt_lengths)
        if self.multi_turn.enable:
            metrics |= agent_metrics(samples.trajectories, samples.loss_masks)
            self._log_trajectory(step, samples, scores)
        metrics["_tokens"] = sum(lengths) + sum(prompt_lengths)
        return metrics

    def _open_rollout_log(self, start: int):
        """rollouts.jsonl (multi-turn), its records after `start` dropped on resume, as metrics.jsonl's."""
        if not self.multi_turn.enable:
            return nullcontext()
        return closing(JsonlSink(self.run_dir / ROLLOUTS_FILE, start or None))

    def _log_trajectory(self, step: int, samples, scores) -> None:
        """The first sample's whole trajectory to rollouts.jsonl, every `multi_turn.log_freq` steps."""
        freq = self.multi_turn.log_freq
        if not freq or step % freq:
            return
        trajectory = samples.trajectories[0]
        self.rollout_log.log(
            step,
            {
                "prompt": samples.prompts[0].text,
                "messages": trajectory.messages,
                "ended": trajectory.ended,
                "reward": scores[0].item(),
            },
        )

    def _maybe_validate(self, step: int, phase: RolloutPhase, metrics: dict) -> None:
        freq = self.config.trainer.test_freq
        if not self.val_prompts or not freq or (step % freq and step != self.total_steps):
            return
        with self.timer("validation"), self.stream.paused():  # async: the engines are validation's meanwhile
            sampling = sampling_config(self.config, self.stop_ids, seed=self.config.rollout.seed, validation=True)
            metrics |= phase.validation(self.val_prompts, sampling, self.config.data.val_batch_size)

    def _maybe_save(self, step: int, metrics: dict[str, float]) -> None:
        """`metrics`: the step's so far, kept in the checkpoint as its record in case the run stops before
        logging it (`MetricsLogger.restore`)."""
        freq = self.config.checkpoint.save_freq  # 0: at the end only
        if step != self.total_steps and (not freq or step % freq):
            return
        with self.timer("checkpoint"):
            self.stream.settle()  # the batch generated ahead, and the data position after it, belong to the checkpoint
            record = {name: value for name, value in metrics.items() if not name.startswith("_")}
            extra = {
                "step": step,
                "data": self.loader.state_dict(),
                "kl_coef": self.kl_ctrl.value,
                "record": record,
                "stream": self.stream.state_dict(self.loader.prompts) | self._carried_state(),
                IDENTITY_KEY: self.identity,
            }
            self.cluster.save(str(self.checkpoints.root), step, extra)
            self.checkpoints.rotate()

    def _carried_state(self) -> dict:
        """`rollout.over_sampling`: what a checkpoint loses of the carried generation (its data position is
        after the prompts pulled for it): the groups in flight and the prompts not started yet."""
        if self.carry is None:
            return {}
        return {"carried_lost": {"groups": self.carry.carried_groups(), "prompts": len(self.carry.spare)}}

    def _checked_resume(self) -> Checkpoint | None:
        """`checkpoint.resume` resolved to an intact checkpoint (CheckpointError naming the damage), which
        must be able to continue this run (ConfigError naming what changed); warnings printed."""
        checkpoint = self.checkpoints.resolve_resume(self.config.checkpoint.resume)
        if checkpoint is None:
            return None
        problems, warnings = resume_problems(self.identity, self.plan, checkpoint.path)
        if problems:
            raise ConfigError(problems)
        for warning in warnings:
            print(warning, flush=True)
        return checkpoint

    def _resume(self, startup: PhaseTimer) -> int:
        """The step to continue after (0 for a fresh run)."""
        checkpoint = self.resume_from
        if checkpoint is None:
            return 0
        with startup("resume"):
            self.cluster.to_training()
            extra = self.cluster.load(str(checkpoint.path))
            self.loader.load_state_dict(extra["data"])
            self.kl_ctrl.value = extra["kl_coef"]
            self.resumed_record = extra.get("record")  # checkpoints before it was kept have none
            self.resumed_stream = extra.get("stream")  # nor the stream's, before one_step_off
            self.cluster.to_rollout(extra["step"])  # the engines start from the restored weights
        self.timer.pop()  # the resume's hand-over times and memory are not the first step's
        self.cluster.pop_memory()
        return extra["step"]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _decode_turn(self, token_ids: list[int]) -> str:
        """A model turn as the tool-call parser reads it (tool-call tags may be special tokens)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)
