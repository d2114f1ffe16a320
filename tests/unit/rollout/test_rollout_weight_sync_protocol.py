"""The weight-sync bucket format: pack/unpack round trips, and a gloo sync group between two threads."""

from __future__ import annotations

import pickle
import socket
import threading

import pytest
import torch

from megarl.bridge.protocol import BucketMetadata, TensorSlot, pack, unpack
from megarl.bridge.sync_group import address_towards, create_weight_sync_group, listen_weight_sync_store


def _tensors(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (3, 4), "b.bias": (5,), "c.scale": (), "d.weight": (2, 1, 3)}
    return [(name, (torch.randn(shape, generator=generator) * 100).to(dtype)) for name, shape in shapes.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_pack_unpack_round_trip(dtype):
    tensors = _tensors(dtype)
    flat, metadata = pack(tensors)
    assert flat.shape == (12 + 5 + 1 + 6,) and flat.dtype == dtype
    assert metadata.dtype == dtype and metadata.numel == flat.numel()
    assert [slot.offset for slot in metadata.slots] == [0, 12, 17, 18]
    assert [slot.shape for slot in metadata.slots] == [(3, 4), (5,), (), (2, 1, 3)]
    unpacked = unpack(flat, metadata)
    assert [name for name, _ in unpacked] == [name for name, _ in tensors]
    for (_, got), (_, want) in zip(unpacked, tensors):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_unpack_returns_views_of_the_buffer():
    flat, metadata = pack(_tensors(torch.float32))
    (_, first), *_ = unpack(flat, metadata)
    flat.zero_()
    assert (first == 0).all()


def test_pack_takes_non_contiguous_tensors():
    transposed = torch.arange(6.0).view(2, 3).t()
    flat, metadata = pack([("t", transposed)])
    torch.testing.assert_close(unpack(flat, metadata)[0][1], transposed, atol=0, rtol=0)


def test_metadata_survives_pickling():
    _, metadata = pack(_tensors(torch.bfloat16))
    assert pickle.loads(pickle.dumps(metadata)) == metadata


def test_pack_rejects_empty_and_mixed_dtypes():
    with pytest.raises(ValueError, match="at least one tensor"):
        pack([])
    with pytest.raises(ValueError, match="'b' is torch.float16 but the bucket is torch.float32"):
        pack([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.float16))])


def test_unpack_rejects_a_buffer_that_does_not_match():
    metadata = BucketMetadata((TensorSlot("a", (2, 3), torch.float32, 0),))
    with pytest.raises(ValueError, match="does not match"):
        unpack(torch.zeros(5), metadata)
    with pytest.raises(ValueError, match="does not match"):
        unpack(torch.zeros(6, dtype=torch.float64), metadata)


def test_sync_group_carries_a_bucket_between_two_ranks():
    """Rank 0 (a trainer rank) and rank 1 (a rollout worker) as two threads of this process."""
    store = listen_weight_sync_store("127.0.0.1", 2, timeout_s=30)  # listening before rank 1 connects
    flat, metadata = pack(_tensors(torch.bfloat16))
    received = torch.zeros_like(flat)

    def worker() -> None:
        group = create_weight_sync_group("127.0.0.1", store.port, 1, 2, timeout_s=30)
        group.recv([received], 0, 7).wait()

    thread = threading.Thread(target=worker)
    thread.start()
    group = create_weight_sync_group("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
    group.send([flat], 1, 7).wait()
    thread.join(timeout=30)
    assert not thread.is_alive()
    for (name, tensor), (got_name, got) in zip(_tensors(torch.bfloat16), unpack(received, metadata)):
        assert got_name == name
        torch.testing.assert_close(got, tensor, atol=0, rtol=0)


def test_a_rank_binds_to_its_own_address_on_the_route_to_the_store():
    """A remote rank must not bind gloo to rank 0's address; locally the route is the loopback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert address_towards("127.0.0.1", server.getsockname()[1]) == "127.0.0.1"
