"""Seeding of every RNG a training process uses."""

import random

import numpy as np
import torch


def seed_everything(seed: int, *, tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Seed Python, NumPy and torch identically on every rank, then megatron's tracked streams.

    The default streams get the same seed on all ranks: parameters that are replicated across a TP
    group (e.g. norms) must start equal on each rank, or only one copy survives a checkpoint.
    Pipeline stages offset the seed so their different layers do not draw identical weights.
    megatron's model-parallel stream gets `seed + 2718 + tp_rank` (its own convention) for
    TP-sharded randomness.
    """
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
