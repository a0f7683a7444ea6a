"""The stream checker (`StreamChecker`), under the simulation "late": a sanitizer of stream order, as torch's CUDA
sanitizer (torch.cuda._sanitizer, whose vector clocks it reuses) is on a GPU. Every op torch runs (a dispatch
mode, hf_zero/testing/dispatch.py), every copy, collective, event and free the device layer makes is an access to
memory by a stream: the compute, communication and copy streams, one stream per process group's collectives (NCCL
runs each group's on a stream of its own), and the host. Each storage keeps its last writer and the readers since,
by stream. An access from one stream to bytes another stream wrote (or, writing, read) is refused with
`StreamOrderError` unless a wait orders the two: an event recorded on the other stream after its access and waited
on by this stream (`Event.wait`, `Copy.ready`, a collective's `wait()`, `CommStream.wait`), or by the host
(`Copy.wait`), since the host issues every later op. So:
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
waits for the stream).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_zero.runtime.timeline import COMPUTE
from hf_zero.testing.memory import host_storages
from hf_zero.testing.streams import HOST, host_of_this_thread, is_issued_earlier


class StreamOrderError(RuntimeError):
    """Two streams (or a stream and the host) touched the same memory, one writing, with no wait ordering them."""


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




# Frames of the simulation and of the device layer it plays: messages name the innermost frame outside them.
_DEVICE_LAYER = (os.path.join("hf_zero", "testing", ""),
                 *(os.path.join("hf_zero", "runtime", name) for name in ("device.py", "timeline.py", "comm.py")))


def _where() -> str:
    """The innermost hf_zero frame outside the simulation (file:line in function), for messages."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "hf_zero" in path and not any(part in path for part in _DEVICE_LAYER):
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
        self.raise_deferred()
        if sid != self.host and not is_issued_earlier():
            state = self.syncs.current_sync_states
            self.syncs._state_wait_for_other(state[sid], state[self.host])
        self.seq += 1
        self.syncs.update_seq_num(sid, self.seq)

    def raise_deferred(self) -> None:
        if self.deferred:
            messages, self.deferred = self.deferred, []
            raise StreamOrderError("; and ".join(messages))

    def access(self, stream: str, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str,
               fresh: set[int] = frozenset()) -> None:
        """An op on `stream` that reads and writes those tensors; `fresh`: storages it allocated."""
        with self.lock:
            sid = self.stream(host_of_this_thread() if stream == HOST else stream)
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
            self.raise_deferred()
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
            sid = self.stream(host_of_this_thread() if stream == HOST else stream)
            event = next(self.event_ids)
            self.syncs.create_event(event)
            if sid != self.host and not is_issued_earlier():
                self.syncs._state_wait_for_other(self.syncs.current_sync_states[sid],
                                                 self.syncs.current_sync_states[self.host])
            self.syncs.record_state(event, sid)
            return event

    def wait(self, stream: str, event: int) -> None:
        """Stream `stream` waits on `event` (HOST: the host does, and so everything it issues later)."""
        stream = host_of_this_thread() if stream == HOST else stream
        with self.lock:
            if stream == HOST:
                self.host_waits.append(event)
                self.syncs.all_streams_wait_for_event(event)
            else:
                self.syncs.stream_wait_for_event(self.stream(stream), event)

    def wait_stream(self, waiting: str, waited: str) -> None:
        """Stream `waiting` waits on the work queued so far on stream `waited`, as on an event recorded there now
        (HOST: the host does, and so everything it issues later)."""
        waiting = host_of_this_thread() if waiting == HOST else waiting
        with self.lock:
            state = self.syncs.current_sync_states
            waited_id, waiting_id = self.stream(waited), self.stream(waiting)
            if waiting_id == self.host and waited_id != self.host:
                self.host_waits.append(waited)
            if waited_id != self.host and not is_issued_earlier():
                self.syncs._state_wait_for_other(state[waited_id], state[self.host])
            for stream in state if waiting_id == self.host else (waiting_id,):
                self.syncs._state_wait_for_other(state[stream], state[waited_id])

    def forget(self, event: int) -> None:
        """An event no one can wait on any more (its holder was collected)."""
        with self.lock:
            self.syncs.recorded_sync_states.pop(event, None)


checker: StreamChecker | None = None  # while checking (hf_zero.testing.simulated_gpu.install)
