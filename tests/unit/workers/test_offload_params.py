"""`TrainEngine.offload_params`, the hand-over's step between the weight sync and the engines' KV-cache
wake: the allocator's cache always goes back (the sync's buckets and collective buffers sit in it), the
parameters leave only as configured, and a configuration under which megatron-core would move nothing
(`offload.params` without the distributed optimizer: `_ParamAndGradBuffer.param_data` is None) is an
error, not a silent no-op."""

from types import SimpleNamespace

import pytest

from megarl.config.roles import OffloadConfig
from megarl.workers import megatron_train
from megarl.workers.megatron_train import TrainEngine


class _Buffer:
    """Stands in for megatron-core's `_ParamAndGradBuffer.offload_to_cpu(move_params, move_grads)`."""

    def __init__(self):
        self.calls = []

    def offload_to_cpu(self, move_params: bool = True, move_grads: bool = True) -> None:
        self.calls.append((move_params, move_grads))


def _engine(distributed_optimizer: bool) -> SimpleNamespace:
    model = SimpleNamespace(
        ddp_config=SimpleNamespace(use_distributed_optimizer=distributed_optimizer),
        buffers=[_Buffer()],
        expert_parallel_buffers=[_Buffer()],
    )
    return SimpleNamespace(chunks=[model], model=model)


@pytest.fixture
def emptied(monkeypatch) -> list[int]:
    calls = []
    monkeypatch.setattr(megatron_train, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(megatron_train, "uses_cuda", lambda: True)
    return calls


def test_cache_is_emptied_after_the_sync_without_params_offload(emptied):
    engine = _engine(distributed_optimizer=True)
    TrainEngine.offload_params(engine, OffloadConfig(params=False))
    assert emptied == [1]
    assert all(not buffer.calls for buffer in engine.model.buffers + engine.model.expert_parallel_buffers)


def test_params_offload_moves_every_buffer_params_only(emptied):
    engine = _engine(distributed_optimizer=True)
    TrainEngine.offload_params(engine, OffloadConfig(params=True))
    assert emptied == [1]
    assert [buffer.calls for buffer in engine.model.buffers + engine.model.expert_parallel_buffers] == [
        [(True, False)],
        [(True, False)],
    ]


def test_params_offload_without_distributed_optimizer_is_refused(emptied):
    engine = _engine(distributed_optimizer=False)
    with pytest.raises(ValueError, match="offload.params=True needs the distributed optimizer"):
        TrainEngine.offload_params(engine, OffloadConfig(params=True))
    assert not engine.model.buffers[0].calls
