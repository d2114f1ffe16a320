"""The gradient-buffer offload frees host memory on CPU, through the GPU's own calls
(`TrainEngine.offload_training_state` / `onload` with `offload.grads`): megatron-core's
`DistributedDataParallel.offload_grad_buffers` resizes each buffer's storage to nothing
(megatron/core/distributed/param_and_grad_buffer.py `_ParamAndGradBuffer.offload_to_cpu`), which on CPU
frees host memory, and `restore_grad_buffers` reallocates it zeroed (`reload_from_cpu`).

A model with ~60 MiB of fp32 gradients per rank, so the buffer is far above what else a step frees
(the freed activations that `memory_stats.empty_cache` also hands back measured 13-25 MiB here) and far
above glibc's largest mmap threshold (32 MiB: the buffer is its own mapping, its pages leave and come back
whole). The e2e hand-over test checks the same calls in a run, where the tiny model's buffer is too small
to tell apart from the rest.
"""

import pytest
from worker_batches import ragged_batch
from worker_models import FLOAT32_LOCAL

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed

GIB = 2**30


def _rank_main(model_dir):
    import torch

    from megarl.config.roles import ActorConfig, OffloadConfig, OptimizerConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss
    from megarl.workers.memory_stats import memory_stats

    groups = initialize_model_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
        offload=OffloadConfig(grads=True),
        model=FLOAT32_LOCAL,
    )
    buffers = actor.engine.model.buffers
    batch = ragged_batch()
    batch.advantages = torch.ones(len(batch), batch.response_length)

    def update() -> float:
        # On-policy (old = current log-probs): the ratio starts at 1, so the clip cannot zero the gradient.
        batch.old_log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=len(batch))
        return actor.update_policy(batch, PolicyLoss(ActorConfig()), mini_batch_size=len(batch), micro_batch_size=2)[
            "grad_norm"
        ]

    first_norm = update()
    trained = memory_stats()["rss_gib"]
    actor.offload_training_state()
    offloaded = memory_stats()["rss_gib"]
    sizes_offloaded = [b.grad_data.untyped_storage().nbytes() for b in buffers]
    actor.onload()
    onloaded = memory_stats()["rss_gib"]
    return dict(
        grad_gib=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers) / GIB,
        freed=trained - offloaded,
        restored=onloaded - offloaded,
        sizes_offloaded=sizes_offloaded,
        zeroed=all(bool((b.grad_data == 0).all()) for b in buffers),
        first_norm=first_norm,
        second_norm=update(),
    )


@pytest.fixture(scope="module")
def offload(tmp_path_factory):
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("offload") / "qwen2",
        "qwen2",
        hidden_size=512,
        head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=2048,
        num_hidden_layers=4,
    )
    [result] = run_distributed(_rank_main, 1, str(model_dir), timeout_s=300)
    return result


def test_offloaded_gradient_buffers_leave_host_memory_and_come_back_zeroed(offload):
    assert offload["grad_gib"] > 50 / 1024  # the ~16 M parameters' fp32 gradients
    assert offload["sizes_offloaded"] == [0] * len(offload["sizes_offloaded"])
    # The whole buffer leaves RSS and comes back (RSS counts whole 4 KiB pages: 99 % of it).
    assert offload["freed"] >= 0.99 * offload["grad_gib"], offload
    assert offload["restored"] >= 0.99 * offload["grad_gib"], offload
    assert offload["zeroed"]
    # The next update runs on the restored buffers.
    assert offload["first_norm"] > 0 and offload["second_norm"] > 0
