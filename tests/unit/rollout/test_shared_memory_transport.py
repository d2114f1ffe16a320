"""The shared-memory transport's two-slot ring without vLLM: readers in other processes (or threads)
stream every bucket in place through two slots; a slot is reused only once every reader has
released it, and tensors a loader keeps past that are moved out of the slot first; a view that
cannot be moved, a reader that fails, a missing reader and a missing sender are each reported by
bucket and slot; no slot file outlives a sync."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megarl.bridge.protocol import pack
from megarl.bridge.shared_ring import SLOTS, RingSender, SharedRing, read_ring
from megarl.bridge.transports.shared_memory import FILE_PREFIX, SharedMemoryTransport, new_slot_file, remove_slot_files

CPU = torch.device("cpu")


def _tensors() -> dict[str, torch.Tensor]:
    """Five buckets' worth, of different sizes and dtypes."""
    return {
        "a": torch.arange(6.0).view(2, 3),
        "b": torch.ones(40),
        "c": torch.full((3,), 2.0, dtype=torch.float64),
        "d": torch.linspace(0, 1, 25).view(5, 5),
        "e": torch.arange(7.0),
    }


def _buckets():
    tensors = _tensors()
    for names in (["a"], ["b"], ["c"], ["d", "e"]):
        yield pack((name, tensors[name]) for name in names)


def _sums(stream, result) -> None:
    """A loader: consumes the stream tensor by tensor, keeping only what it read."""
    for name, tensor in stream:
        result[name] = tensor.sum().item()


def _read_in_process(ring: SharedRing, name: str, queue) -> None:
    result: dict[str, float] = {}
    read_ring(ring, name, CPU, lambda stream: _sums(stream, result))
    queue.put(result)


def test_readers_in_another_process_and_a_thread_stream_every_bucket_through_two_slots():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    readers = []
    in_thread: dict[str, float] = {}

    def start(ring: SharedRing) -> None:
        readers.append(context.Process(target=_read_in_process, args=(ring, "reader 0", queue)))
        readers[-1].start()
        readers.append(pool.submit(read_ring, ring, "reader 1", CPU, lambda stream: _sums(stream, in_thread)))

    pool = ThreadPoolExecutor(max_workers=1)
    transport = SharedMemoryTransport(readers=2)
    seen_slots = []
    transport_share = transport._share

    def share_and_record(slot, flat, metadata):
        seen_slots.append(list(transport.slot_paths))
        return transport_share(slot, flat, metadata)

    transport._share = share_and_record
    with pool:
        start(transport.begin())
        transport.send(_buckets())
        readers[1].result(timeout=60)
    process = readers[0]
    result = queue.get(timeout=60)
    process.join(timeout=60)
    assert process.exitcode == 0
    expected = {name: tensor.sum().item() for name, tensor in _tensors().items()}
    assert result == in_thread == expected
    # Two files for the whole sync, never more bytes than two of its largest bucket, then gone.
    assert len({path for paths in seen_slots for path in paths}) == SLOTS
    total = sum(flat.nbytes for flat, _ in _buckets())
    assert transport.largest_bucket_bytes == 40 * 4
    assert transport.peak_shared_bytes <= SLOTS * transport.largest_bucket_bytes < total
    assert not any(os.path.exists(path) for path in seen_slots[0])


def test_a_slot_is_reused_only_after_every_reader_released_it():
    """One of two readers never comes: bucket 2 must not overwrite slot 0 (the waiting sender times
    out naming both), the reader that came hears of the failure, and the slots are removed."""
    slot_paths = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        reading = []

        def start_one_reader(ring: SharedRing) -> None:
            slot_paths.extend(transport.slot_paths)
            reading.append(pool.submit(read_ring, ring, "reader 0", CPU, lambda stream: _sums(stream, {})))

        transport = SharedMemoryTransport(readers=2, timeout_s=1.0)
        start_one_reader(transport.begin())
        with pytest.raises(TimeoutError, match=r"2 rollout workers to release bucket 0 \(slot 0\) so bucket 2"):
            transport.send(_buckets())
        with pytest.raises(RuntimeError, match="the sender failed: TimeoutError"):
            reading[0].result(timeout=30)
    assert len(slot_paths) == SLOTS and not any(os.path.exists(path) for path in slot_paths)


def _keep_everything(stream, kept: list) -> None:
    """A loader that keeps every tensor it is given until the end (as vLLM does with a layer it
    cannot complete), then checks them."""
    kept.extend(stream)
    for name, tensor in kept:
        assert torch.equal(tensor, _tensors()[name]), name


def _keep_a_derived_view(stream) -> None:
    kept = [tensor[:1] for _, tensor in stream]  # views the reader never handed out
    assert kept


def test_tensors_a_loader_keeps_past_their_slot_are_moved_out_of_it():
    """Reusing slot 0 would change tensors the loader still holds: they are moved to private memory
    first (in place, the loader's references follow), so they keep their values; the rest is read in place."""
    kept = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        reading = []
        transport = SharedMemoryTransport(readers=1, timeout_s=30)
        ring = transport.begin()
        reading.append(pool.submit(read_ring, ring, "reader 0", CPU, lambda stream: _keep_everything(stream, kept)))
        transport.send(_buckets())
        reading[0].result(timeout=30)
    assert [name for name, _ in kept] == list(_tensors())
    storages = {name: tensor.untyped_storage().data_ptr() for name, tensor in kept}
    assert storages["d"] == storages["e"]  # still in the last bucket's slot, never needed again
    assert len(set(storages.values())) == 4  # a, b and c each moved to memory of its own
    assert transport.peak_shared_bytes <= SLOTS * transport.largest_bucket_bytes


def test_a_view_the_reader_cannot_move_is_an_error_on_both_sides():
    with ThreadPoolExecutor(max_workers=1) as pool:
        reading = []
        transport = SharedMemoryTransport(readers=1, timeout_s=30)
        reading.append(pool.submit(read_ring, transport.begin(), "reader 0", CPU, _keep_a_derived_view))
        with pytest.raises(RuntimeError, match=r"reader 0 failed: .*bucket 2 needs slot 0, .*bucket 0 \(a\)"):
            transport.send(_buckets())
        with pytest.raises(RuntimeError, match=r"still holds views derived from the tensors of bucket 0"):
            reading[0].result(timeout=30)


def test_a_reader_without_a_sender_times_out_naming_the_bucket():
    sender = RingSender.listen(readers=1, timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"reader 0 waited 1.0s for bucket 0 \(slot 0\) from the sender"):
        read_ring(sender.handle, "reader 0", CPU, list)


def test_a_missing_shared_memory_directory_is_a_clear_error(tmp_path):
    transport = SharedMemoryTransport(readers=1, directory=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="does not exist.*rollout.sync.transport: collective"):
        transport.begin()


def test_send_without_begin_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"send without begin\(\)"):
        SharedMemoryTransport(readers=1).send(_buckets())


def _read_one_tensor_and_die(ring: SharedRing) -> None:
    def die_midway(stream) -> None:
        next(iter(stream))
        os._exit(1)  # as a killed worker: no abort message, nothing cleaned up

    read_ring(ring, "reader 0", CPU, die_midway)


def test_a_reader_process_that_dies_mid_sync_ends_the_senders_wait_naming_it():
    """The sender waits for bucket 0's release (to reuse its slot for bucket 2); the reader's process
    is gone, so the wait ends on the next liveness check, not after `timeout_s`."""
    context = multiprocessing.get_context("spawn")
    transport = SharedMemoryTransport(readers=1, timeout_s=120)
    reader = context.Process(target=_read_one_tensor_and_die, args=(transport.begin(),))
    reader.start()
    slot_paths = list(transport.slot_paths)
    with pytest.raises(RuntimeError, match=rf"rollout worker process {reader.pid} died .*release bucket 0 \(slot 0\)"):
        transport.send(_buckets())
    reader.join(timeout=30)
    assert reader.exitcode == 1
    assert not any(os.path.exists(path) for path in slot_paths)


def test_a_new_slot_removes_the_files_of_dead_senders_only(tmp_path):
    """A trainer rank killed mid-sync leaves its slot files; the next sender on the node removes the
    files whose owner process is gone, and no other."""
    exited = multiprocessing.get_context("spawn").Process(target=int)
    exited.start()
    exited.join(timeout=60)
    dead = tmp_path / f"{FILE_PREFIX}{exited.pid}-left"
    live = tmp_path / f"{FILE_PREFIX}{os.getpid()}-in-use"
    foreign = tmp_path / "not-a-slot"
    for path in (dead, live, foreign):
        path.write_bytes(b"x")
    made = new_slot_file(str(tmp_path))
    assert not dead.exists() and live.exists() and foreign.exists()
    assert os.path.basename(made).startswith(f"{FILE_PREFIX}{os.getpid()}-")


def test_the_slot_files_of_the_senders_picked_are_removed_alive_or_not(tmp_path):
    """What `Roles.shutdown` does for the trainer ranks it killed, which may not have ended yet."""
    mine, other = tmp_path / f"{FILE_PREFIX}{os.getpid()}-k1", tmp_path / f"{FILE_PREFIX}1-k2"
    foreign = tmp_path / "not-a-slot"
    for path in (mine, other, foreign):
        path.write_bytes(b"x")
    remove_slot_files({os.getpid()}.__contains__, str(tmp_path))
    assert not mine.exists() and other.exists() and foreign.exists()
