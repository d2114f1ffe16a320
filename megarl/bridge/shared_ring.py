"""The two-slot ring of a shared-memory weight sync: both halves of its protocol.

The sender (a trainer rank, `megarl.bridge.transports.shared_memory`) owns two slots of memory
the rollout workers can map (files in /dev/shm on CPU, CUDA IPC buffers on GPU) and streams one
sync's buckets through them: bucket i goes into slot i % 2. Every worker that reads the ring
(`readers`; which ones: `megarl.bridge.ring_routes`) reads every bucket in place, as one lazy stream consumed by its single `reload_weights` pass (one pass per
sync: see `worker_extension`). So the extra memory of a sync is two buckets, whatever the model.

The slots are passed by handle; a small side channel orders their reuse, a `TCPStore` the sender
hosts on 127.0.0.1 (on a port the OS picks), with keys under `sync/{n}/` for its n-th sync:

    bucket/{i}    sender -> workers: ("bucket", SharedBucket) | ("end", n) | ("abort", why)
    acks/{i}      each worker adds 1 once it no longer holds bucket i's tensors ...
    released/{i}  ... the last of the `readers` sets this: the sender may overwrite slot i % 2
    dones         each worker adds 1 when its load has returned ...
    done          ... the last sets this: the sender may delete the slots
    abort         a worker's failure, for the sender (who then passes it on in `bucket/{next}`)

    ring = RingSender.listen(readers=tp, timeout_s=60)           # sender, once
    start(ring.begin())                                          # engine: one load, returns at once
    for i, bucket in enumerate(shared_buckets):     # bucket i written into slot i % SLOTS
        if i >= SLOTS: ring.wait_released(i - SLOTS)
        ring.publish(bucket)
    ring.finish()

    read_ring(handle, "rollout worker 0", device, load=reload_weights)   # each rollout worker

A worker releases bucket i when its loader asks for bucket i + 2's first tensor, once no tensor on
bucket i's mapping is alive any more (its storage is gone: measured, not assumed). vLLM's reload
keeps the parts of a layer until the layer is complete, which for a layer with padding it never
loads (a vocabulary shard padded to a multiple of 64) is the end of the pass. Measured on a tiny
Qwen2 (vLLM 0.32 CPU, buckets of one module each): embed_tokens, lm_head and the v_proj weights
whose biases came later were still held when their slot was needed. Such tensors are moved to
private memory in place (`Tensor.set_`, so the loader's own reference follows): a copy of what the
loader keeps anyway, not of the stream (`RingReader.moved` names them, logged at INFO). A view the
reader cannot reach (derived by the loader) is an error naming the bucket and slot, never a silent
overwrite. On GPU the worker also waits for its stream's copies out of a slot before releasing it.
Every wait ends after `timeout_s` with an error naming the bucket and slot; a failure on either
side is passed to the other, so neither waits for the timeout then.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pickle
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.bridge.protocol import BucketMetadata, SharedBucket, unpack
from megarl.parallel.distributed import listen_store

SLOTS = 2
"""Buckets in shared memory at once: one being read while the next is written."""
HOST = "127.0.0.1"
"""The ring is node-local: its store listens on the loopback interface only."""
LIVENESS_CHECK_S = 1.0
"""How often a waiting sender checks that the readers' processes are alive."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedRing:
    """What a rollout worker needs to join one sync's ring: small and picklable."""

    port: int
    """The sender's store on `HOST`."""
    readers: int
    """Workers that read every bucket (`ring_routes.RingRoutes.readers`); the sender waits for all of them."""
    timeout_s: float
    """Longest wait for the other side, per bucket."""
    sync: int
    """The sync's number on this store: its keys are `sync/{sync}/...`."""

    def key(self, name: str) -> str:
        return f"sync/{self.sync}/{name}"


def _connect(ring: SharedRing) -> dist.TCPStore:
    return dist.TCPStore(HOST, ring.port, is_master=False, timeout=timedelta(seconds=ring.timeout_s))


def _count(store: dist.TCPStore, counter: str, flag: str, total: int) -> None:
    """Add this worker to `counter`; the last of `total` raises `flag` (a key one can wait on)."""
    if store.add(counter, 1) == total:
        store.set(flag, b"1")


class RingSender:
    """The sender's end: publishes buckets, waits for the workers to release slots. One store for
    all the syncs of a sender (`begin` starts the next), so a failed sync's story stays readable."""

    def __init__(self, store: dist.TCPStore, handle: SharedRing):
        self.store = store
        self.handle = handle
        self.published = 0
        """Index of the next `bucket/{i}` key (the one every worker waits on, at most)."""
        self._watch_store: dist.TCPStore | None = None
        """The watchdog's own connection to `store` (made by the first wait)."""

    @classmethod
    def listen(cls, readers: int, timeout_s: float) -> RingSender:
        store = listen_store(HOST, readers + 1, timeout_s)
        return cls(store, SharedRing(store.port, readers, timeout_s, sync=0))

    def begin(self) -> SharedRing:
        """Start the next sync; its handle, for the engine."""
        self.handle = dataclasses.replace(self.handle, sync=self.handle.sync + 1)
        self.published = 0
        return self.handle

    def publish(self, bucket: SharedBucket) -> None:
        """The next bucket (index `published`, in slot `published % SLOTS`) is ready to read."""
        self._post(("bucket", bucket))

    def wait_released(self, index: int) -> None:
        """Until every worker has released bucket `index` (its slot may then be overwritten)."""
        self._wait(
            self.handle.key(f"released/{index}"),
            f"to release bucket {index} (slot {index % SLOTS}) so bucket {index + SLOTS} can be written there",
        )

    def finish(self) -> None:
        """Tell the workers the sync has no more buckets; wait until each has loaded them all."""
        buckets = self.published
        self._post(("end", buckets))
        self._wait(
            self.handle.key("done"),
            f"to finish loading the sync's {buckets} buckets (the last in slot {(buckets - 1) % SLOTS})",
        )

    def abort(self, why: str) -> None:
        """Wake the workers waiting for the next bucket with the sender's failure."""
        self._post(("abort", why))

    def _post(self, message: tuple) -> None:
        self.store.set(self.handle.key(f"bucket/{self.published}"), pickle.dumps(message))
        self.published += 1

    def _wait(self, key: str, what: str) -> None:
        """Until `key` is set, in one wait (a sliced one makes c10d log every slice that times out);
        meanwhile a watchdog, on a connection of its own, checks every `LIVENESS_CHECK_S` that the
        joined readers (on this node) are alive, and sets `key` itself if one died, ending the wait
        at once instead of after `timeout_s`."""
        stop, dead = threading.Event(), []
        watchdog = threading.Thread(
            target=self._watch, args=(key, stop, dead), daemon=True, name="megarl-ring-watchdog"
        )
        watchdog.start()
        try:
            self.store.wait([key], timedelta(seconds=self.handle.timeout_s))
        except dist.DistStoreError:
            raise TimeoutError(
                f"shared-memory weight sync: the sender waited {self.handle.timeout_s}s for the "
                f"{self.handle.readers} rollout workers {what}; is the engine's `receive(SharedRings(...))` running?"
            ) from None
        finally:
            stop.set()
            watchdog.join()
        if dead:
            raise RuntimeError(
                f"shared-memory weight sync: rollout worker process {', '.join(map(str, dead))} died while "
                f"the sender waited for the workers {what}"
            )
        abort = self.handle.key("abort")
        if self.store.check([abort]):
            raise RuntimeError(f"shared-memory weight sync: {self.store.get(abort).decode()}")

    def _watch(self, key: str, stop: threading.Event, dead: list[int]) -> None:
        """The watchdog of `_wait`: until `stop`, record the dead readers in `dead` and wake the wait."""
        if self._watch_store is None:  # the waiting client's connection is busy with its wait
            self._watch_store = _connect(self.handle)
        store = self._watch_store
        while not stop.wait(LIVENESS_CHECK_S):
            found = self._dead_readers(store)
            if found:
                dead.extend(found)
                store.set(key, b"a reader died")
                return

    def _dead_readers(self, store: dist.TCPStore) -> list[int]:
        """Process ids of this sync's readers that have joined and are no longer alive."""
        joined = store.add(self.handle.key("joined"), 0)
        pids = [int(store.get(self.handle.key(f"pid/{index}"))) for index in range(joined)]
        return [pid for pid in pids if not process_alive(pid)]


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (Linux, as /dev/shm: a zombie, exited but not yet reaped, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@dataclass
class _Held:
    """A bucket whose tensors the loader may still hold."""

    index: int
    storage: weakref.ref
    """The bucket's mapping: dead once no tensor on it is alive."""
    tensors: list[tuple[str, weakref.ref]]
    """The tensors handed out, to name the ones still held."""


class RingReader:
    """A rollout worker's end: the sync's tensors, on the slots' memory, in bucket order."""

    def __init__(self, ring: SharedRing, name: str):
        self.ring = ring
        self.name = name
        """This worker in errors, e.g. "rollout worker 1"."""
        self.store = _connect(ring)
        # Announce this process so that the sender (on this node) notices if it dies mid-sync.
        index = self.store.add(ring.key("joined"), 1) - 1
        self.store.set(ring.key(f"pid/{index}"), str(os.getpid()))
        self.released = 0
        """Buckets released so far (the next one to release)."""
        self.moved: list[str] = []
        """Tensors the loader still held when their slot was needed, moved to private memory."""

    def tensors(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Every bucket's `(name, tensor)`, lazily, read in place; bucket i is released when bucket
        i + 2's first tensor is asked for (the last two buckets: by `done`, after the load)."""
        held: deque[_Held] = deque()
        index = 0
        while True:
            if len(held) == SLOTS:
                self._release(held.popleft(), device)
            kind, value = self._next(index)
            if kind == "end":
                return
            views = _unpack_movable(value.open(device), value.metadata)
            storage = weakref.ref(views[0][1].untyped_storage())
            held.append(_Held(index, storage, [(name, weakref.ref(tensor)) for name, tensor in views]))
            yield from views
            del views
            index += 1

    def done(self) -> None:
        """This worker's load has returned: it holds no bucket any more."""
        _count(self.store, self.ring.key("dones"), self.ring.key("done"), self.ring.readers)

    def abort(self, why: str) -> None:
        """Pass this worker's failure to the sender, wherever it waits."""
        self.store.set(self.ring.key("abort"), f"{self.name} failed: {why}".encode())
        self.store.set(self.ring.key(f"released/{self.released}"), b"1")
        self.store.set(self.ring.key("done"), b"1")

    def _next(self, index: int) -> tuple[str, object]:
        # The sender may itself wait `timeout_s` for a slower worker before it publishes: wait for
        # that and as long again, so that its error, which names the culprit, comes first.
        patience = 2 * self.ring.timeout_s
        try:
            self.store.wait([self.ring.key(f"bucket/{index}")], timedelta(seconds=patience))
        except dist.DistStoreError:
            raise TimeoutError(
                f"shared-memory weight sync: {self.name} waited {patience}s for bucket {index} "
                f"(slot {index % SLOTS}) from the sender; did the trainer's send stop?"
            ) from None
        kind, value = pickle.loads(self.store.get(self.ring.key(f"bucket/{index}")))
        if kind == "abort":
            raise RuntimeError(f"shared-memory weight sync: {value}")
        return kind, value

    def _release(self, bucket: _Held, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # copies out of the slot may still be queued
        if bucket.storage() is not None:
            gc.collect()  # a reference cycle may be all that keeps it
        if bucket.storage() is not None:
            for name, ref in bucket.tensors:
                if ref() is not None:
                    self.moved.append(name)
                    _move_out_of_slot(ref())
        if bucket.storage() is not None:
            raise RuntimeError(
                f"shared-memory weight sync: bucket {bucket.index + SLOTS} needs slot {bucket.index % SLOTS}, but "
                f"{self.name}'s loader still holds views derived from the tensors of bucket {bucket.index} "
                f"({', '.join(name for name, _ in bucket.tensors)}); set rollout.sync.transport: collective for this model"
            )
        _count(
            self.store,
            self.ring.key(f"acks/{bucket.index}"),
            self.ring.key(f"released/{bucket.index}"),
            self.ring.readers,
        )
        self.released = bucket.index + 1


def _unpack_movable(flat: torch.Tensor, metadata: BucketMetadata) -> list[tuple[str, torch.Tensor]]:
    """`unpack`'s tensors, on `flat`'s storage but not autograd views of `flat` (a view keeps its
    base, hence the slot's mapping, alive whatever storage it is later given)."""
    storage = flat.untyped_storage()
    return [
        (name, torch.empty(0, dtype=flat.dtype, device=flat.device).set_(storage, view.storage_offset(), view.shape))
        for name, view in unpack(flat, metadata)  # validated, then only their places are used
    ]


def _move_out_of_slot(tensor: torch.Tensor) -> None:
    """Give `tensor` (for everyone holding it) a private copy of its data instead of the slot's."""
    private = tensor.clone()
    tensor.set_(private.untyped_storage(), 0, private.shape, private.stride())


def read_ring(
    ring: SharedRing, name: str, device: torch.device, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None]
) -> None:
    """One worker's part of a sync: `load` (one pass) the stream of the ring's tensors, then tell
    the sender it is done, or why it failed. `name`: this worker in errors."""
    reader = RingReader(ring, name)
    try:
        load(reader.tensors(device))
    except BaseException as error:
        reader.abort(repr(error))
        raise
    if reader.moved:
        logger.info("shared-memory weight sync: %s kept %s past their slots (moved out)", name, reader.moved)
    reader.done()
