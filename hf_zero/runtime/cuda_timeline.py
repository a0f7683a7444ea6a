"""The timeline of a CUDA device (`Cuda`): streams, the events that order them, non-blocking copies, and the
page-locked host memory the copies use. Work on host tensors (the ranks of a gloo group beside a GPU) runs as on
the CPU (`Timeline`'s own methods).

HF_ZERO_CUDA_DELAY (tests/test_gpu.py): "STREAM:CYCLES" queues CYCLES of `torch.cuda._sleep` on one side, so that a
missing wait reads or writes a buffer too early and shows as a wrong number, the GPU's own version of the
simulation. STREAM "compute": before every asynchronous copy and every reduction's hand-over, so copies land late
and backward writes its buckets late (a reduction that does not wait on the compute stream reads a bucket too
early; a host that does not wait on a copy reads or writes its buffer too early). STREAM "comm": before every
reduction on the communication stream (compute that does not wait on it reads its result early). STREAM "copy":
before every copy and every op issued on the copy stream (compute that does not wait on one reads its destination
early).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hf_zero.runtime import pinned
from hf_zero.runtime.timeline import COPY, NO_WORK, Copy, Event, Timeline
from hf_zero.settings.environment import cuda_delay


class CudaEvent(Event):
    """A CUDA event recorded on a stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


def delay(stream: str) -> None:
    """Queues HF_ZERO_CUDA_DELAY's cycles of device sleep on the current stream when it names `stream`."""
    chosen = cuda_delay()
    if chosen is not None and chosen[0] == stream:
        torch.cuda._sleep(chosen[1])


@contextlib.contextmanager
def after_current(side: torch.cuda.Stream, name: str) -> Iterator[None]:
    """Device work issued inside runs on stream `side` (named `name` for HF_ZERO_CUDA_DELAY), after the work queued
    so far on the current stream, which wrote what it reads or used the memory the allocator gave what it fills."""
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        delay(name)
        yield


class Cuda(Timeline):
    """CUDA streams and events; copies between host and device are non-blocking."""

    def __init__(self) -> None:
        self.copy_streams: dict[int, torch.cuda.Stream] = {}  # one per device, made on first use

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.copy_streams:
            self.copy_streams[index] = torch.cuda.Stream(index)
        return self.copy_streams[index]

    def record(self, device: torch.device) -> Event:
        if device.type != "cuda":
            return NO_WORK
        return CudaEvent(torch.cuda.current_stream(device))

    def on_copy_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        if device.type != "cuda":
            return contextlib.nullcontext()
        return after_current(self.copy_stream(device), "copy")

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
        if dst.device == src.device:  # within host memory (or within the device): ordered like any other work
            return super().copy(dst, src, name, to_device, overlap)
        host, on_device = (src, dst) if to_device else (dst, src)
        if not overlap:
            delay("compute")
            dst.copy_(src, non_blocking=True)
            return Copy(name, host, to_device, self.record(on_device.device))
        side = self.copy_stream(on_device.device)
        # The compute queued so far wrote the source (to the host), or used the block the allocator just gave the
        # destination (to the device): the copy starts after it.
        with after_current(side, "copy"):
            dst.copy_(src, non_blocking=True)
            event = self.record(on_device.device)
        # The allocator reuses a freed block in the order of the stream that allocated it: keep this one from compute
        # until the copy stream is done with it, should the compute stream drop the tensor first.
        on_device.record_stream(side)
        return Copy(name, host, to_device, event, stream=COPY)

    def pinned_bytes(self) -> tuple[int, int]:
        """What the caching host allocator holds, cached blocks included, and `pinned.page_locked`'s blocks."""
        if not hasattr(torch.cuda, "host_memory_stats"):
            return 0, 0
        stats = torch.cuda.host_memory_stats()
        # The two peaks may not have fallen together: their sum bounds the peak from above.
        return (stats.get("allocated_bytes.current", 0) + pinned.locked_bytes["now"],
                stats.get("allocated_bytes.peak", 0) + pinned.locked_bytes["peak"])

    def reset_pinned_peak(self) -> None:
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
            pinned.locked_bytes["peak"] = pinned.locked_bytes["now"]
