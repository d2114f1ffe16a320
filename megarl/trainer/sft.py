"""`megarl sft`: a short supervised warm-up on demonstration conversations, before RL.

    trainer = SftTrainer.from_config("configs/sft_tiny.yaml", ["train.total_steps=20"])  # ConfigError, DataError
    result = trainer.fit()            # one progress line per step; result.output_dir is an HF checkpoint

The conversations are checked and tokenized in this process before anything starts (`megarl.data.sft`).
The model trains on a Megatron worker group placed by Ray, the RL actor's update path with the NLL loss
(`megarl.workers.sft_worker`), and is exported as an HF checkpoint (`train.output_dir`, written
atomically), ready to be the `model.path` of a `megarl train` recipe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from transformers import AutoTokenizer

from megarl.cluster.megatron_group import MegatronGroup
from megarl.cluster.ray_node import WORKER_ENV
from megarl.config.placement import resolve_device
from megarl.config.problems import ConfigError, Problem
from megarl.config.sft import (
    SftConfig,
    data_parallel_size,
    load_sft_config,
    local_dir,
    output_dir_problems,
    validate_sft,
    write_sft_marker,
)
from megarl.data import DataError
from megarl.data.sft import SftSample, load_sft_samples, sft_batches, steps_per_epoch
from megarl.orchestration.cluster import cluster_gpus, init_ray, shutdown_ray
from megarl.orchestration.placement import BundleSpec, create_placement_group, remove_placement_group
from megarl.parallel.device import worker_env
from megarl.workers.batch import PolicyBatch
from megarl.workers.settings import SftWorkerSpec

SFT_TARGET = "megarl.workers.sft_worker:SftWorker"


@dataclass
class SftResult:
    """What a finished `megarl sft` run leaves."""

    output_dir: Path
    """The HF checkpoint directory (train.output_dir)."""
    metrics: list[dict[str, float]] = field(default_factory=list)
    """Per optimizer step: loss (mean NLL per trained token), tokens, grad_norm, lr, tok_per_s, ..."""


class SftTrainer:
    """Supervised fine-tuning on megatron-core + Ray, driven from one process."""

    def __init__(self, config: SftConfig):
        """`config` validated (`validate_sft`); the output dir is checked again here, where the export's
        replacing it is decided. Reads every conversation (`DataError` lists the bad rows)."""
        self.config = config
        model = config.model
        self._check_output_dir()
        # Absolute: the rank processes need not share the driver's working directory.
        self.model_path = str(Path(local_dir(model.path)).expanduser().absolute())
        self.tokenizer = AutoTokenizer.from_pretrained(
            local_dir(model.tokenizer_path or model.path), trust_remote_code=model.trust_remote_code
        )
        data, train = config.data, config.train
        self.samples = load_sft_samples(
            data.train_files, self.tokenizer, max_length=data.max_length, truncate=data.truncate
        )
        per_epoch = steps_per_epoch(len(self.samples), train.batch_size)
        if per_epoch < 1:
            raise DataError(
                f"the SFT data has {len(self.samples)} conversation(s), fewer than one batch of "
                f"train.batch_size={train.batch_size}; add conversations or lower train.batch_size"
            )
        self.total_steps = min(train.total_steps or train.epochs * per_epoch, train.epochs * per_epoch)
        self.pad_id = next(i for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if i is not None)
        self.step_in_progress: int | None = None
        """The optimizer step running now (None before the first and after the last: start-up, export)."""

    @classmethod
    def from_config(cls, path: str | Path, overrides: Sequence[str] = ()) -> SftTrainer:
        """Load and validate an SFT recipe, then read the data; `ConfigError` lists every config problem,
        `DataError` every bad row."""
        config = load_sft_config(path, overrides)
        problems = validate_sft(config)
        if problems:
            raise ConfigError(problems)
        return cls(config)

    def plan_line(self) -> str:
        """What the run will do, in one line (printed before it starts; `megarl sft --dry-run` stops there)."""
        config, train = self.config, self.config.train
        trained = sum(sum(sample.loss_mask[1:]) for sample in self.samples)
        dp = data_parallel_size(config)
        return (
            f"sft: {len(self.samples)} conversations ({trained} assistant tokens), {self.total_steps} optimizer "
            f"steps of {train.batch_size} (DP {dp} × {train.batch_size // dp} per rank in micro-batches of "
            f"{train.micro_batch_size_per_gpu}); TP {config.parallel.tensor_model_parallel_size}"
            f"{' with sequence parallelism' if config.parallel.sequence_parallel else ''}, PP "
            f"{config.parallel.pipeline_model_parallel_size} on {train.gpus} {train.device} rank(s); "
            f"output {train.output_dir}"
        )

    def fit(self) -> SftResult:
        """Train `total_steps` optimizer steps and export the model to `train.output_dir`."""
        train = self.config.train
        init_ray(num_cpus=max(os.cpu_count() or 1, train.gpus), env_vars=WORKER_ENV)
        group, placement = None, None
        try:
            device = self._device()
            bundle = BundleSpec(cpus=1.0, gpus=1.0 if device == "cuda" else 0.0)
            placement = create_placement_group("megarl-sft", train.gpus, bundle)
            group = MegatronGroup.start(
                "sft",
                self._worker_spec(),
                train.gpus,
                placement,
                bundle,
                {**WORKER_ENV, **worker_env(device)},
                target=SFT_TARGET,
            )
            result = SftResult(Path(train.output_dir).expanduser().absolute())
            batches = sft_batches(
                self.samples,
                batch_size=train.batch_size,
                epochs=train.epochs,
                seed=train.seed,
                shuffle=self.config.data.shuffle,
            )
            for step, rows in enumerate(islice(batches, self.total_steps), start=1):
                self.step_in_progress = step
                result.metrics.append(self._step(group, step, rows))
            self.step_in_progress = None
            self._check_output_dir()  # again: files may have landed there while the run trained
            group.workers.call_all("export_hf", str(result.output_dir))
            write_sft_marker(result.output_dir)
            print(
                f"sft: wrote {result.output_dir} (HF checkpoint; use it as model.path of a `megarl train` recipe)",
                flush=True,
            )
            return result
        finally:
            if group is not None:
                group.workers.kill()
            if placement is not None:
                remove_placement_group(placement)
            shutdown_ray()

    def _check_output_dir(self) -> None:
        """`ConfigError` if the export may not replace train.output_dir (`output_dir_problems`)."""
        config = self.config
        problems = output_dir_problems(
            config.train.output_dir, config.model.path, config.data.train_files, overwrite=config.train.overwrite
        )
        if problems:
            raise ConfigError(problems)

    def _device(self) -> str:
        gpus, setting = cluster_gpus(), self.config.train.device
        if setting == "cuda" and gpus <= 0:
            raise ConfigError(
                [
                    Problem(
                        "train.device",
                        "cuda",
                        "the Ray cluster has 0 GPU resources",
                        "start the Ray nodes with their GPUs or use train.device: cpu",
                    )
                ]
            )
        return resolve_device(setting, gpus)

    def _worker_spec(self) -> SftWorkerSpec:
        config = self.config
        parallel = config.parallel
        etp = parallel.expert_tensor_parallel_size
        return SftWorkerSpec(
            model_path=self.model_path,
            model=config.model,
            tp=parallel.tensor_model_parallel_size,
            pp=parallel.pipeline_model_parallel_size,
            vpp=parallel.virtual_pipeline_model_parallel_size or 1,
            ep=parallel.expert_model_parallel_size,
            etp=parallel.tensor_model_parallel_size if etp is None else etp,
            cp=parallel.context_parallel_size,
            sequence_parallel=config.parallel.sequence_parallel,
            seed=config.train.seed,
            optim=config.optim,
            lr_decay_steps=self.total_steps,
            micro_batch_size=config.train.micro_batch_size_per_gpu,
        )

    def _step(self, group: MegatronGroup, step: int, rows: list[SftSample]) -> dict[str, float]:
        start = time.perf_counter()
        batch = sft_policy_batch(rows, self.pad_id)
        parts = batch.split(data_parallel_size(self.config))
        results = group.call_by_dp("train_step", [(part,) for part in parts])
        metrics = next(r for g, r in zip(group.grids, results) if g["rank"] == 0)  # reduced over DP already
        seconds = time.perf_counter() - start
        metrics["tok_per_s"] = sum(len(row.input_ids) for row in rows) / seconds
        skipped = " | skipped (non-finite loss or gradient)" if metrics["skipped_steps"] else ""
        print(
            f"sft step {step}/{self.total_steps} | loss {metrics.get('loss', float('nan')):.4f} | "
            f"tok/s {metrics['tok_per_s']:.0f} | grad_norm {metrics.get('grad_norm', float('nan')):.3f} | "
            f"lr {metrics.get('lr', float('nan')):.2e}{skipped}",
            flush=True,
        )
        return metrics


def sft_policy_batch(samples: Sequence[SftSample], pad_id: int) -> PolicyBatch:
    """The `PolicyBatch` the actor trains on: each conversation's first token is the one-token prompt
    (`[B, 1]`; nothing predicts it), the rest the right-padded response (`[B, L - 1]`, L the longest
    conversation), `response_mask` the loss mask of the response tokens."""
    width = max(len(sample.input_ids) for sample in samples) - 1
    responses = torch.full((len(samples), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        length = len(sample.input_ids) - 1
        responses[row, :length] = torch.tensor(sample.input_ids[1:])
        response_mask[row, :length] = torch.tensor(sample.loss_mask[1:])
    prompts = torch.tensor([[sample.input_ids[0]] for sample in samples], dtype=torch.long)
    return PolicyBatch(
        prompts=prompts,
        prompt_mask=torch.ones_like(prompts, dtype=torch.bool),
        responses=responses,
        response_mask=response_mask,
    )
