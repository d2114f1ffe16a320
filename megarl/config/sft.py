"""The recipe of `megarl sft`: a short supervised warm-up of a model on demonstration conversations.

    config = load_sft_config("configs/sft_tiny.yaml", ["train.total_steps=20"])   # raises ConfigError
    problems = validate_sft(config)                                                # list[Problem]

Loaded by the same loader as `megarl train` recipes (unknown keys with a "did you mean", wrong types,
`key.sub=value` overrides); `model`, `parallel` and `optim` are the sections an RL recipe has (the
actor's `parallel` and `optim`), so a setting means the same in both. The data-parallel size is
derived: train.gpus ÷ (TP × PP).
"""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megarl.config.hub import cached_snapshot, is_hub_id, missing_from_cache
from megarl.config.layout_checks import check_context_parallel_model, check_megatron_layout
from megarl.config.loader import load_config
from megarl.config.model_facts import ModelFactsError, load_model_dims
from megarl.config.problems import Problem
from megarl.config.resources import data_file_problems, local_path, writable_dir_problem
from megarl.config.role_checks import (
    check_context_parallel,
    check_cpu_offload,
    check_expert_grid,
    check_interleaved_micro_batches,
    check_optimizer,
    check_sequence_parallel,
    check_virtual_pipeline,
)
from megarl.config.roles import OptimizerConfig, ParallelConfig
from megarl.config.run_checks import MAX_SEED
from megarl.config.sections import ModelConfig
from megarl.config.tokenizer_files import tokenizer_problems

SFT_MARKER = ".megarl-sft.json"
"""The file a `megarl sft` export leaves in train.output_dir: the names it wrote there (see SftTrainConfig.overwrite)."""


@dataclass(frozen=True)
class SftDataConfig:
    """The demonstrations: JSONL (or Parquet) rows `{"messages": [...], "tools": [...]}` (megarl.data.sft)."""

    train_files: tuple[str, ...] = ()
    """Required. Conversation files (.jsonl or .parquet), read in order."""
    max_length: int = 1024
    """Longest conversation in tokens, as the chat template renders it. >= 2."""
    truncate: bool = False
    """false: a longer conversation is an error naming its file and line; true: keep its first max_length tokens."""
    shuffle: bool = True
    """Shuffle the conversations each epoch (by train.seed + epoch)."""


@dataclass(frozen=True)
class SftTrainConfig:
    """The loop: batch sizes, length, devices, seed, and where the trained model goes."""

    batch_size: int = 8
    """Conversations per optimizer step, across all data-parallel ranks. Must be a multiple of the DP size."""
    micro_batch_size_per_gpu: int = 1
    """Conversations per forward/backward pass on one rank; must divide batch_size ÷ DP. The loss (mean
    negative log-likelihood of the assistant tokens of the whole step) does not depend on it."""
    epochs: int = 1
    """Passes over the conversations. >= 1."""
    total_steps: int | None = None
    """Stop after this many optimizer steps even mid-epoch (whichever of the two limits comes first)."""
    gpus: int = 1
    """Processes of the Megatron world, one per GPU (on CPU: one per slot). DP = gpus ÷ (TP × PP)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the ranks compute: auto (CUDA when the Ray cluster has GPUs), cpu or cuda; as trainer.device."""
    seed: int = 0
    """Seed of the model-parallel RNG streams and of the data order, in [0, 2**63 - 1]."""
    output_dir: str = ""
    """Required. Where the trained model is written as an HF checkpoint directory (weights, config.json,
    tokenizer), usable as the model.path of a `megarl train` recipe. Written atomically: it appears complete
    or not at all."""
    overwrite: bool = False
    """Replace an output_dir that an earlier `megarl sft` wrote (its `SFT_MARKER` lists the files it wrote);
    a directory holding anything else (user files, this run's data) is refused all the same. false: an
    output_dir that holds files is refused before anything runs."""


@dataclass(frozen=True)
class SftConfig:
    """A `megarl sft` job. Defaults live here; a recipe states what differs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (an HF checkpoint with its tokenizer: `tokenizer_path` must stay unset, the export
    carries model.path's tokenizer files) and the dtype it trains in."""
    data: SftDataConfig = field(default_factory=SftDataConfig)
    """The demonstration conversations."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline-parallel layout (as actor.parallel of an RL recipe)."""
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule (as actor.optim, same defaults: set `lr` for SFT, which usually
    wants a larger one than RL); the decay spans all optimizer steps."""
    train: SftTrainConfig = field(default_factory=SftTrainConfig)
    """Batch sizes, length, devices and output."""


def load_sft_config(path: str | Path, overrides: Sequence[str] = ()) -> SftConfig:
    """Read an SFT recipe with `key.sub=value` overrides; `ConfigError` lists every unknown key and wrong type."""
    return load_config(path, overrides, schema=SftConfig)


def data_parallel_size(config: SftConfig) -> int:
    """DP = train.gpus ÷ (TP × CP × PP) (validated to divide)."""
    parallel = config.parallel
    return config.train.gpus // (
        parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.pipeline_model_parallel_size
    )


def local_dir(path: str) -> str:
    """A checkpoint setting as a local directory: a hub id's snapshot in the local HF cache (validated to be there)."""
    if is_hub_id(path):
        snapshot = cached_snapshot(path)
        return str(snapshot) if snapshot is not None else path
    return path


def validate_sft(config: SftConfig, check_files: bool = True) -> list[Problem]:
    """Every problem of `config`, each naming the key, value, why and fix; empty when it can run. Nothing
    starts and nothing is written; with `check_files` the model, tokenizer, data files and output_dir are
    looked at."""
    problems: list[Problem] = []

    def need(ok: bool, key: str, value, why: str, fix: str) -> None:
        if not ok:
            problems.append(Problem(key, value, why, fix))

    model, data, train, parallel = config.model, config.data, config.train, config.parallel
    need(
        not model.trust_remote_code,
        "model.trust_remote_code",
        True,
        "megarl builds models from config.json and never runs code shipped with a checkpoint",
        "set model.trust_remote_code=false and use a supported architecture",
    )
    need(
        model.tokenizer_path is None,
        "model.tokenizer_path",
        model.tokenizer_path,
        "the trained model is exported with model.path's tokenizer files (config.json, tokenizer), so another "
        "tokenizer would not travel with it",
        "copy the tokenizer files into model.path and leave tokenizer_path unset",
    )
    need(
        not (model.transformer_impl == "transformer_engine" and train.device == "cpu"),
        "model.transformer_impl",
        model.transformer_impl,
        "Transformer Engine is CUDA-only and train.device is cpu",
        "use model.transformer_impl: auto (or local)",
    )
    need(
        not (model.transformer_impl == "transformer_engine" and model.dtype == "float32"),
        "model.transformer_impl",
        model.transformer_impl,
        "Transformer Engine has no float32 attention for the THD micro-batches its spec takes (model.dtype is float32)",
        "use model.dtype: bfloat16, or model.transformer_impl: auto (the local spec in float32)",
    )
    need(
        len(data.train_files) > 0,
        "data.train_files",
        [],
        "no demonstration files",
        "list the .jsonl files, e.g. data.train_files=[demos.jsonl]",
    )
    problems += data_file_problems("data.train_files", data.train_files, check_exists=check_files)
    need(
        data.max_length >= 2,
        "data.max_length",
        data.max_length,
        "a conversation needs >= 2 tokens to train on",
        "e.g. 1024",
    )
    for key, value in (
        ("train.batch_size", train.batch_size),
        ("train.micro_batch_size_per_gpu", train.micro_batch_size_per_gpu),
        ("train.epochs", train.epochs),
        ("train.gpus", train.gpus),
        ("parallel.tensor_model_parallel_size", parallel.tensor_model_parallel_size),
        ("parallel.pipeline_model_parallel_size", parallel.pipeline_model_parallel_size),
        ("parallel.expert_model_parallel_size", parallel.expert_model_parallel_size),
        ("parallel.expert_tensor_parallel_size", parallel.expert_tensor_parallel_size or 1),
    ):
        need(value >= 1, key, value, "must be >= 1", "e.g. 1")
    need(
        train.total_steps is None or train.total_steps >= 1,
        "train.total_steps",
        train.total_steps,
        "must be >= 1",
        "e.g. 50, or null to run all epochs",
    )
    need(
        0 <= train.seed <= MAX_SEED,
        "train.seed",
        train.seed,
        f"a seed must lie in [0, 2**63 - 1 = {MAX_SEED}]",
        "e.g. 0 or 1234",
    )
    check_optimizer("optim", config.optim, problems)
    check_sequence_parallel("", parallel, problems)
    check_virtual_pipeline("", parallel, problems)
    check_context_parallel("", parallel, model.transformer_impl, {}, problems)
    check_cpu_offload("optim", config.optim, model.dtype, problems)
    _check_batch_layout(config, need, problems)
    need(
        bool(train.output_dir),
        "train.output_dir",
        train.output_dir,
        "required: where the trained model is written",
        "set it to a new directory, e.g. outputs/sft/model",
    )
    if check_files:
        _check_files(config, problems, need)
    return problems


def _check_batch_layout(config: SftConfig, need, problems: list[Problem]) -> None:
    train, parallel = config.train, config.parallel
    tp, pp, cp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
    )
    if min(tp, pp, cp, train.gpus, train.batch_size, train.micro_batch_size_per_gpu) < 1:
        return  # each has its own problem
    model_parallel = tp * cp * pp
    need(
        train.gpus % model_parallel == 0,
        "train.gpus",
        train.gpus,
        (f"TP × CP × PP = {tp} × {cp} × {pp}" if cp > 1 else f"TP × PP = {tp} × {pp}")
        + f" = {model_parallel} does not divide the {train.gpus} GPUs "
        f"({train.gpus} % {model_parallel} = {train.gpus % model_parallel})",
        f"use a multiple of {model_parallel} GPUs or a smaller layout",
    )
    if train.gpus % model_parallel:
        return
    if parallel.expert_model_parallel_size >= 1 and (parallel.expert_tensor_parallel_size or 1) >= 1:
        check_expert_grid("", parallel, train.gpus, problems)
    dp = train.gpus // model_parallel
    need(
        train.batch_size % dp == 0,
        "train.batch_size",
        train.batch_size,
        f"must split evenly over DP = {dp} ranks ({train.batch_size} % {dp} = {train.batch_size % dp})",
        f"use a multiple of {dp}",
    )
    per_rank = train.batch_size // dp
    need(
        train.batch_size % dp != 0 or per_rank % train.micro_batch_size_per_gpu == 0,
        "train.micro_batch_size_per_gpu",
        train.micro_batch_size_per_gpu,
        f"must divide the {per_rank} conversations per rank (train.batch_size {train.batch_size} ÷ DP {dp})",
        f"use a divisor of {per_rank}",
    )
    if train.batch_size % dp == 0 and per_rank % train.micro_batch_size_per_gpu == 0:
        check_interleaved_micro_batches(
            "train.micro_batch_size_per_gpu",
            train.micro_batch_size_per_gpu,
            parallel,
            per_rank // train.micro_batch_size_per_gpu,
            f"{per_rank} conversations per rank ÷ {train.micro_batch_size_per_gpu}",
            problems,
        )


def _check_files(config: SftConfig, problems: list[Problem], need) -> None:
    model, train = config.model, config.train
    if model.path:
        if is_hub_id(model.path) and cached_snapshot(model.path) is None:
            problems.append(missing_from_cache("model.path", model.path))
        else:
            try:
                dims, source = load_model_dims(local_dir(model.path))
            except ModelFactsError as error:
                problems.append(Problem("model.path", model.path, error.why, error.fix))
            else:
                described = f"the model ({source})"
                check_megatron_layout("", config.parallel, None, dims, described, problems)
                check_context_parallel_model("", config.parallel, dims, described, problems)
                need(
                    config.data.max_length <= dims.max_position_embeddings,
                    "data.max_length",
                    config.data.max_length,
                    f"longer than the {dims.max_position_embeddings} positions of the model",
                    f"use at most {dims.max_position_embeddings}",
                )
                key = "model.tokenizer_path" if model.tokenizer_path else "model.path"
                directory = local_path(local_dir(model.tokenizer_path or model.path))
                if os.path.isdir(directory):
                    problems += tokenizer_problems(key, model.tokenizer_path or model.path, directory, (dims, source))
                elif model.tokenizer_path:
                    problems.append(
                        Problem(
                            key,
                            model.tokenizer_path,
                            "not a directory, nor a hub id in the local cache",
                            "point it at a tokenizer directory, or leave it out to use model.path",
                        )
                    )
    if train.output_dir:
        problems += output_dir_problems(
            train.output_dir, model.path, config.data.train_files, overwrite=train.overwrite
        )


def output_dir_problems(
    output_dir: str, model_path: str, train_files: Sequence[str], *, overwrite: bool
) -> list[Problem]:
    """Why the trained model cannot be written to `output_dir`: not writable, the model being trained (its
    export would replace its own source), holding files while `overwrite` is false, or (overwrite true)
    holding anything but what an earlier `megarl sft` wrote there (`SFT_MARKER`), this run's data first."""
    problem = writable_dir_problem("train.output_dir", output_dir)
    if problem is not None:
        return [problem]
    out = local_path(output_dir)
    if out.resolve() == local_path(local_dir(model_path)).resolve():
        return [
            Problem(
                "train.output_dir",
                output_dir,
                "is model.path: the export would replace the model it starts from",
                "choose another directory",
            )
        ]
    held = sorted(path.name for path in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        return [
            Problem(
                "train.output_dir",
                output_dir,
                f"already holds {len(held)} file(s) ({', '.join(held[:5])})",
                "choose a new directory, or set train.overwrite: true to replace it",
            )
        ]
    if not held:
        return []
    inputs = [file for file in train_files if out.resolve() in local_path(file).resolve().parents]
    if inputs:
        return [
            Problem(
                "train.output_dir",
                output_dir,
                f"holds this run's training data ({', '.join(inputs[:3])}), which train.overwrite: true would delete",
                "write the model to another directory",
            )
        ]
    foreign = sorted(set(held) - sft_written(out))
    if foreign:
        return [
            Problem(
                "train.output_dir",
                output_dir,
                f"holds {len(foreign)} file(s) that `megarl sft` did not write "
                f"({', '.join(foreign[:5])}); train.overwrite: true replaces only an earlier `megarl sft` "
                f"output (the files its {SFT_MARKER} lists)",
                "choose a new directory, or move those files out of it",
            )
        ]
    return []


def sft_written(out: Path) -> set[str]:
    """The names in `out` that a `megarl sft` export wrote, as its marker lists them (the marker included);
    empty without a readable marker."""
    try:
        record = json.loads((out / SFT_MARKER).read_text())
        return {SFT_MARKER, *(name for name in record["files"] if isinstance(name, str))}
    except (OSError, ValueError, TypeError, KeyError):
        return set()


def write_sft_marker(out: Path) -> None:
    """Record in `out` (a finished export) the names it holds, so a later `train.overwrite: true` knows
    them as its own; written to a temporary name and renamed."""
    record = {"written_by": "megarl sft", "files": sorted(path.name for path in out.iterdir())}
    tmp = out / f".{SFT_MARKER}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.rename(out / SFT_MARKER)
