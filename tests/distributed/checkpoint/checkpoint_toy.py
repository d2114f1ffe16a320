"""A toy training job for the checkpoint tests: a tiny Qwen2-shaped GPTModel built by megarl, under
Megatron DDP, optimizer and LR schedule (`megarl.workers.megatron_train`), trained on batches drawn
from the process RNGs, so a checkpoint that misses any state (weights, Adam moments, LR schedule
position, an RNG stream) changes the losses that follow it.
"""

import random

import numpy as np
import torch
import torch.distributed as dist

SEQ, BATCH = 16, 4
TINY_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


class ToyJob:
    """One rank's model, DDP wrapper, optimizer and scheduler (role "actor")."""

    def __init__(self, tp: int, *, seed: int, use_distributed_optimizer: bool, vocab_divisible_by: int = 128):
        from megarl.config.roles import OptimizerConfig
        from megarl.models.architectures import build_gpt_model
        from megarl.parallel.distributed import initialize_model_parallel
        from megarl.workers.megatron_train import build_optimizer, wrap_for_training

        self.groups = initialize_model_parallel(tp, 1, seed=seed)
        # Warm-up then cosine decay: every step has its own LR, so a lost scheduler position shows.
        optim = OptimizerConfig(
            lr=1e-2,
            min_lr=1e-3,
            weight_decay=0.0,
            lr_warmup_steps=2,
            lr_decay_style="cosine",
            clip_grad=1.0,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        model = build_gpt_model(TINY_QWEN2, self.groups, vocab_divisible_by=vocab_divisible_by)
        [self.ddp] = wrap_for_training([model], optim, self.groups)
        self.optimizer, self.scheduler = build_optimizer([self.ddp], optim, 10, self.groups)

    def parts(self) -> dict:
        """The keyword arguments of save_checkpoint / load_checkpoint for this job."""
        return dict(
            models={"actor": [self.ddp]}, optimizers={"actor": self.optimizer}, schedulers={"actor": self.scheduler}
        )

    def train_step(self) -> dict:
        """One optimizer step on a batch drawn from torch's default RNG (the same on every rank; each
        DP rank trains on its share). Returns the loss, the LR used and draws from the other RNG
        streams (python, numpy, megatron's tracked stream), which must continue identically."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (BATCH, SEQ + 1))
        with get_cuda_rng_tracker().fork():
            tracked = torch.rand(()).item()
        draws = (random.random(), float(np.random.rand()), tracked)
        lr = self.optimizer.param_groups[0]["lr"]
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._loss(tokens, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        assert updated
        self.scheduler.step(increment=1)
        return dict(loss=loss, lr=lr, grad_norm=float(grad_norm), draws=draws)

    def eval_loss(self) -> float:
        """Loss on a fixed batch (its own generator), without training."""
        g = torch.Generator().manual_seed(11)
        tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (BATCH, SEQ + 1), generator=g)
        return self._loss(tokens, forward_only=True)

    def local_weights(self) -> dict[str, np.ndarray]:
        """This rank's parameter shards, as numpy (tensors do not travel well through the result queue)."""
        return {name: p.detach().clone().numpy() for name, p in self.ddp.module.named_parameters()}

    def _loss(self, tokens: torch.Tensor, forward_only: bool) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        groups = self.groups
        tokens = tokens.chunk(groups.dp_size)[groups.dp_rank]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(len(inputs), -1)

        def forward_step(data_iterator, model):
            def loss_func(per_token_loss):
                loss = per_token_loss.float().mean()
                return loss, {"loss": loss.detach()}

            return model(inputs, position_ids, None, labels=labels), loss_func

        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[self.ddp],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=len(inputs),
            forward_only=forward_only,
        )
        loss = losses[0]["loss"].reshape(1).clone()
        dist.all_reduce(loss, group=groups.dp)
        return loss.item() / groups.dp_size
