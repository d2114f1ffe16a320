"""megatron-core GPTModel (local spec) trains on CPU across processes: TP=2, PP=2, TP=2×PP=2 give the
same loss and gradient norm as one process, with Megatron DDP, the Megatron (distributed) optimizer
and grad clipping on.

The single-process model is saved as a megatron distributed checkpoint and loaded into every layout,
so all layouts start from the same weights (megatron does the resharding).
"""

import math

import pytest
import torch

from megarl.parallel.spawn import run_distributed

SEQ, BATCH, VOCAB = 16, 4, 128


def _build(tp, pp, use_distributed_optimizer):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megarl.parallel.distributed import initialize_model_parallel

    groups = initialize_model_parallel(tp, pp, seed=1234)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # The schedules reduce DP gradients (and tied-embedding grads across stages) only through this hook.
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            clip_grad=1.0,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [ddp_model],
    )
    return groups, config, model, ddp_model, optimizer


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _save_reference(ckpt_dir):
    from megatron.core import dist_checkpointing

    _, _, model, _, _ = _build(1, 1, use_distributed_optimizer=False)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)


def _train_step(ckpt_dir, tp, pp, use_distributed_optimizer):
    """One forward/backward/optimizer step; returns (loss, grad norm, loss after the step)."""
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    groups, _config, model, ddp_model, optimizer = _build(tp, pp, use_distributed_optimizer)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    # DDP keeps parameters in its own contiguous buffer; load_state_dict copied into those views.
    # Each DP rank takes its slice of the global batch; Megatron DDP averages their gradients.
    tokens, labels = (t.chunk(groups.dp_size)[groups.dp_rank] for t in _batch())
    micro_batch = tokens.shape[0]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(micro_batch, -1)

    def forward_step(data_iterator, model_chunk):
        output = model_chunk(tokens, position_ids, None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def run(forward_only):
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp_model],
            num_microbatches=1,
            seq_length=SEQ,
            micro_batch_size=micro_batch,
            forward_only=forward_only,
        )
        loss = torch.tensor([losses[0]["loss"].item() if losses else 0.0])
        # The loss lives on the last stage; share it with the whole pipeline, average it over DP.
        torch.distributed.all_reduce(loss, group=groups.pp)
        torch.distributed.all_reduce(loss, group=groups.dp)
        return loss.item() / groups.dp_size

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run(forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok
    loss_after = run(forward_only=True)
    return loss, grad_norm, loss_after


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("reference_ckpt"))
    run_distributed(_save_reference, 1, ckpt)
    loss, grad_norm, loss_after = run_distributed(_train_step, 1, ckpt, 1, 1, False)[0]
    # grad norm above clip_grad=1.0, so clipping really scales the update being compared.
    assert math.isfinite(loss) and grad_norm > 1.0 and loss_after < loss
    return ckpt, (loss, grad_norm, loss_after)


@pytest.mark.parametrize(
    "tp,pp,dp,dist_opt",
    [(2, 1, 1, False), (1, 2, 1, False), (2, 2, 1, False), (1, 1, 2, False), (1, 1, 2, True)],
    ids=["tp2", "pp2", "tp2pp2", "dp2", "dp2-distopt"],
)
def test_layout_matches_single_process(reference, tp, pp, dp, dist_opt):
    ckpt, expected = reference
    results = run_distributed(_train_step, tp * pp * dp, ckpt, tp, pp, dist_opt)
    for rank, got in enumerate(results):
        # Every rank holds the same reduced loss and the global grad norm.
        assert got == pytest.approx(expected, rel=1e-5), f"rank {rank}: {got} vs single process {expected}"
