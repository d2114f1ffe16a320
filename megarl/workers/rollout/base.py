"""The rollout-engine contract: token ids in; token ids, log-probs and finish reasons out.

Backends (`vllm_engine.VLLMRolloutEngine`, `hf_engine.HFRolloutEngine`) implement `RolloutEngine`;
the trainer and the weight-sync bridge talk only to this interface.

Log-prob semantics (the same in every backend). The log-prob of a sampled token is taken under the
distribution the engine sampled it from: `log_softmax(logits / temperature)`, after top-k / top-p
truncation when those are on (truncated tokens have probability 0 and the rest renormalise). With
top-k and top-p off, the RL training setting, that is exactly what the actor recomputes
(`log_softmax(logits / T)`), so the two can be compared token by token; with them on, it is still the
true behaviour-policy probability, which is what importance ratios need. Greedy decoding has no
temperature: its log-probs are `log_softmax(logits)`. `prompt_logprobs` is always temperature 1.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from megarl.bridge import CollectivePlan, InProcessTensors, RankRings, SharedRings, WeightSource
from megarl.config.engines import ENGINES, EngineCapabilities, engine_capabilities
from megarl.workers.memory_stats import memory_stats

FinishReason = Literal["stop", "length"]
SLEEP_TAGS = ("weights", "kv_cache")
"""The parts of a sleeping engine's memory that `RolloutEngine.wake_up` brings back, one at a time or
together (vLLM's own tags: `LLM.wake_up(tags)`, vllm/v1/executor/abstract.py `SLEEP_TAGS`)."""


class RolloutPausedError(RuntimeError):
    """`generate` or `prompt_logprobs` was called on a paused or sleeping engine."""


class WeightSourceRefused(TypeError):
    """`RolloutEngine.receive` was given a weight source the engine cannot take."""


SOURCE_KINDS: tuple[type, ...] = (InProcessTensors, SharedRings, RankRings, CollectivePlan)
"""Every kind of `megarl.bridge.WeightSource`."""
SOURCE_NEEDS: dict[type, tuple[str, str]] = {
    RankRings: ("per_rank_load", "set rollout.sync.per_rank: never, so the rings carry gathered HF buckets")
}
"""The source kinds only some engines take: the `EngineCapabilities` field that says an engine takes it,
and the setting that avoids it. Every engine takes the other kinds."""


def done() -> Future[None]:
    """The future of a load that has completed (an in-process source's)."""
    future: Future[None] = Future()
    future.set_result(None)
    return future


def check_loaders(engine: str, backend: str, loaders: Mapping[type, object]) -> None:
    """An engine class's loaders are exactly the source kinds its capabilities declare (`SOURCE_NEEDS`):
    a class that lacks one, or has one its row of `megarl.config.engines.ENGINES` does not declare, is
    refused where it is defined."""
    capabilities = engine_capabilities(backend)
    declared = {
        kind for kind in SOURCE_KINDS if kind not in SOURCE_NEEDS or getattr(capabilities, SOURCE_NEEDS[kind][0])
    }
    if set(loaders) != declared:
        raise TypeError(
            f"{engine} (rollout backend {backend!r}) loads {sorted(k.__name__ for k in loaders)}, its capabilities "
            f"in megarl/config/engines.py declare {sorted(k.__name__ for k in declared)}: give it a loader per "
            "declared kind (`_loaders`) or correct its capabilities"
        )


def refusal(engine: str, backend: str, source: object) -> str:
    """Why an engine refuses `source`, and the fix."""
    kind = type(source)
    if kind not in SOURCE_NEEDS:  # every engine loads the other kinds (`check_loaders`)
        return (
            f"{engine}.receive: {kind.__name__} is not a weight source; pass one of "
            f"{[k.__name__ for k in SOURCE_KINDS]} (megarl.bridge)"
        )
    need, avoid = SOURCE_NEEDS[kind]
    able = sorted(name for name, capabilities in ENGINES.items() if getattr(capabilities, need))
    return (
        f"{engine} (rollout backend {backend!r}) cannot receive {kind.__name__}: its capabilities "
        f"(megarl/config/engines.py) have {need}=False; {avoid}, or use a rollout backend with {need} ({able})"
    )


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses. Validated on construction; every problem is reported at once."""

    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Softmax temperature, > 0. Ignored when `greedy`. Log-probs are taken at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 turns it off (the setting for RL training)."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 turns it off (the setting for RL training)."""
    max_new_tokens: int = 256
    """Response length cap; a sample that reaches it ends with finish reason "length"."""
    min_new_tokens: int = 0
    """No stop token ends a sample before this many tokens (a cap below it wins). Log-probs stay the
    model's own (vLLM reports raw log-probs; HF's scores are processed, so renormalised over the
    tokens still allowed)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample (finish reason "stop"); the stop token is kept as the sample's last
    token so the policy learns to emit it. Nothing else stops generation: the model's EOS stops it
    only if listed here (the trainer passes the tokenizer's EOS and chat end-of-turn ids)."""
    seed: int | None = None
    """Seed of this call's sampling; the same seed, prompts and weights give the same samples.
    None draws fresh randomness. vLLM derives one seed per sample from it (`seed + i * n + j` for
    sample j of prompt i): give successive calls seeds at least `len(prompts) * n` apart."""
    seed_each_sample: bool = True
    """With a `seed`: True gives every sample a generator of its own (the seeds above), so a sample
    does not depend on which other prompts share the call or the engine. False reseeds the engine's one
    generator with the call's first seed before the call and lets the samples draw from it together:
    the same call (prompts in the same order, seed, weights) on the same engine gives the same samples,
    without the per-sample draws vLLM makes one request at a time (`rollout.seed_each_sample`)."""
    greedy: bool = False
    """Argmax decoding (validation); needs n == 1. Log-probs are then `log_softmax(logits)`."""

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n}: need at least 1 sample per prompt")
        if self.greedy and self.n != 1:
            problems.append(f"n={self.n} with greedy=True: greedy samples are identical; set n=1")
        if not self.greedy and not self.temperature > 0:
            problems.append(f"temperature={self.temperature}: must be > 0; set greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p}: must be in (0, 1]; 1 turns it off")
        if self.top_k != -1 and self.top_k < 1:
            problems.append(f"top_k={self.top_k}: must be >= 1, or -1 to turn it off")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(
                f"min_new_tokens={self.min_new_tokens}: must lie in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids}: token ids are >= 0")
        if problems:
            raise ValueError("invalid SamplingConfig:\n  " + "\n  ".join(problems))


def prompt_seeds(sampling: SamplingConfig, count: int, seeds: Sequence[int] | None) -> list[int | None]:
    """The seed of each of `count` prompts of a `generate` call: `seeds` when given, else spaced `n` apart
    from `sampling.seed` (sample j of a prompt takes its seed + j: every sample of the call gets its own
    noise; one shared seed would correlate the prompts' samples). All None when `sampling.seed` is, or
    when `sampling.seed_each_sample` is off (`call_seed` seeds the call instead)."""
    if sampling.seed is None or not sampling.seed_each_sample:
        return [None] * count
    return list(seeds) if seeds is not None else [sampling.seed + i * sampling.n for i in range(count)]


def call_seed(sampling: SamplingConfig, seeds: Sequence[int] | None) -> int | None:
    """The seed an engine reseeds its one generator with before a `generate` call: the call's first
    seed (`seeds[0]` when given, else `sampling.seed`) when `sampling.seed_each_sample` is off; None
    when the prompts carry their own seeds (`prompt_seeds`) or the call is unseeded."""
    if sampling.seed is None or sampling.seed_each_sample:
        return None
    return sampling.seed if seeds is None else (seeds[0] if seeds else None)


@dataclass
class RolloutOutput:
    """The `n` samples of one prompt. Sample `i` is `response_token_ids[i]` (`T_i` tokens, the stop
    token included when it ended the sample), its log-probs `response_logprobs[i]` (`[T_i]`, float32)
    and `finish_reasons[i]`."""

    prompt_token_ids: list[int]
    """The prompt, as given."""
    response_token_ids: list[list[int]] = field(default_factory=list)
    """n lists of generated token ids."""
    response_logprobs: list[torch.Tensor] = field(default_factory=list)
    """n float32 tensors `[T_i]`: log-prob of each sampled token (see the module docstring)."""
    finish_reasons: list[FinishReason] = field(default_factory=list)
    """n reasons: "stop" (a stop token was sampled) or "length" (`max_new_tokens` reached)."""
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """n int16 tensors `[len(prompt) + T_i - 1, L, k]` when the engine was asked for them
    (`return_routed_experts`): the top-k experts each token of the prompt and the response was routed to in
    each of the model's `L` layers, as the engine computed while generating (the last sampled token is never
    fed back, so it has none); empty otherwise."""


class RolloutEngine(abc.ABC):
    """A generation engine whose weights the trainer replaces after every step.

    One engine serves one process's calls, one at a time. A weight sync over the sync group, as the
    trainer does it (`megarl.bridge.ShardSender` is the trainer side):

        joined = engine.init_weight_sync(host, port, world_size=S + TP, timeout_s=60, rank_offset=S)  # once
        # meanwhile the S sending trainer ranks join: create_weight_sync_group(host, port, rank, S + TP, 60)
        joined.result()
        ...
        engine.pause()                                  # each sync
        done = engine.receive(CollectivePlan(plan))     # the workers receive every sender's pieces...
        # ...as each trainer rank runs ShardSender(plan, ...).send()
        done.result()  # loaded, prefix cache flushed, weight_version + 1
        engine.resume()

    The other ways in are the other weight sources (`megarl.bridge.WeightSource`): tensors in this process,
    the shared rings of senders on the node, per-rank rings. A backend names its row of
    `megarl.config.engines.ENGINES` (`backend`) and maps each source kind it takes to its private loader
    (`_loaders`); `receive` is the one entry point, and the class is checked against its capabilities
    when it is defined (`SOURCE_NEEDS`).
    """

    backend: ClassVar[str]
    """The engine's row in `megarl.config.engines.ENGINES`, whose capabilities it declares."""
    _loaders: ClassVar[Mapping[type, Callable[[Any, Any], Future[None]]]]
    """Weight-source kind -> the engine's private loader of it, `loader(engine, source)`: returns at once
    (an in-process source: once loaded); the future completes when the weights are loaded, the prefix
    cache is flushed and `weight_version` is bumped."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "backend" in cls.__dict__:
            check_loaders(cls.__name__, cls.backend, cls._loaders)

    def __init__(self) -> None:
        self._paused = False
        self._asleep: set[str] = set()
        """The `SLEEP_TAGS` of the memory that is freed now."""
        self._checksum_loads = True
        """`checksum_loads`: the first sync of a run is always verified."""
        self._weight_version = 0

    @property
    def weight_version(self) -> int:
        """0 for the weights the engine started with; +1 per completed weight load."""
        return self._weight_version

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine can do (`megarl.config.engines`)."""
        return engine_capabilities(self.backend)

    def receive(self, source: WeightSource) -> Future[None]:
        """Load one sync from `source` (`megarl.bridge.WeightSource`: `InProcessTensors`, `SharedRings`,
        `RankRings`, `CollectivePlan`). Any subset of the model's tensors may come, provided every fused
        layer touched gets all its parts within the one sync; the rest keep their weights. Returns at once
        (an in-process source: once loaded, since the caller's thread produces its stream); the future
        completes when the weights are loaded, the prefix cache is flushed and `weight_version` is bumped.
        A kind the engine cannot take is refused (`WeightSourceRefused`), naming the fix."""
        loader = self._loaders.get(type(source))
        if loader is None:
            raise WeightSourceRefused(refusal(type(self).__name__, self.backend, source))
        return loader(self, source)

    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Refuse `generate`/`prompt_logprobs` (they raise `RolloutPausedError`) until `resume()`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def sleep(self) -> None:
        """Free accelerator memory (KV cache, and the weights: kept on the host or dropped, by the
        backend's sleep level) while a colocated trainer runs; generating raises `RolloutPausedError`
        until every part is awake again (`wake_up`)."""
        self._sleep()
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo `sleep()` for the memory `tags` name (`SLEEP_TAGS`; None: all). The hand-over wakes
        "weights" before the weight sync, which loads into them, and "kv_cache" once the trainer has
        offloaded, so the two are never on the device beside the trainer's full state."""
        tags = list(SLEEP_TAGS if tags is None else tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"{type(self).__name__}.wake_up: unknown tags {unknown}; use some of {list(SLEEP_TAGS)}")
        self._wake_up(tags)
        self._asleep -= set(tags)

    def memory_stats(self) -> dict[str, float]:
        """The engine's memory now, in GiB by stat (`megarl.workers.memory_stats`): this process's, where
        the engine computes in it or in processes it started (their RSS is counted on CPU)."""
        return memory_stats()

    def checksum_loads(self, enabled: bool) -> None:
        """Whether the next weight loads checksum every tensor they receive (`loaded_checksums`, the
        exact check of a verified sync: `WeightSync.verifies`); an unchecked load forgets the last
        checksums, so they cannot be taken for its own."""
        self._checksum_loads = enabled

    def _check_ready(self, call: str) -> None:
        # A paused/sleeping vLLM engine would queue the requests and never answer: fail instead.
        if self._paused:
            raise RolloutPausedError(
                f"{type(self).__name__}.{call}() called while the engine is paused "
                f"(a weight sync is in progress or pause() was not undone): call resume() first"
            )
        if self._asleep:
            raise RolloutPausedError(
                f"{type(self).__name__}.{call}() called while the engine's {sorted(self._asleep)} sleep: "
                "call wake_up() first"
            )

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new_tokens: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutOutput]:
        """Sample `sampling.n` responses for each prompt; one `RolloutOutput` per prompt, in order.
        `max_new_tokens`: a cap per prompt (>= 1) instead of `sampling.max_new_tokens` (an agent loop's
        trajectories have different budgets left). `seeds`: a seed per prompt instead of
        `sampling.seed + i·n` (sample j of prompt i: `seeds[i] + j`; an agent loop's batch mixes turns
        of different trajectories; with `sampling.seed_each_sample` off, `seeds[0]` seeds the call);
        ignored when `sampling.seed` is None."""

    @abc.abstractmethod
    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each sequence of `T_i` tokens, `[T_i - 1]` float32: log p(token t | tokens < t) for
        t = 1 .. T_i - 1 at temperature 1 (used to verify a weight sync against the actor)."""

    @abc.abstractmethod
    def init_weight_sync(
        self, host: str, port: int, world_size: int, timeout_s: float, rank_offset: int = 1
    ) -> Future[None]:
        """Join the trainer's weight-sync group (`sync_group.create_weight_sync_group`) over the store
        listening at host:port (`listen_weight_sync_store`): the trainer's sending ranks come first, this
        engine's workers take ranks `rank_offset .. rank_offset + TP - 1` (`bridge.receiver_rank`). Returns at once;
        the future completes when the group is formed, which needs every other rank to join
        concurrently."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV (it was computed with the old weights)."""

    @abc.abstractmethod
    def _sleep(self) -> None:
        """Backend part of `sleep()`."""

    @abc.abstractmethod
    def _wake_up(self, tags: list[str]) -> None:
        """Backend part of `wake_up(tags)`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the engine's processes and memory; the engine is unusable afterwards."""
