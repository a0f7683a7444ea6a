"""The GPU played on CPU: how the tests check hf_zero.runtime.device's GPU path on a machine without one.

On CPU every copy is immediate and every op runs in program order, so a missing wait can never show.
`HF_ZERO_SIMULATE_ASYNC` makes the CPU behave as a GPU would at its most unlucky, in two ways.

The copy engine (`CopyEngine`, values). "late" (or "1"): asynchronous work lands as late as a GPU may land it:
- host to device: the destination receives the values at once when the copy is on the stream queuing work now
  (later work there is stream-ordered), else only when a stream waits on it (`Copy.ready`), work is issued on
  its stream, or the host waits; it holds poison (NaN) until then. The source stays lent to the copy until the
  host waits on it: writing into it meanwhile (through file I/O, the C++ kernel, or torch) is caught.
- device to host: the destination holds poison until the copy is waited on, and receives the values the
  source had when the copy was queued. Reading or writing it meanwhile is caught.
- a reduction on the communication stream runs when the compute stream waits on it; an asynchronous collective
  (hf_zero.runtime.comm) runs when waited on, its outputs poison until then, and its inputs must not change meanwhile.
"early": asynchronous work runs the moment it is issued, as a GPU with an idle side stream runs it: code that
counts on it not having run yet shows as a wrong result.

The stream checker (`StreamChecker`, order), under "late": a sanitizer of stream order, as torch's CUDA
sanitizer (torch.cuda._sanitizer, whose vector clocks it reuses) is on a GPU. Every op torch runs (a dispatch
mode), every copy, collective, event and free the device layer makes is an access to memory by a stream: the
compute, communication and copy streams, one stream per process group's collectives (NCCL runs each group's on
a stream of its own), and the host. Each storage keeps its last writer and the readers since, by stream. An
access from one stream to bytes another stream wrote (or, writing, read) is refused with `StreamOrderError`
unless a wait orders the two: an event recorded on the other stream after its access and waited on by this
stream (`Event.wait`, `Copy.ready`, a collective's `wait()`, `CommStream.wait`), or by the host (`Copy.wait`),
since the host issues every later op. So:
- side-stream work is invisible to the compute stream until it waits on it, whatever the values say;
- a wait on the wrong stream (the copy stream waiting on its own event) orders nothing for the compute stream;
- freeing memory is a write by the stream that allocated it (the caching allocator hands the block to that
  stream's next allocation at once): explicitly (`device.release_storage`) or when torch frees the storage,
  every other stream's access must be ordered before it, unless the memory was recorded on that stream
  (`record_stream`), as the allocator then keeps the block until that stream is done;
- allocating is a write by the allocating stream: another stream that fills new memory (a collective issued on
  the copy stream into a buffer the compute stream allocated) must have waited on the allocating stream.
A host thread that runs beside the one driving the device (the delayed update's, `thread_timeline`) is a
timeline of its own: its ops (a dispatch mode of that thread) and its waits are ordered after what the host did
before it started and before what the host does after it joined, and concurrent with the rest, so that the host
touching memory the thread writes (or writing memory it reads) in between is refused as any unordered stream is.

Host memory that the layer made (`host_empty`, `host_memory_empty`, `in_host_memory`) is the host's: an op on
host memory only runs on the host timeline; one that mixes host and device memory is a synchronous copy (the host
waits for the stream). Every other storage is the simulated device's, which `DeviceMemory` counts.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from hf_zero.settings import environment
from hf_zero.settings.environment import SIMULATE_ENV

COMPUTE, COMM, COPY, HOST = "compute", "comm", "copy", "host"  # the timelines the simulation knows


class PendingCopyError(RuntimeError):
    """The host touched a buffer that a queued device copy still reads or writes."""


class StreamOrderError(RuntimeError):
    """Two streams (or a stream and the host) touched the same memory, one writing, with no wait ordering them."""


def simulation() -> str | None:
    """How asynchronous work runs on CPU (tests: HF_ZERO_SIMULATE_ASYNC): "late", "early" or None (at once)."""
    return environment.simulation()


def simulating() -> bool:
    """Whether asynchronous work behaves as on a GPU (`simulation`), though it runs on CPU."""
    return simulation() is not None


_current = threading.local()  # the stream device work is queued on now (`stream`), and `quiet` depth


def stream_now() -> str:
    return getattr(_current, "stream", COMPUTE)


def _host_of_this_thread() -> str:
    """The host timeline of the calling thread: HOST, or a background thread's own (`thread_timeline`)."""
    return getattr(_current, "host_timeline", HOST)


def fork_thread_timeline() -> int | None:
    """Before a host thread starts work beside this one: an event on the host that the thread's timeline starts
    after (None when nothing is checked)."""
    return checker.record(HOST) if checker is not None else None


def thread_timeline(name: str, begun: int | None, work: Callable[[], None]) -> int | None:
    """Runs `work` in this thread as timeline `name`, after event `begun` (`fork_thread_timeline`); returns the
    event on that timeline at its end, which the host waits on when it joins the thread (`join_thread_timeline`)."""
    if begun is None or checker is None:
        work()
        return None
    with checker.lock:
        checker.threads.add(checker.stream(name))
    checker.wait(name, begun)
    # Ordered by its start and end events only: not issued by the host as it goes, as device work is.
    _current.host_timeline, _current.issued_earlier = name, True
    mode = _Dispatch()
    mode.start()
    try:
        work()
    finally:
        mode.stop()
        del _current.host_timeline, _current.issued_earlier
    return checker.record(name) if checker is not None else None


def join_thread_timeline(ended: int | None) -> None:
    """The host has joined a thread whose timeline ended at event `ended`."""
    if ended is not None and checker is not None:
        checker.wait(HOST, ended)


@contextlib.contextmanager
def on_stream(name: str) -> Iterator[None]:
    """Under the simulation, device work issued inside is queued on stream `name`, and work the copy engine left
    undelivered there is visible to it (stream order). Without it, nothing."""
    if not simulating():
        yield
        return
    previous, _current.stream = stream_now(), name
    engine.deliver_stream(name)
    try:
        yield
    finally:
        _current.stream = previous


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The ops inside are the simulation's own doing (a collective's data movement, a snapshot of a copy's
    values): the stream checker takes the accesses the device layer declares for them instead."""
    _current.quiet = getattr(_current, "quiet", 0) + 1
    try:
        yield
    finally:
        _current.quiet -= 1


# ---- memory ----------------------------------------------------------------------------------------
class _Storages:
    """Tensor storages, held weakly: a storage freed (and its address reused) drops out."""

    def __init__(self) -> None:
        self.refs: dict[int, StorageWeakRef] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.refs[storage._cdata] = StorageWeakRef(storage)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return self.holds(tensor.untyped_storage())

    def holds(self, storage: torch.UntypedStorage) -> bool:
        ref = self.refs.get(storage._cdata)
        return ref is not None and not ref.expired()

    def nbytes(self) -> int:
        """Bytes the live storages hold now (a storage resized to nothing holds none)."""
        total = 0
        for key, ref in list(self.refs.items()):
            if ref.expired():
                del self.refs[key]
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


host_storages = _Storages()  # host memory made by the layer, not the simulated device's
pinned = {"now": 0, "peak": 0}  # bytes of as-if-pinned buffers alive, and their peak


def in_host_memory(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make(), a tensor the caller places in host memory, counted so."""
    with _disable_current_modes():
        tensor = make()
    host_storages.add(tensor)
    return tensor


class _PinnedBytes(bytearray):
    """The memory of an as-if-pinned buffer (a bytearray subclass, so that it can be watched)."""


def _unpin(nbytes: int) -> None:
    pinned["now"] -= nbytes


def as_if_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty host buffer with the one property of pinned memory that the host can trip over, a storage that
    cannot be resized (`release_storage` cannot give it back in place), counted in `pinned` while it lives."""
    def make() -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        memory = _PinnedBytes(nbytes)
        pinned["now"] += nbytes
        pinned["peak"] = max(pinned["peak"], pinned["now"])
        weakref.finalize(memory, _unpin, nbytes)
        fixed = torch.frombuffer(memory, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return fixed.view(dtype)

    return in_host_memory(make)


class DeviceMemory:
    """While active, counts the memory allocated on the simulated device, as `max_memory_allocated` does on a
    GPU: every tensor storage an op creates, except host memory made by the layer, for as long as it lives, with
    its peak (`peak`). A storage given back by resizing (stage 3's freed units) counts as freed, and again once
    re-grown. What was allocated before it became active is not counted: it measures growth. It listens to the
    stream checker's dispatch mode, which it starts if needed."""

    def __init__(self) -> None:
        if not simulating():
            raise RuntimeError(f"DeviceMemory counts the simulated device's memory: set {SIMULATE_ENV}")
        self.storages = _Storages()
        self.peak = 0

    def __enter__(self) -> "DeviceMemory":
        _dispatch.listeners.append(self)
        _dispatch.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        _dispatch.listeners.remove(self)
        if checker is None and not _dispatch.listeners:
            _dispatch.stop()

    def observe(self, inputs: set[int], out: Any) -> None:
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" \
                    and tensor.untyped_storage()._cdata not in inputs and tensor not in self.storages \
                    and tensor not in host_storages:
                self.storages.add(tensor)
        self.peak = max(self.peak, self.storages.nbytes())


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the two tensors' memory spans share a byte."""
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    return a_lo < b_hi and b_lo < a_hi


def poison(tensor: torch.Tensor) -> None:
    """Fills `tensor` with what a buffer holds before device work fills it (NaN, or 0xA5 bytes)."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.view(torch.uint8).fill_(0xA5)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---- the stream checker ---------------------------------------------------------------------------
@dataclass
class _Access:
    stream: int
    seq: int
    write: bool
    lo: int  # bytes from the storage's start
    hi: int
    what: str


@dataclass(eq=False)
class _Record:
    """What the checker knows of one storage in its current life."""
    ref: Any  # weakref.ref to the storage; its callback is the storage's free
    alloc: int  # the stream that allocated it: a free is its write
    host: bool
    recorded: set[int] = field(default_factory=set)  # streams it was record_stream'ed on
    accesses: list[_Access] = field(default_factory=list)


def _where() -> str:
    """The innermost hf_zero frame outside the simulation (file:line in function), for messages."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "hf_zero" in path and not path.endswith(("simulated_gpu.py", "device.py", "comm.py")):
            return f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside hf_zero"


class StreamChecker:
    """Happens-before of every access to memory by stream (see the module's docstring). Streams are torch's
    CUDA sanitizer's vector clocks (`StreamSynchronizations`), the host one of them."""

    def __init__(self) -> None:
        from torch.cuda._sanitizer import StreamSynchronizations

        self.syncs = StreamSynchronizations()
        self.names: dict[int, str] = {0: COMPUTE}
        self.ids: dict[str, int] = {COMPUTE: 0}
        self.host = self.stream(HOST)
        self.threads: set[int] = set()  # host threads' timelines (`thread_timeline`)
        self.seq = 0
        self.records: dict[int, _Record] = {}
        self.event_ids = itertools.count(1)
        self.lock = threading.RLock()
        self.deferred: list[str] = []  # races found where nothing can raise (a storage freed by torch)
        # What the host waited on lately, in order: an event's id, or the name of a stream whose whole queue it waited
        # for (a value read back, a synchronous copy), which on a GPU leaves the device idle until the host queues more.
        self.host_waits: deque[int | str] = deque(maxlen=4096)
        # The thread whose ops the dispatch mode sees as the host's timeline; a background thread is a timeline of
        # its own (`thread_timeline`).
        self.thread = threading.current_thread()

    def stream(self, name: str) -> int:
        if name not in self.ids:
            sid = len(self.ids)
            self.ids[name], self.names[sid] = sid, name
            self.syncs.create_stream(sid)
        return self.ids[name]

    def _issue(self, sid: int) -> None:
        """A new op on stream `sid`: the host issues it after all the host did and waited for, except work the
        simulation runs later than the host issued it (`issued_earlier`), which carries its issue's order."""
        self._raise_deferred()
        if sid != self.host and not getattr(_current, "issued_earlier", False):
            state = self.syncs.current_sync_states
            self.syncs._state_wait_for_other(state[sid], state[self.host])
        self.seq += 1
        self.syncs.update_seq_num(sid, self.seq)

    def _raise_deferred(self) -> None:
        if self.deferred:
            messages, self.deferred = self.deferred, []
            raise StreamOrderError("; and ".join(messages))

    def access(self, stream: str, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str,
               fresh: set[int] = frozenset()) -> None:
        """An op on `stream` that reads and writes those tensors; `fresh`: storages it allocated."""
        with self.lock:
            sid = self.stream(_host_of_this_thread() if stream == HOST else stream)
            self._issue(sid)
            for tensor in reads:
                self._touch(tensor, sid, False, what, fresh)
            for tensor in writes:
                self._touch(tensor, sid, True, what, fresh)

    def _record(self, storage: torch.UntypedStorage, sid: int, fresh: set[int]) -> _Record:
        key = storage._cdata
        record = self.records.get(key)
        if record is None or record.ref() is not storage:
            host = host_storages.holds(storage)
            alloc = self.host if host else sid if key in fresh else self.ids[COMPUTE]
            record = _Record(None, alloc, host)
            record.ref = weakref.ref(storage, lambda _, key=key, record=record: self._freed(key, record))
            self.records[key] = record
        return record

    def _touch(self, tensor: torch.Tensor, sid: int, write: bool, what: str, fresh: set[int]) -> None:
        if tensor.numel() == 0:
            return
        record = self._record(tensor.untyped_storage(), sid, fresh)
        size = tensor.element_size()
        lo = tensor.storage_offset() * size
        hi = lo + size * (1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride())))
        kept = []
        for earlier in record.accesses:
            if earlier.lo < hi and lo < earlier.hi:
                if (write or earlier.write) and earlier.stream != sid and not self._ordered(sid, earlier):
                    self._refuse(earlier, sid, write, what, tensor)
                if (write or (not earlier.write and earlier.stream == sid)) and lo <= earlier.lo and earlier.hi <= hi:
                    continue  # superseded: whatever is ordered after this access is ordered after that one
            kept.append(earlier)
        where = what if sid == self.ids[COMPUTE] else f"{what} ({_where()})"
        kept.append(_Access(sid, self.seq, write, lo, hi, where))
        record.accesses = kept

    def _ordered(self, sid: int, earlier: _Access) -> bool:
        return self.syncs.is_ordered_after(sid, earlier.seq, earlier.stream)

    def _on(self, sid: int) -> str:
        if sid == self.host:
            return "on the host"
        return f"in the {self.names[sid]}" if self.names[sid].endswith("thread") else f"on the {self.names[sid]} stream"

    def _refuse(self, earlier: _Access, sid: int, write: bool, what: str, tensor: torch.Tensor) -> None:
        other = self.names[earlier.stream]
        remedy = (f"the host waits on the {other} stream's work first (Copy.wait, Event.synchronize)"
                  if sid == self.host else
                  f"the {self.names[sid]} stream waits on an event recorded on the {other} stream after it first "
                  f"(hf_zero.runtime.device: Event.wait, Copy.ready, the collective's wait(), CommStream.wait)")
        hint = "" if self.host not in (sid, earlier.stream) or host_storages.holds(tensor.untyped_storage()) else (
            ". The host touches the simulated device's memory here: memory meant to be the host's is made through "
            "hf_zero.runtime.device (host_memory_empty, host_empty, in_host_memory)")
        raise StreamOrderError(
            f"{what} ({_where()}) {self._on(sid)} {'writes' if write else 'reads'} "
            f"{tensor.numel():,} {str(tensor.dtype).removeprefix('torch.')} elements that {earlier.what} "
            f"{self._on(earlier.stream)} {'wrote' if earlier.write else 'read'}, and no wait orders the two: on a "
            f"GPU they may run in either order. Make sure {remedy}{hint}")

    def _freed(self, key: int, record: _Record) -> None:
        """torch freed a storage: a write of its allocating stream (where the allocator reuses it at once)."""
        with self.lock:
            if self.records.get(key) is record:
                del self.records[key]
            try:  # the last reference gone: a host thread that used it has let it go too
                self._check_free(record, "torch's free of a tensor", over=self.threads)
            except StreamOrderError as race:
                self.deferred.append(str(race))

    def _check_free(self, record: _Record, what: str, over: set[int] = frozenset()) -> None:
        """`over`: timelines whose accesses are over by now, besides the host's."""
        if record.host:  # pinned blocks go back only once their copies' events passed (the caching host allocator)
            return
        # The host's own accesses are over when it frees: they ran synchronously.
        for earlier in record.accesses:
            if earlier.stream not in (record.alloc, self.host, *over, *record.recorded) \
                    and not self._ordered(record.alloc, earlier):
                raise StreamOrderError(
                    f"{what} ({_where()}) gives memory back to the {self.names[record.alloc]} stream that allocated "
                    f"it while {earlier.what} on the {self.names[earlier.stream]} stream may still "
                    f"{'write' if earlier.write else 'read'} it: the allocator hands it to that stream's next "
                    f"allocation at once. Wait on the {self.names[earlier.stream]} stream first (or record the "
                    f"memory on it: record_stream)")

    def free(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor`'s storage goes back to the allocator (resized to nothing): checked as a write of its
        allocating stream; the memory it is given next is new."""
        with self.lock:
            self._raise_deferred()
            record = self._record(tensor.untyped_storage(), self.ids[COMPUTE], frozenset())
            self._check_free(record, what)
            record.accesses.clear()

    def allocated(self, tensor: torch.Tensor, stream: str) -> None:
        """`tensor`'s storage was given memory again, by `stream`."""
        with self.lock:
            record = self._record(tensor.untyped_storage(), self.ids[COMPUTE], frozenset())
            record.accesses.clear()
            record.alloc = self.host if record.host else self.stream(stream)  # host memory is the host's doing
            self._issue(record.alloc)
            record.accesses.append(_Access(record.alloc, self.seq, True, 0, tensor.untyped_storage().nbytes(),
                                           "its allocation"))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        with self.lock:
            self._record(tensor.untyped_storage(), self.ids[COMPUTE], frozenset()).recorded.add(self.stream(stream))

    def record(self, stream: str) -> int:
        """An event recorded on `stream` now; its id."""
        with self.lock:
            sid = self.stream(_host_of_this_thread() if stream == HOST else stream)
            event = next(self.event_ids)
            self.syncs.create_event(event)
            if sid != self.host and not getattr(_current, "issued_earlier", False):
                self.syncs._state_wait_for_other(self.syncs.current_sync_states[sid],
                                                 self.syncs.current_sync_states[self.host])
            self.syncs.record_state(event, sid)
            return event

    def wait(self, stream: str, event: int) -> None:
        """Stream `stream` waits on `event` (HOST: the host does, and so everything it issues later)."""
        stream = _host_of_this_thread() if stream == HOST else stream
        with self.lock:
            if stream == HOST:
                self.host_waits.append(event)
                self.syncs.all_streams_wait_for_event(event)
            else:
                self.syncs.stream_wait_for_event(self.stream(stream), event)

    def wait_stream(self, waiting: str, waited: str) -> None:
        """Stream `waiting` waits on the work queued so far on stream `waited`, as on an event recorded there now
        (HOST: the host does, and so everything it issues later)."""
        waiting = _host_of_this_thread() if waiting == HOST else waiting
        with self.lock:
            state = self.syncs.current_sync_states
            waited_id, waiting_id = self.stream(waited), self.stream(waiting)
            if waiting_id == self.host and waited_id != self.host:
                self.host_waits.append(waited)
            if waited_id != self.host and not getattr(_current, "issued_earlier", False):
                self.syncs._state_wait_for_other(state[waited_id], state[self.host])
            for stream in state if waiting_id == self.host else (waiting_id,):
                self.syncs._state_wait_for_other(state[stream], state[waited_id])

    def forget(self, event: int) -> None:
        """An event no one can wait on any more (its holder was collected)."""
        with self.lock:
            self.syncs.recorded_sync_states.pop(event, None)


checker: StreamChecker | None = None  # while checking (`start_checking`)


def start_checking() -> None:
    """Checks stream order from now on (the simulation "late"): every op torch runs in this thread, and every
    copy, collective, event and free of the device layer. Idempotent; `stop_checking` ends it."""
    global checker
    if simulation() != "late":
        return
    if checker is None:
        checker = StreamChecker()
    _dispatch.start()
    torch.Tensor.tolist = _read_back_tolist


def stop_checking() -> None:
    """Ends the check and forgets what it knew (a test leaving the simulation); raises the races found at torch's
    frees that no op came after to report."""
    global checker
    ending, checker = checker, None
    torch.Tensor.tolist = _tolist
    if not _dispatch.listeners:
        _dispatch.stop()
    if ending is not None:
        ending._raise_deferred()


_tolist = torch.Tensor.tolist


def _read_back_tolist(tensor: torch.Tensor) -> Any:
    """Tensor.tolist, which reads a CPU tensor's memory without an op the dispatch mode sees: from the simulated
    device's memory that is a value read back, as `.item()` is (on a GPU a copy the host waits for)."""
    plain = _plain(tensor)
    if checker is not None and plain is not None and not host_storages.holds(plain.untyped_storage()) \
            and not getattr(_current, "quiet", 0):
        stream = stream_now()
        checker.access(stream, [plain], [], "Tensor.tolist")
        checker.wait_stream(HOST, stream)
    return _tolist(tensor)


@contextlib.contextmanager
def issued_earlier() -> Iterator[None]:
    """The ops inside run later than the host issued them (a reduction the simulation "late" runs at its wait):
    what the host did since does not order them; the event they first wait on carries their issue's order."""
    previous, _current.issued_earlier = getattr(_current, "issued_earlier", False), True
    try:
        yield
    finally:
        _current.issued_earlier = previous


# Ops that change a tensor's metadata, or set it to other memory, without touching the data.
_METADATA_OPS = {"aten::set_", "aten::resize_", "aten::resize_as_", "aten::as_strided_", "aten::detach_",
                 "aten::t_", "aten::transpose_", "aten::squeeze_", "aten::unsqueeze_", "aten::swapdims_",
                 "aten::record_stream"}
_FACTORY = re.compile(r"aten::(new_.*|.*_like)$")  # as torch's CUDA sanitizer tells factories
# Ops after which the host has waited for the stream: a value read back to the host.
_SYNCHRONIZING_OPS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero", "aten::nonzero",
                      "aten::unique_consecutive", "aten::_unique2", "aten::masked_select"}


def _plain(value: Any) -> torch.Tensor | None:
    """The tensor whose memory an op argument reads or writes (a DTensor's local part), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    value = getattr(value, "_local_tensor", value)
    if value.device.type == "meta" or value.layout != torch.strided:
        return None
    return value


class _Dispatch(TorchDispatchMode):
    """The stream checker's view of every op torch runs in this thread (and `DeviceMemory`'s): on the stream
    queuing work now, or the host's when it touches only host memory."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[DeviceMemory] = []
        self.active = False

    def start(self) -> None:
        if not self.active:
            from torch.cuda._sanitizer import (
                zip_arguments,  # a private module: imported only to check
            )

            self.zip_arguments = zip_arguments
            self.__enter__()
            self.active = True

    def stop(self) -> None:
        if self.active:
            self.__exit__(None, None, None)
            self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = checker is not None and not getattr(_current, "quiet", 0) and func.namespace == "aten" \
            and func._schema.name not in _METADATA_OPS
        factory = _FACTORY.match(func._schema.name) is not None  # reads its inputs' metadata only
        if not check and not self.listeners:
            return func(*args, **kwargs)
        reads, writes, inputs = [], [], set()
        for argument, value in self.zip_arguments(func._schema, args, kwargs):
            writing = argument.alias_info is not None and argument.alias_info.is_write
            metadata = factory or argument.alias_info is not None and not writing
            for leaf in tree_leaves(value):
                tensor = _plain(leaf)
                if tensor is not None:
                    inputs.add(tensor.untyped_storage()._cdata)
                    if writing:
                        writes.append(tensor)
                    elif not metadata:
                        reads.append(tensor)
        out = func(*args, **kwargs)
        for listener in self.listeners:
            listener.observe(inputs, out)
        if not check:
            return out
        # An op on host memory only is the host's, and what it makes is host memory too.
        on_host = [host_storages.holds(t.untyped_storage()) for t in reads + writes]
        stream = HOST if on_host and all(on_host) else stream_now()
        fresh = set()
        for leaf in tree_leaves(out):
            tensor = _plain(leaf)
            if tensor is not None and tensor.untyped_storage()._cdata not in inputs:
                fresh.add(tensor.untyped_storage()._cdata)
                writes.append(tensor)
                if stream == HOST:
                    host_storages.add(tensor)
        checker.access(stream, reads, writes, func._schema.name, fresh)
        if (any(on_host) and stream != HOST) or func._schema.name in _SYNCHRONIZING_OPS:
            checker.wait_stream(HOST, stream)  # a synchronous copy, or a value read back: the host waited
        return out


_dispatch = _Dispatch()


# ---- the copy engine ------------------------------------------------------------------------------
@dataclass(eq=False)
class QueuedCopy:
    """A copy the simulation holds back (`CopyEngine`)."""
    name: str
    host: torch.Tensor  # the source of a copy to the device, the destination of one to the host
    to_device: bool
    stream: str
    event: int | None = None  # the stream checker's event recorded after it
    snapshot: torch.Tensor | None = None  # the values the copy moves, as they were when queued
    poison: torch.Tensor | None = None  # to the host: what the destination holds until it lands
    undelivered: torch.Tensor | None = None  # to the device on another stream: the destination, poison until then
    landed: bool = False
    ordered_before: set[str] = field(default_factory=set)  # streams that waited on this one's after it was queued

    def __del__(self) -> None:
        if self.event is not None and checker is not None:
            checker.forget(self.event)


class CopyEngine:
    """Copies queued in order on each simulated stream, landing as late as a GPU may land them."""

    def __init__(self) -> None:
        self.queued: list[QueuedCopy] = []  # every stream's, in the order queued
        self.lock = threading.Lock()

    def queue(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, stream: str) -> QueuedCopy:
        host = src if to_device else dst
        with quiet():
            if checker is not None:
                if stream != stream_now():  # a side stream's copy follows what was queued so far (device.py)
                    checker.wait_stream(stream, stream_now())
                checker.access(stream, [src], [dst], f"the copy of {name}")
            event = checker.record(stream) if checker is not None else None
            if simulation() == "early":
                dst.copy_(src)
                return QueuedCopy(name, host, to_device, stream, event, landed=True)
            with self.lock:
                for earlier in [c for c in self.queued if overlaps(c.host, host)]:
                    if earlier.stream == stream or stream in earlier.ordered_before:
                        self._land_through(earlier)  # device work is stream-ordered: the earlier copy lands first
                    elif not (to_device and earlier.to_device):  # two reads of a host buffer do not race
                        raise PendingCopyError(
                            f"{name} is queued on the {stream} stream while {earlier.name}, on the "
                            f"{earlier.stream} stream, still uses the same host memory, and no wait "
                            f"orders the two: wait on the earlier copy first")
                copy = QueuedCopy(name, host, to_device, stream, event, snapshot=src.detach().clone())
                if not to_device:
                    poison(dst)
                    copy.poison = dst.detach().clone()
                elif stream == stream_now():
                    dst.copy_(src)  # later device work on the same stream is ordered after the copy
                else:
                    poison(dst)
                    copy.undelivered = dst
                self.queued.append(copy)
            return copy

    def order(self, waited: str, waiting: str) -> None:
        """Stream `waiting` waited on stream `waited`: its later copies come after every copy queued there."""
        with self.lock:
            for copy in self.queued:
                if copy.stream == waited:
                    copy.ordered_before.add(waiting)

    def ready(self, copy: QueuedCopy) -> None:
        """The stream queuing work now waits on `copy`: its destination holds the values (for every stream: the
        stream checker refuses the streams that did not wait)."""
        if checker is not None and copy.event is not None:
            checker.wait(stream_now(), copy.event)
        with self.lock, quiet():
            self._deliver(copy)

    def deliver_stream(self, stream: str) -> None:
        """Work is issued on `stream`: the copies queued there before it are its to read."""
        if self.queued:
            with self.lock, quiet():
                for copy in self.queued:
                    if copy.stream == stream:
                        self._deliver(copy)

    @staticmethod
    def _deliver(copy: QueuedCopy) -> None:
        if copy.undelivered is not None:
            copy.undelivered.copy_(copy.snapshot)
            copy.undelivered = None

    def check_access(self, tensor: torch.Tensor, writing: bool) -> None:
        with self.lock:
            for copy in self.queued:
                if overlaps(tensor, copy.host) and (writing or not copy.to_device):
                    what = ("reads it, to the device" if copy.to_device else "will fill it, from the device")
                    raise PendingCopyError(f"the host {'writes' if writing else 'reads'} {copy.name} while a queued "
                                           f"copy still {what}: wait on the copy first")
        if checker is not None and (threading.current_thread() is checker.thread or
                                    _host_of_this_thread() != HOST):
            checker.access(HOST, [] if writing else [tensor], [tensor] if writing else [], "the host")

    def land_through(self, copy: QueuedCopy) -> None:
        """The host waits on `copy`: it and every copy queued before it on its stream land."""
        if checker is not None and copy.event is not None:
            checker.wait(HOST, copy.event)
        with self.lock, quiet():
            self._land_through(copy)

    def _land_through(self, copy: QueuedCopy) -> None:
        if copy in self.queued:
            on_its_stream = [c for c in self.queued if c.stream == copy.stream]
            for earlier in on_its_stream[:on_its_stream.index(copy) + 1]:
                self._land(earlier)
                self.queued.remove(earlier)
        copy.landed = True

    def _land(self, copy: QueuedCopy) -> None:
        """Checks that the host kept its hands off the copy's host buffer, then lands it."""
        if copy.to_device:
            if not same_bytes(copy.host, copy.snapshot):
                raise PendingCopyError(f"{copy.name} was written by the host while a queued copy still read it, "
                                       f"to the device: wait on the copy first")
            self._deliver(copy)
        else:
            if not same_bytes(copy.host, copy.poison):
                raise PendingCopyError(f"{copy.name} was written by the host while a queued copy from the device "
                                       f"still had to fill it: wait on the copy first")
            copy.host.copy_(copy.snapshot)
        copy.landed = True


engine = CopyEngine()
