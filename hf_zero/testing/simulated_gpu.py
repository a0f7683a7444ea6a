"""The GPU played on CPU: how the tests check hf_zero.runtime.device's GPU path on a machine without one.

On CPU every copy is immediate and every op runs in program order, so a missing wait can never show.
`HF_ZERO_SIMULATE_ASYNC` makes the CPU behave as a GPU would at its most unlucky, in two ways:
- values, the copy engine (hf_zero/testing/copies.py): under "late" (or "1") copies, reductions on the
  communication stream and asynchronous collectives land as late as a GPU may land them, their destinations
  poison until then; under "early" they run whole the moment they are issued;
- order, the stream checker (hf_zero/testing/stream_checker.py, fed every op torch runs by
  hf_zero/testing/dispatch.py), under "late": any access to memory that no wait orders after another stream's is
  refused, as torch's CUDA sanitizer refuses it on a GPU.

Both plug into the device layer as its timeline (`SimulatedTimeline`, the strategy of hf_zero/runtime/timeline.py),
as torch's CUDA sanitizer attaches to torch's streams through callbacks: `install` puts it in place, from a test's
setup or from the device layer's one plug point at the first device work under the variable (a rank's start), and
under "late" starts the stream checker; `uninstall` takes both out. No other production module names this package.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from hf_zero.runtime import device
from hf_zero.runtime.timeline import COMM, COMPUTE, COPY, NO_WORK, Copy, Event, Timeline
from hf_zero.runtime.timeline import HOST as HOST_DEVICE
from hf_zero.testing import stream_checker, streams
from hf_zero.testing.copies import CopyEngine, HeldCollective, PendingCopyError, QueuedCopy, engine
from hf_zero.testing.dispatch import DeviceMemory, seen_in_this_thread, start_checking, stop_checking
from hf_zero.testing.memory import as_if_pinned, in_host_memory, pinned
from hf_zero.testing.stream_checker import StreamOrderError
from hf_zero.testing.streams import HOST, as_host_timeline, queued_on, simulating, simulation, stream_now

# What tests reach for, besides `install` and `uninstall`.
__all__ = ["COMM", "COMPUTE", "COPY", "HOST", "CopyEngine", "DeviceMemory", "PendingCopyError", "StreamOrderError",
           "as_if_pinned", "engine", "on_stream", "pinned", "simulating", "simulation"]


@contextlib.contextmanager
def on_stream(name: str) -> Iterator[None]:
    """Under the simulation, device work issued inside is queued on stream `name`, and work the copy engine left
    undelivered there is visible to it (stream order). Without it, nothing."""
    if not simulating():
        yield
        return
    with queued_on(name):
        engine.deliver_stream(name)
        yield


class CheckedEvent(Event):
    """The stream checker's event (its id): the work queued on one stream up to where it was recorded."""

    def __init__(self, event_id: int) -> None:
        self.id = event_id

    def wait(self) -> None:
        if stream_checker.checker is not None:
            stream_checker.checker.wait(stream_now(), self.id)

    def synchronize(self) -> None:
        if stream_checker.checker is not None:
            stream_checker.checker.wait(HOST, self.id)

    def __del__(self) -> None:
        checker = getattr(stream_checker, "checker", None)  # None too at the interpreter's exit
        if checker is not None:
            checker.forget(self.id)


def _recorded(stream: str) -> Event:
    """An event recorded on `stream` now, when the stream checker runs."""
    checker = stream_checker.checker
    return NO_WORK if checker is None else CheckedEvent(checker.record(stream))


class Landing(Event):
    """When a copy the copy engine holds back (`queued`) lands: a stream's wait on it delivers its values there, the
    host's lands it and every copy queued before it on its stream."""

    def __init__(self, queued: QueuedCopy) -> None:
        self.queued = queued

    def wait(self) -> None:
        engine.ready(self.queued)

    def synchronize(self) -> None:
        engine.land_through(self.queued)

    def query(self) -> bool:
        return self.queued.landed


def _thread_timeline(name: str, begun: int | None, work: Callable[[], None]) -> int | None:
    """Runs `work` in this thread as timeline `name`, after event `begun` (recorded on the host when it was
    submitted); returns the event on that timeline at its end, which the host waits on when it joins the thread."""
    checker = stream_checker.checker
    if begun is None or checker is None:
        work()
        return None
    with checker.lock:
        checker.threads.add(checker.stream(name))
    checker.wait(name, begun)
    with as_host_timeline(name), seen_in_this_thread():
        work()
    ending = stream_checker.checker  # the check may have ended meanwhile
    return ending.record(name) if ending is not None else None


class SimulatedTimeline(Timeline):
    """hf_zero.runtime.device's work as a GPU would run it at its most unlucky, on CPU (the module's docstring)."""

    separate_memory = True  # the simulated device's memory is apart from the host's

    @property
    def late(self) -> bool:
        return simulation() == "late"

    @property
    def early(self) -> bool:
        return simulation() == "early"

    # ---- events and streams
    def record(self, device: torch.device) -> Event:
        return _recorded(stream_now())

    @contextlib.contextmanager
    def on_copy_stream(self, device: torch.device) -> Iterator[None]:
        if stream_checker.checker is not None:
            stream_checker.checker.wait_stream(COPY, stream_now())
        with on_stream(COPY):
            yield

    def on_stream(self, name: str) -> contextlib.AbstractContextManager:
        return on_stream(name)

    def issued_earlier(self) -> contextlib.AbstractContextManager:
        return streams.issued_earlier()

    def compute_waited_on(self, stream: str) -> None:
        engine.order(stream, COMPUTE)

    # ---- copies
    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
        host, on_device = (src, dst) if to_device else (dst, src)
        stream = COPY if overlap else stream_now()
        if overlap and stream_checker.checker is not None:
            stream_checker.checker.record_stream(on_device, COPY)
        return Copy(name, host, to_device, Landing(engine.queue(dst, src, name, to_device, stream)), stream)

    def host_copy(self, src: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        checker = stream_checker.checker
        if checker is not None:  # synchronous: the host waits for the stream, which reads the source
            checker.access(stream_now(), [src], [], "a synchronous copy to the host")
            checker.wait_stream(HOST, stream_now())
        return in_host_memory(lambda: src.to(HOST_DEVICE, dtype, copy=True).contiguous())

    # ---- allocation and free
    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return as_if_pinned(numel, dtype)

    def host_block(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return as_if_pinned(numel, dtype)

    def host_memory(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        return in_host_memory(make)

    def pinned_bytes(self) -> tuple[int, int]:
        return pinned["now"], pinned["peak"]

    def reset_pinned_peak(self) -> None:
        pinned["peak"] = pinned["now"]

    def released(self, tensor: torch.Tensor, what: str) -> None:
        if stream_checker.checker is not None:
            stream_checker.checker.free(tensor, what)

    def allocated(self, tensor: torch.Tensor) -> None:
        if stream_checker.checker is not None:
            stream_checker.checker.allocated(tensor, stream_now())

    # ---- collectives
    def collective_issued(self, group: str, reads: list[torch.Tensor], writes: list[torch.Tensor],
                          what: str) -> Event:
        checker = stream_checker.checker
        if checker is None:
            return NO_WORK
        stream = f"collectives of {group}"
        checker.wait_stream(stream, stream_now())
        checker.access(stream, reads, writes, what)
        return _recorded(stream)

    def quiet(self) -> contextlib.AbstractContextManager:
        return streams.quiet() if stream_checker.checker is not None else contextlib.nullcontext()

    def held_back(self, launch: Callable[[], Any], reads: list[torch.Tensor], writes: list[torch.Tensor],
                  what: Callable[[], str]) -> Any:
        return HeldCollective(launch, reads, writes, what)

    # ---- the host
    def check_host_access(self, tensor: torch.Tensor, writing: bool) -> None:
        engine.check_access(tensor, writing)

    def run_beside(self, pool: ThreadPoolExecutor, work: Callable[[], None], name: str) -> Future:
        checker = stream_checker.checker
        begun = checker.record(HOST) if checker is not None else None
        return pool.submit(_thread_timeline, name, begun, work)

    def joined(self, running: Future) -> None:
        ended = running.result()
        if ended is not None and stream_checker.checker is not None:
            stream_checker.checker.wait(HOST, ended)


TIMELINE = SimulatedTimeline()


def install(check_order: bool = True) -> None:
    """Plays the GPU on CPU from now on, while HF_ZERO_SIMULATE_ASYNC is set: hf_zero.runtime.device queues its work
    on the simulated timeline, and under "late" the stream checker checks the order of every op in this thread
    (not when `check_order` is False: a test that reads a destination before its wait to see what it holds)."""
    device.install(TIMELINE)
    if check_order:
        start_checking()


def uninstall() -> None:
    """Takes the simulated GPU out (a test leaving the simulation): the stream checker ends and forgets what it
    knew, raising the races found at torch's frees that no op came after to report. Device work under
    HF_ZERO_SIMULATE_ASYNC afterwards installs it anew."""
    device.install(None)
    stop_checking()
