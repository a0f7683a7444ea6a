"""Host memory the ranks hold: how glibc's allocator gives freed memory back to the system, and what Python's cyclic
collector walks.

On a CPU rank every tensor is host memory from glibc's malloc, and a rank's resident memory is what the
issue of models larger than one process is measured by. glibc keeps two pools: allocations above its mmap
threshold are mmapped and given back when freed; smaller ones come from its heap, whose freed pages stay
resident until malloc_trim gives them back. Both settings are glibc's; elsewhere (macOS, musl) there is
nothing to set and both functions do nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Iterator

# glibc serves allocations above this from mmap, given back to the system when freed. Left to itself, glibc
# raises the threshold as large blocks are freed (up to 32 MiB) and keeps later ones in its heap, so a rank's
# peak follows its allocation history: the gpt2-large-shape stage-3 run peaked at 4.63-4.90 GiB per rank
# against 4.35-4.37 with the threshold fixed at 1 MiB or 8 MiB. 1 MiB made `hf-zero train` 1.7x slower
# (every activation an mmap and fresh page faults); at 8 MiB it runs as fast as glibc's default.
MMAP_THRESHOLD = 8 << 20

# Heap memory freed since the last trim that makes HeapTrimmer trim again. Each trim walks the heap (a few
# milliseconds), so it is not worth doing for less.
TRIM_STEP = 32 << 20


def _glibc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2  # glibc >= 2.33
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def use_mmap_for_large_allocations() -> None:
    """For the processes hf-zero launches (through the environment, read when a process starts) and for
    this one (mallopt): glibc's mmap threshold fixed at MMAP_THRESHOLD, unless MALLOC_MMAP_THRESHOLD_ is set
    already, which is how a user chooses another value."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    mmap_threshold_from_environment()


def mmap_threshold_from_environment() -> None:
    """For a process forked from one that started under another environment (a forkserver's rank): glibc's mmap
    threshold as MALLOC_MMAP_THRESHOLD_ says, which glibc itself reads only when a process starts. Nothing without
    the variable."""
    libc = _glibc()
    try:
        threshold = int(os.environ["MALLOC_MMAP_THRESHOLD_"], 0)  # a number as glibc reads one (0x... too)
    except (KeyError, ValueError):
        return  # unset, or what glibc would ignore as well
    if libc is not None and 0 <= threshold < 2**31:  # mallopt's int; glibc refuses a threshold above 32 MiB itself
        libc.mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD


class HeapTrimmer:
    """Gives the heap's freed pages back to the system once at least `step` bytes more of it are free than
    after the last trim. With `trim_host_heap`, a stage-3 backward calls it at each unit's gather: backward
    frees the forward's activations, on a CPU rank mostly small blocks from the heap, while what it allocates
    itself (gathered units, buckets, gradients) is larger and mmapped, so without a trim the freed heap stays
    resident beside them, up to the end of backward, where the rank holds the most (0.07-0.08 GiB on the
    gpt2-large-shape run). The next forward takes those pages back through page faults: off by default."""

    def __init__(self, step: int = TRIM_STEP) -> None:
        self.libc = _glibc()
        self.step = step
        self.free_after_trim = 0

    def __call__(self) -> None:
        if self.libc is None:
            return
        free = self.libc.mallinfo2().fordblks
        # Heap reused since the last trim and freed again is resident again: measured from the lowest point.
        self.free_after_trim = min(self.free_after_trim, free)
        if free - self.free_after_trim >= self.step:
            self.libc.malloc_trim(0)
            self.free_after_trim = free


@contextlib.contextmanager
def start_up_frozen() -> Iterator[None]:
    """The imports inside (and every object before them) frozen out of Python's cyclic collector for the rest of the
    process: they live as long as it does. torch and transformers' Trainer stack are about half a million objects,
    which the collector walks in every full collection (0.2 s of a core; accelerate runs one in each
    Trainer.train()), and, left on while they import, walks again each time they have grown by a quarter: 0.9 of
    the 4.8 s of CPU `from transformers import Trainer` takes. Frozen, they are walked never, and a forked
    process's collector no longer writes to the pages it shares with its parent. For a process's start only, before
    it makes anything it will drop: what is frozen is never collected, the few reference cycles the imports left as
    garbage included (a full collection first would cost the 0.2 s saved)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
