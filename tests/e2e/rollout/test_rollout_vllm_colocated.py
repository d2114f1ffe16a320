"""An in-process vLLM engine inside a process that already has a torch.distributed world (a
colocated trainer rank): it generates, and shutting it down leaves the trainer's world working."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rollout_reference import PROMPTS, free_port

from megarl.workers.rollout import SamplingConfig, make_rollout_engine
from megarl.workers.rollout.engine_args import EngineArgs


@pytest.fixture
def trainer_world():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_engine_shutdown_keeps_the_trainer_world(trainer_world, base_model_dir):
    engine = make_rollout_engine("vllm", EngineArgs(base_model_dir, dtype="float32", max_model_len=128))
    outputs = engine.generate(PROMPTS, SamplingConfig(greedy=True, max_new_tokens=4))
    assert all(len(o.response_token_ids[0]) == 4 for o in outputs)
    engine.shutdown()
    assert dist.is_initialized()
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 1.0
