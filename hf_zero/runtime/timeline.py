"""What a timeline of device work does, as one strategy (`Timeline`) that the device layer (hf_zero.runtime.device)
asks for each thing it does: record and wait events, copies, collectives, reductions, allocation and free, host
access. Its own methods are the CPU's, where every op runs at once, in program order, on the one timeline of the
host (`IMMEDIATE`). CUDA's streams and events are `Cuda` (hf_zero/runtime/cuda_timeline.py). A test double that
plays a GPU on CPU implements the same strategy and is installed from outside, through the device layer's one plug
point: the runtime never names it, as torch's stream code never names the CUDA sanitizer that attaches to it.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_zero.runtime.files import DISK, Files
from hf_zero.runtime.pinned import page_locked

HOST = torch.device("cpu")
# The streams device work is queued on: the compute stream (the default), the communication stream (what a
# reduction's landing does, `CommStream`) and the copy stream (copies that must not hold up the compute queued
# after them).
COMPUTE, COMM, COPY = "compute", "comm", "copy"


class Event:
    """The work queued on one stream up to the point it was recorded (`Timeline.record`). This one: none, so there
    is nothing to wait for; each timeline records its own kind."""

    def wait(self) -> None:
        """The stream the caller queues on now waits for the event's work (the host does not)."""

    def synchronize(self) -> None:
        """The host waits for the event's work (and so does everything it queues later)."""

    def query(self) -> bool:
        """Whether the event's work is done."""
        return True


NO_WORK = Event()


@dataclass(eq=False)
class Copy:
    """A queued copy. `wait()` blocks the host until it (and every copy queued before it) has landed."""
    name: str
    host: torch.Tensor  # the host side: the source of a copy to the device, the destination of one to the host
    to_device: bool
    event: Event = NO_WORK  # recorded after it, on its stream
    stream: str = COMPUTE

    @property
    def landed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        """The host waits until the copy (and every copy queued before it on its stream) has landed."""
        self.event.synchronize()

    def ready(self) -> None:
        """The stream the caller queues on now waits for the copy (its destination may be read there); the host
        does not: the source of a copy to the device stays lent until `wait`."""
        self.event.wait()


DONE = Copy("done", torch.empty(0), to_device=True)


class Timeline:
    """What device work does on one kind of machine. The methods here run it as the CPU does, synchronously;
    `Cuda` and the simulated GPU override what their machine does otherwise."""

    # Asynchronous work (a reduction handed to the communication stream, an asynchronous collective) runs only when
    # waited on, as late as a GPU may run it (`late`), or whole the moment it is issued (`early`).
    late = False
    early = False
    # Whether device memory is apart from the host's though both are the CPU's: host tensors are then always copied.
    separate_memory = False
    # Whether tensors hold memory the host's C++ kernels can read (CPU Adam): not a plan's, whose tensors have a
    # size and no memory (hf_zero.plan); torch's own ops stand in for the kernels there.
    host_kernels = True

    # ---- events and streams
    def record(self, device: torch.device) -> Event:
        """An event for the work queued so far on the stream the caller queues on now, of `device`."""
        return NO_WORK

    def on_copy_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Device work issued inside runs on `device`'s copy stream, after the work queued so far on the stream the
        caller was on (hf_zero.runtime.device.on_copy_stream)."""
        return contextlib.nullcontext()

    def on_stream(self, name: str) -> contextlib.AbstractContextManager:
        """Device work issued inside on the host's own queue of reductions runs on stream `name`."""
        return contextlib.nullcontext()

    def issued_earlier(self) -> contextlib.AbstractContextManager:
        """The work inside runs later than the host issued it (a reduction run at its wait): what the host did since
        does not order it."""
        return contextlib.nullcontext()

    def compute_waited_on(self, stream: str) -> None:
        """The compute stream waited on everything queued on `stream` so far: its later copies come after them."""

    # ---- copies
    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
        """Queues dst <- src, to the device or to the host; `overlap`: on the copy stream."""
        dst.copy_(src)  # within host memory a copy is ordered like any other work
        return DONE

    def host_copy(self, src: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """`src` in ordinary host memory (as `dtype`), filled when this returns: itself when it is there."""
        return src.to(HOST, dtype).contiguous()

    # ---- allocation and free
    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host buffer that copies reuse, from the caching host allocator, pinned where `pinned`."""
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def host_block(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host buffer kept for the whole run, of exactly `numel` elements, page-locked where `pinned`."""
        return page_locked(numel, dtype) if pinned else torch.empty(numel, dtype=dtype)

    def host_memory(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """make(), a tensor the caller places in ordinary host memory."""
        return make()

    def pinned_bytes(self) -> tuple[int, int]:
        """(now, peak since `reset_pinned_peak`) bytes of page-locked host memory this process holds."""
        return 0, 0

    def reset_pinned_peak(self) -> None:
        """The peak `pinned_bytes` reports starts again from what is pinned now."""

    def memory_left(self) -> tuple[int, str] | None:
        """The bytes the device has left and where that figure comes from, where the timeline knows (a plan's
        simulated device); None: the machine's own (hf_zero.runtime.memory.memory_left)."""
        return None

    def released(self, tensor: torch.Tensor, what: str) -> None:
        """`tensor`'s memory is about to go back to the allocator (`what` gives it back)."""

    def allocated(self, tensor: torch.Tensor) -> None:
        """`tensor` was given memory again, by the stream the caller queues on now."""

    # ---- collectives
    def collective_issued(self, group: str, reads: list[torch.Tensor], writes: list[torch.Tensor],
                          what: str) -> Event:
        """A collective of process group `group` is issued now, reading `reads` and writing `writes`; the event
        of its end, which its handle's wait() makes the waiting stream wait on (hf_zero.runtime.device)."""
        return NO_WORK

    def quiet(self) -> contextlib.AbstractContextManager:
        """The ops inside move a collective's data as its backend does (declared by `collective_issued`)."""
        return contextlib.nullcontext()

    def held_back(self, launch: Callable[[], Any], reads: list[torch.Tensor], writes: list[torch.Tensor],
                  what: Callable[[], str]) -> Any:
        """The handle of an asynchronous collective that a `late` timeline launches only at its wait."""
        raise NotImplementedError(f"{type(self).__name__} runs no collective late")

    # ---- the host
    def check_host_access(self, tensor: torch.Tensor, writing: bool) -> None:
        """Raises when the host may not yet read (or write) `tensor` (file I/O and the C++ kernels ask)."""

    def run_beside(self, pool: ThreadPoolExecutor, work: Callable[[], None], name: str) -> Future:
        """Submits `work` to `pool`'s thread, beside the thread that drives the device; `joined` waits for it."""
        return pool.submit(work)

    def joined(self, running: Future) -> None:
        """Waits for work `run_beside` submitted, re-raising its error."""
        running.result()

    # ---- files
    def files(self) -> Files:
        """Where ZeRO-Infinity's NVMe states are kept: the disk (hf_zero.runtime.files)."""
        return DISK


IMMEDIATE = Timeline()
