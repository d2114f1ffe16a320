"""A plain transformers `generate` rollout engine, for debugging and as a reference for vLLM.

Same contract as the vLLM engine (token ids, log-probs under the sampling distribution, finish
reasons; see base.py), slower: prompts are generated one at a time (so no padding is involved), the
`n` samples of a prompt together. The engine is one process and one rank of a weight-sync group.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from megarl.bridge import (
    CollectivePlan,
    InProcessTensors,
    LoadedChecksums,
    SharedRings,
    create_weight_sync_group,
    rank_tensors_as_hf,
    read_ring,
    receive_rank_shards,
    recorded,
)
from megarl.workers.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig, call_seed, done, prompt_seeds


def _generation_config(sampling: SamplingConfig, max_new_tokens: int) -> GenerationConfig:
    # A fresh config, so the checkpoint's generation_config.json (top_k=50, penalties, ...) is not
    # mixed in; `scores` are then exactly the distribution sampled from.
    return GenerationConfig(
        do_sample=not sampling.greedy,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min(sampling.min_new_tokens, max_new_tokens),
        num_return_sequences=sampling.n,
        eos_token_id=list(sampling.stop_token_ids) or None,
        pad_token_id=0,  # fills finished rows; they are cut at their stop token below
        output_scores=True,
        return_dict_in_generate=True,
    )


def _cut_at_stop(tokens: list[int], stop_token_ids: tuple[int, ...]) -> tuple[list[int], str]:
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


_ROUTER_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.gate")
"""A mixture-of-experts layer's router in transformers' modelling (Qwen3-MoE's `Qwen3MoeTopKRouter`, whose
forward returns `(logits, weights, top-k indices [tokens, k])`)."""


_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
"""A checkpoint's per-expert tensor, which transformers 5 keeps fused in the loaded model."""


def _parameter_of(params: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """Where the checkpoint tensor `name` lives in the loaded model: its own parameter, or for a mixture of
    experts' per-expert tensor (`...mlp.experts.{e}.gate_proj.weight`, the checkpoint's layout) its slice of
    the fused ones transformers builds (Qwen3-MoE's `Qwen3MoeExperts`: `gate_up_proj [E, 2f, h]`, gate rows
    first, and `down_proj [E, h, f]`); None when the model has neither."""
    if name in params:
        return params[name]
    expert = _EXPERT_NAME.fullmatch(name)
    if expert is None:
        return None
    prefix, index, part = expert[1], int(expert[2]), expert[3]
    if part == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None else fused[index]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    gate, up = fused[index].chunk(2, dim=0)
    return gate if part == "gate_proj" else up


class HFRolloutEngine(RolloutEngine):
    """`RolloutEngine` on a transformers causal LM. dtype: "auto" (the checkpoint's) or a torch
    dtype name such as "float32"; device: where the model runs ("cpu", "cuda:0");
    return_routed_experts: a mixture of experts' `RolloutOutput.routed_experts`, what its routers chose
    in the very forward passes of the generation (the prompt's prefill, then one token per step)."""

    backend = "hf"

    def __init__(
        self, model_path: str | Path, *, dtype: str = "auto", device: str = "cpu", return_routed_experts: bool = False
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        self._model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self._model.to(self._device).eval()
        # generate fills what a call's config leaves None from the model's own (transformers 5.19
        # `_prepare_generation_config`): the checkpoint's eos_token_id would stop samples that no stop token ends.
        self._model.generation_config = GenerationConfig()
        routers = {
            int(m[1]): module for name, module in self._model.named_modules() if (m := _ROUTER_NAME.fullmatch(name))
        }
        if return_routed_experts and not routers:
            raise ValueError(
                f"HFRolloutEngine: return_routed_experts needs a mixture-of-experts model; {model_path} has no "
                "router (model.layers.<i>.mlp.gate)"
            )
        self._routers = [routers[i] for i in sorted(routers)] if return_routed_experts else []
        self._rpc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-hf-sync")
        self._sync_group = None
        self._loaded: LoadedChecksums | None = None

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new_tokens: Sequence[int] | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[RolloutOutput]:
        self._check_ready("generate")
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompt_token_ids)
        outputs = []
        with torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else []):
            if (shared := call_seed(sampling, seeds)) is not None:  # the call's samples draw in sequence
                torch.manual_seed(shared)
            for prompt, cap, seed in zip(prompt_token_ids, caps, prompt_seeds(sampling, len(caps), seeds), strict=True):
                if seed is not None:  # per prompt: its samples do not depend on the prompts before it
                    torch.manual_seed(seed)
                outputs.append(self._generate_one(list(prompt), _generation_config(sampling, cap), sampling))
        return outputs

    def _generate_one(self, prompt: list[int], config: GenerationConfig, sampling: SamplingConfig) -> RolloutOutput:
        input_ids = torch.tensor([prompt], device=self._device)
        with self._routing(sampling.n) as routed:
            # Every context token is real: without a mask, generate takes each pad-id token (0, which models
            # may also sample) for padding and hides it, as a continued segment or turn would show.
            result = self._model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        responses = result.sequences[:, len(prompt) :]  # [n, T]
        # scores[t]: [n, V] processed logits of step t (temperature, top-k/p applied).
        logprobs = torch.stack(result.scores, dim=1).float().log_softmax(-1)  # [n, T, V]
        token_logprobs = logprobs.gather(-1, responses.unsqueeze(-1)).squeeze(-1).cpu()  # [n, T]
        output = RolloutOutput(prompt_token_ids=prompt)
        for i, row in enumerate(responses.tolist()):
            tokens, reason = _cut_at_stop(row, sampling.stop_token_ids)
            output.response_token_ids.append(tokens)
            output.response_logprobs.append(token_logprobs[i, : len(tokens)].clone())
            output.finish_reasons.append(reason)
            if self._routers:  # every token fed to the model: the prompt, then the response but its last
                output.routed_experts.append(routed[0][i, : len(prompt) + len(tokens) - 1].clone())
        return output

    @contextlib.contextmanager
    def _routing(self, rows: int) -> Iterator[list[torch.Tensor]]:
        """Inside, the routers' choices are recorded; on exit the yielded list holds `[rows, tokens fed, L, k]`
        int16 (each forward feeds `[rows, s]` tokens: the prefill, then one per step). It stays empty
        without `return_routed_experts`."""
        routed: list[torch.Tensor] = []
        steps: list[list[torch.Tensor]] = [[] for _ in self._routers]

        def record(layer: int):
            def hook(module, inputs, outputs) -> None:
                indices = outputs[-1]  # [rows * s, k]
                steps[layer].append(indices.view(rows, -1, indices.shape[-1]).to("cpu", torch.int16))

            return hook

        hooks = [router.register_forward_hook(record(layer)) for layer, router in enumerate(self._routers)]
        try:
            yield routed
        finally:
            for hook in hooks:
                hook.remove()
        if self._routers:
            routed.append(torch.stack([torch.cat(layer, dim=1) for layer in steps], dim=2))

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self._check_ready("prompt_logprobs")
        results = []
        for ids in token_ids:
            input_ids = torch.tensor([list(ids)], device=self._device)
            logprobs = self._model(input_ids).logits[0, :-1].float().log_softmax(-1)  # [T-1, V]
            results.append(logprobs.gather(-1, input_ids[0, 1:, None]).squeeze(-1).cpu())
        return results

    def _load_named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Any subset of the model's HF-named tensors, copied in as they come (a stream is held one
        tensor at a time); a name the model lacks, or a shape it does not have, is an error. Each is
        checksummed as it comes (`loaded_checksums`) unless `checksum_loads(False)`."""
        params = self._model.state_dict(keep_vars=True)
        self._loaded = LoadedChecksums(str(self._model.dtype).removeprefix("torch.")) if self._checksum_loads else None
        if self._loaded is not None:
            named_tensors = recorded(named_tensors, self._loaded)
        unknown = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = _parameter_of(params, name)
                if target is None:
                    unknown.append(name)
                elif target.shape != tensor.shape:
                    raise ValueError(
                        f"HFRolloutEngine.receive: {name!r} is {tuple(target.shape)} in the model, "
                        f"the sender's is {tuple(tensor.shape)}"
                    )
                else:
                    target.copy_(tensor)
        if unknown:
            raise ValueError(
                f"HFRolloutEngine.receive: the model has no parameters named {unknown}; send HF checkpoint names"
            )
        self._weight_version += 1

    def loaded_checksums(self) -> list[LoadedChecksums]:
        """What the last sync loaded, checksummed as it came (`megarl.bridge.checksum`); one worker."""
        if self._loaded is None:
            raise RuntimeError(
                "loaded_checksums: no checksums of the last load (no load since the engine started, "
                "or one made with checksum_loads(False))"
            )
        return [self._loaded]

    def init_weight_sync(
        self, host: str, port: int, world_size: int, timeout_s: float, rank_offset: int = 1
    ) -> Future[None]:
        def join() -> None:
            self._sync_group = create_weight_sync_group(host, port, rank_offset, world_size, timeout_s)

        return self._rpc_thread.submit(join)

    def _load_tensors(self, source: InProcessTensors) -> Future[None]:
        self._load_named(source.named_tensors)
        return done()

    def _load_shared_rings(self, source: SharedRings) -> Future[None]:
        if sorted(source.rings) != [0]:
            raise ValueError(
                f"shared sync: got rings for TP ranks {sorted(source.rings)}, the HF engine has TP rank 0 only"
            )
        return self._rpc_thread.submit(read_ring, source.rings[0], "HF rollout engine", self._device, self._load_named)

    def _receive_collective(self, source: CollectivePlan) -> Future[None]:
        def receive() -> None:
            if self._sync_group is None:
                raise RuntimeError("HFRolloutEngine.receive(CollectivePlan) before init_weight_sync")
            # One worker (rollout TP 1): its own tensors are the whole HF tensors.
            tensors = receive_rank_shards(self._sync_group, source.plan, 0, self._device)
            self._load_named(rank_tensors_as_hf(source.plan, tensors))

        return self._rpc_thread.submit(receive)

    # No per-rank load (capabilities: per_rank_load=False): its TP rank holds whole tensors.
    _loaders: ClassVar[dict] = {
        InProcessTensors: _load_tensors,
        SharedRings: _load_shared_rings,
        CollectivePlan: _receive_collective,
    }

    def reset_prefix_cache(self) -> None:
        """Nothing to do: this engine keeps no KV cache between calls."""

    def _sleep(self) -> None:
        self._model.to("cpu")

    def _wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:  # no KV cache is kept between calls
            self._model.to(self._device)

    def shutdown(self) -> None:
        self._rpc_thread.shutdown(wait=True)
        del self._model
