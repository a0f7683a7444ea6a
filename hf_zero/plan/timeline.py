"""The timeline of a plan's simulated rank (hf_zero.runtime.timeline's strategy): device work runs at once, as on
the CPU, while the memory count (hf_zero.plan.memory) hears what the device layer does with memory. Host memory
the layer hands out is counted as the host's; all else is the simulated device's, which is apart from the host's
(`separate_memory`), so offloaded states are copied to the device where a GPU copies them. Each collective issued is
recorded with its group, to compare the simulated ranks' schedules. ZeRO-Infinity's NVMe files are counted, never
written (`CountedFiles`)."""
from __future__ import annotations

import errno
import re
from collections import Counter
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, Callable

import torch

from hf_zero.plan.memory import MemoryCount
from hf_zero.runtime.files import Files
from hf_zero.runtime.timeline import NO_WORK, Copy, Event, Timeline

_RANK_PREFIX = re.compile(r"^rank \d+: ")


class CountedFiles(Files):
    """Files that hold nothing: the bytes allocated (what the disk would need), and read and written since
    `start_window`. Transfers run at once in the caller's thread, where a plan's fake tensors and memory count
    are in force (both are the thread's own)."""

    def __init__(self) -> None:
        self.allocated: dict[int, int] = {}  # bytes by descriptor
        self.read = self.written = 0

    def start_window(self) -> None:
        self.read = self.written = 0

    def fresh_folder(self, folder: Path) -> None:
        pass

    def allocate(self, path: Path, nbytes: int) -> int:
        fd = len(self.allocated)
        self.allocated[fd] = nbytes
        return fd

    def transfer(self, fd: int, tensor: torch.Tensor, offset: int, read: bool) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if offset + nbytes > self.allocated[fd]:
            raise OSError(errno.EINVAL, f"bytes {offset}-{offset + nbytes} past the file's {self.allocated[fd]}")
        if read:
            self.read += nbytes
        else:
            self.written += nbytes

    def close(self, fd: int) -> None:
        pass

    def executor(self, workers: int, name: str) -> Executor:
        return _InOrder()

    @property
    def held(self) -> int:
        return sum(self.allocated.values())


class _InOrder(Executor):
    """Runs each task when it is submitted, in the submitting thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to whoever waits on the future, as a thread's would be
            future.set_exception(error)
        return future


class PlanTimeline(Timeline):
    separate_memory = True
    host_kernels = False

    def __init__(self, count: MemoryCount, device_bytes: int) -> None:
        self.count, self.device_bytes = count, device_bytes
        self.collectives: list[tuple[str, str]] = []  # (group, what), in the order issued
        self.window_collectives_from = 0  # the index in `collectives` of the first issued since `start_window`
        self.copied = Counter({"to_device": 0, "to_host": 0})  # bytes, since `start_window`
        self.counted_files = CountedFiles()

    def start_window(self) -> None:
        self.copied = Counter({"to_device": 0, "to_host": 0})
        self.counted_files.start_window()
        self.window_collectives_from = len(self.collectives)

    def files(self) -> Files:
        return self.counted_files

    def copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
        self.copied["to_device" if to_device else "to_host"] += src.numel() * src.element_size()
        return super().copy(dst, src, name, to_device, overlap)

    def _on_host(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.count.on_host():
            made = make()
            self.count.track(made)
        return made

    def host_copy(self, src: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return self._on_host(lambda: src.to(dtype=dtype, copy=True).contiguous())

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return self._on_host(lambda: torch.empty(numel, dtype=dtype))

    def host_block(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return self._on_host(lambda: torch.empty(numel, dtype=dtype))

    def host_memory(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self._on_host(make)

    def memory_left(self) -> tuple[int, str]:
        left = max(0, self.device_bytes - self.count.total["device"])
        return left, f"the planned device's {self.device_bytes / 1e9:g} GB less what the simulated rank holds"

    def released(self, tensor: torch.Tensor, what: str) -> None:
        self.count.resized(tensor, 0)

    def allocated(self, tensor: torch.Tensor) -> None:
        self.count.resized(tensor, tensor.untyped_storage().nbytes())

    def collective_issued(self, group: str, reads: list[torch.Tensor], writes: list[torch.Tensor],
                          what: str) -> Event:
        self.collectives.append((group, _RANK_PREFIX.sub("", what)))
        return NO_WORK
