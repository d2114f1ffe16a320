"""The shared-memory transport's handles without vLLM: another process maps a bucket by its pickled
handle and reads the sender's bytes in place; the sender's files are gone after the delivery, also
when it fails."""

from __future__ import annotations

import glob
import multiprocessing
import os
import pickle

import pytest
import torch

from megarl.bridge.transports.shared_memory import FILE_PREFIX, SHM_DIR, SharedMemoryTransport, ShmBucket
from megarl.workers.rollout.weight_sync_protocol import pack, unpack


def _bucket_files() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, FILE_PREFIX + "*")))


def _sum_and_write(handle: bytes, result) -> None:
    """In another process: read the bucket in place, then write into it (the sender sees that)."""
    bucket = pickle.loads(handle)
    flat = bucket.open(torch.device("cpu"))
    result.put({name: tensor.sum().item() for name, tensor in unpack(flat, bucket.metadata)})
    flat.fill_(7.0)


def _buckets():
    yield pack([("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(4))])
    yield pack([("c", torch.full((3,), 2.0, dtype=torch.float64))])


def test_another_process_reads_the_bucket_in_place():
    before = _bucket_files()
    delivered = []

    def deliver(buckets):
        assert all(isinstance(b, ShmBucket) and b.path.startswith(SHM_DIR) for b in buckets)
        assert _bucket_files() - before == {b.path for b in buckets}
        context = multiprocessing.get_context("spawn")
        result = context.Queue()
        process = context.Process(target=_sum_and_write, args=(pickle.dumps(buckets[0]), result))
        process.start()
        delivered.append(result.get(timeout=60))
        process.join(timeout=60)
        assert process.exitcode == 0
        # The reader wrote into the very memory the sender shares: no copy on the way.
        assert (buckets[0].open(torch.device("cpu")) == 7.0).all()
        assert [t.dtype for _, t in unpack(buckets[1].open(torch.device("cpu")), buckets[1].metadata)] == [
            torch.float64
        ]

    SharedMemoryTransport(deliver).send(_buckets())
    assert delivered == [{"a": 15.0, "b": 4.0}]
    assert _bucket_files() == before


def test_files_are_released_when_the_delivery_fails():
    before = _bucket_files()

    def deliver(buckets):
        assert len(_bucket_files() - before) == 2
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        SharedMemoryTransport(deliver).send(_buckets())
    assert _bucket_files() == before


def test_a_missing_shared_memory_directory_is_a_clear_error(tmp_path):
    transport = SharedMemoryTransport(lambda buckets: None, directory=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="does not exist.*broadcast transport"):
        transport.send(_buckets())
