"""Token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Each tensor-parallel rank holds the logits of one contiguous slice of the (padded) vocabulary,
`[*, V_local]`, rank `r` covering ids `r * V_local .. (r + 1) * V_local - 1`. Log-probs need three
reductions over the whole vocabulary (entropy one more), done as all-reduces of `[*]`-shaped tensors over the TP group:

    m    = max_v z_v                                  (all-reduce MAX; no gradient: it cancels out)
    S    = sum_v exp(z_v - m)                         (all-reduce SUM)
    z_y  = the target's logit                         (all-reduce SUM; 0 on ranks not owning y)
    A    = sum_v exp(z_v - m) (z_v - m)               (all-reduce SUM, entropy only)
    log p(y) = (z_y - m) - log S,    entropy = log S - A / S

The sums use megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity
backward). Every TP rank differentiates the same replicated loss, which depends on the logits only
through these replicated sums, so each rank's gradient for its own vocabulary slice is exactly its
local term. (Entropy written with rank-local probabilities `exp(z - m) / S` would break this: the
other ranks' dependence on S would be lost.)

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by × TP`; the padded ids
are not tokens, so their columns are dropped before any reduction (`vocab_size` = the real size).
Then the logits are upcast to fp32 (bf16 models): every sum, exponential and logarithm runs in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch import Tensor


def vocab_parallel_log_probs(
    logits: Tensor, targets: Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of `targets` and (optionally) the entropy of the full-vocabulary distribution.

    Args:
        logits: `[*, V_local]` this rank's slice of the padded vocabulary's logits.
        targets: `[*]` int64 token ids (global ids, `< vocab_size`).
        vocab_size: the real vocabulary size (columns at or beyond it are padding).
        tp_group: the tensor-parallel group the vocabulary is split over.
        with_entropy: also return the entropy (costs one more `[*]` all-reduce).

    Returns:
        `log_probs [*]` and `entropy [*]` (or None), fp32, differentiable w.r.t. `logits`.
    """
    local_size = logits.shape[-1]
    vocab_start = dist.get_rank(tp_group) * local_size
    real_columns = max(0, min(local_size, vocab_size - vocab_start))
    logits = logits[..., :real_columns].float()

    if real_columns > 0:
        global_max = logits.detach().amax(dim=-1)
    else:  # a rank whose whole slice is padding (tiny vocabularies, large TP)
        global_max = torch.full(targets.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    if tp_group.size() > 1:  # a gloo collective on a group of one still costs a thread hand-off
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - global_max.unsqueeze(-1)
    exp_shifted = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp_shifted.sum(dim=-1), group=tp_group)
    log_sum_exp = sum_exp.log()  # lse - m

    local_targets = targets - vocab_start
    owned = (local_targets >= 0) & (local_targets < real_columns)
    if real_columns > 0:
        target_shifted = shifted.gather(-1, local_targets.clamp(0, real_columns - 1).unsqueeze(-1)).squeeze(-1)
        target_shifted = torch.where(owned, target_shifted, 0.0)
    else:
        target_shifted = torch.zeros_like(global_max)
    log_probs = reduce_from_tensor_model_parallel_region(target_shifted, group=tp_group) - log_sum_exp

    if not with_entropy:
        return log_probs, None
    # Through the replicated sums S and A only (see the module docstring); the shift keeps it finite.
    weighted_sum = reduce_from_tensor_model_parallel_region((exp_shifted * shifted).sum(dim=-1), group=tp_group)
    return log_probs, log_sum_exp - weighted_sum / sum_exp
