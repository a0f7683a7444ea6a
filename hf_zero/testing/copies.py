"""The copy engine of the simulated GPU (`CopyEngine`, values). Under "late" (or "1") asynchronous work lands as late
as a GPU may land it:
- host to device: the destination receives the values at once when the copy is on the stream queuing work now
  (later work there is stream-ordered), else only when a stream waits on it (`Copy.ready`), work is issued on
  its stream, or the host waits; it holds poison (NaN) until then. The source stays lent to the copy until the
  host waits on it: writing into it meanwhile (through file I/O, the C++ kernel, or torch) is caught.
- device to host: the destination holds poison until the copy is waited on, and receives the values the
  source had when the copy was queued. Reading or writing it meanwhile is caught.
- an asynchronous collective (hf_zero.runtime.comm) runs when waited on (`HeldCollective`), its outputs poison until
  then, and its inputs must not change meanwhile.
"early": a copy runs the moment it is issued, as a GPU with an idle side stream runs it: code that counts on it not
having run yet shows as a wrong result.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hf_zero.testing import stream_checker
from hf_zero.testing.streams import HOST, host_of_this_thread, quiet, simulation, stream_now


class PendingCopyError(RuntimeError):
    """The host touched a buffer that a queued device copy still reads or writes."""


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
        checker = getattr(stream_checker, "checker", None)  # None too at the interpreter's exit
        if self.event is not None and checker is not None:
            checker.forget(self.event)


class CopyEngine:
    """Copies queued in order on each simulated stream, landing as late as a GPU may land them."""

    def __init__(self) -> None:
        self.queued: list[QueuedCopy] = []  # every stream's, in the order queued
        self.lock = threading.Lock()

    def queue(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, stream: str) -> QueuedCopy:
        host, checker = (src if to_device else dst), stream_checker.checker
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
        checker = stream_checker.checker
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
        checker = stream_checker.checker
        if checker is not None and (threading.current_thread() is checker.thread or host_of_this_thread() != HOST):
            checker.access(HOST, [] if writing else [tensor], [tensor] if writing else [], "the host")

    def land_through(self, copy: QueuedCopy) -> None:
        """The host waits on `copy`: it and every copy queued before it on its stream land."""
        checker = stream_checker.checker
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


class HeldCollective:
    """Simulation "late": an asynchronous collective (hf_zero.runtime.comm) that runs only when waited on, as late as
    NCCL may finish it (NCCL's wait() does not block the host, so a reader that skips it reads whatever the
    buffer held). Until then its outputs hold poison, and its inputs must keep the values they had when it was
    issued; an input that shares memory with an output (an in-place all-gather's own part, an all-reduce) gets
    them back before it runs."""

    def __init__(self, launch: Callable[[], Any], reads: list[torch.Tensor], writes: list[torch.Tensor],
                 what: Callable[[], str]) -> None:
        self.launch, self.what, self.done = launch, what, False
        self.reads = [(t, t.detach().clone()) for t in reads]
        for output in writes:
            poison(output)
        self.poisoned = [(t, t.detach().clone()) for t in writes]

    def wait(self) -> bool:
        if not self.done:
            for tensor, issued in self.reads:
                shared = any(overlaps(tensor, output) for output, _ in self.poisoned)
                if not shared and not same_bytes(tensor, issued):
                    raise PendingCopyError(f"{self.what()}: an input was written while the collective could still "
                                           f"read it: wait on the collective first")
            for output, poisoned in self.poisoned:
                if not same_bytes(output, poisoned):
                    raise PendingCopyError(f"{self.what()}: an output was written while the collective could "
                                           f"still fill it: wait on the collective first")
            for tensor, issued in self.reads:
                tensor.copy_(issued)
            self.launch().wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done
