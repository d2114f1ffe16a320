"""The Megatron actor on one GPU in bf16, with the layer spec `model.transformer_impl: auto` picks
there (Transformer Engine where it is installed): it is on the GPU, it trains, and 16 extra columns of
left padding leave its log-probs unchanged (with TE: the THD layout computes no padding,
`megarl.workers.thd`; on the local spec: the dense mask). CPU twins:
tests/distributed/workers/test_mixed_precision.py and the left-padding case of test_megatron_workers.py."""

import math

import torch

from megarl.models.tiny import make_tiny_model
from megarl.parallel.spawn import run_distributed
from megarl.workers.batch import PolicyBatch

STEPS = 3
# bf16 rounding differs between the two batch widths; padding that were attended moves log-probs by ~1-10.
PADDING_TOLERANCE = 0.05


def _batch(extra_left_padding: int) -> PolicyBatch:
    """4 samples with 4 response tokens; prompts of 5, 2, 4 and 3 tokens, left-padded to
    5 + `extra_left_padding` columns. The real tokens are the same at every width; the padding
    columns hold real token ids too (masked out), so attending to them would change the result."""
    real = torch.randint(4, 60, (4, 5), generator=torch.Generator().manual_seed(0))
    padding = torch.randint(4, 60, (4, extra_left_padding), generator=torch.Generator().manual_seed(1))
    prompts = torch.cat([padding, real], dim=1)
    width = prompts.shape[1]
    prompt_mask = torch.arange(width)[None, :] >= (width - torch.tensor([5, 2, 4, 3]))[:, None]
    responses = torch.randint(4, 60, (4, 4), generator=torch.Generator().manual_seed(2))
    return PolicyBatch(prompts, prompt_mask, responses, torch.ones_like(responses, dtype=torch.bool))


def _rank(model_dir: str, dtype: str = "bfloat16") -> dict:
    from megarl.config.roles import ActorConfig, OptimizerConfig
    from megarl.config.sections import ModelConfig
    from megarl.parallel.distributed import initialize_model_parallel
    from megarl.workers.actor import MegatronActor, PolicyLoss

    groups = initialize_model_parallel(1, 1, seed=0)
    actor = MegatronActor.from_hf(
        model_dir,
        groups,
        optim=OptimizerConfig(lr=1e-3, weight_decay=0.0, use_distributed_optimizer=False),
        model=ModelConfig(dtype=dtype, transformer_impl="auto"),
    )
    model = actor.engine.model
    narrow, wide = _batch(0), _batch(16)
    narrow_lp, _ = actor.compute_log_prob(narrow, micro_batch_size=4)
    wide_lp, _ = actor.compute_log_prob(wide, micro_batch_size=4)
    narrow.advantages = torch.ones(4, 4)
    means = []
    for _ in range(STEPS):
        narrow.old_log_probs, _ = actor.compute_log_prob(narrow, micro_batch_size=4)
        means.append(narrow.old_log_probs.mean().item())
        actor.update_policy(narrow, PolicyLoss(ActorConfig()), mini_batch_size=4, micro_batch_size=2)
    return dict(
        impl=model.config.transformer_impl,
        devices={str(p.device.type) for p in model.parameters()},
        dtypes={str(p.dtype) for p in model.parameters()},
        padding_gap=(narrow_lp - wide_lp).abs().max().item(),
        means=means,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
    )


def test_bf16_actor_on_the_gpu_trains_and_ignores_left_padding(tmp_path, memory_phase):
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    with memory_phase("actor"):
        [out] = run_distributed(_rank, 1, str(model_dir), timeout_s=600)
    expected_impl = "transformer_engine" if _te_installed() else "local"
    assert out["impl"] == expected_impl
    assert out["devices"] == {"cuda"} and out["dtypes"] == {"torch.bfloat16"}
    assert out["padding_gap"] < PADDING_TOLERANCE, out
    assert all(math.isfinite(m) for m in out["means"])
    assert out["means"][-1] > out["means"][0], out["means"]  # positive advantages: the tokens got likelier


def test_fp32_actor_with_auto_spec_trains_on_the_local_spec(tmp_path, memory_phase):
    """The fp32 quickstart's actor on a GPU with Transformer Engine installed: auto gives it the local spec
    (TE has no float32 attention for THD micro-batches), and its update runs."""
    model_dir = make_tiny_model(tmp_path / "qwen2", "qwen2", initializer_range=0.2)
    with memory_phase("actor_fp32"):
        [out] = run_distributed(_rank, 1, str(model_dir), "float32", timeout_s=600)
    assert out["impl"] == "local"
    assert out["devices"] == {"cuda"} and out["dtypes"] == {"torch.float32"}
    assert all(math.isfinite(m) for m in out["means"])
    assert out["means"][-1] > out["means"][0], out["means"]


def _te_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None
