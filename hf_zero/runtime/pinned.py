"""Host memory page-locked for the whole run, where it lies (`page_locked`), and how much of it is held
(`locked_bytes`). For buffers copies use all run long (hf_zero.runtime.device.host_buffers_for_good): the caching
host allocator would round each block up to a power of two and gains nothing from a block never handed back.
"""
from __future__ import annotations

import atexit
import mmap
import os
import threading

import torch

locked_bytes = {"now": 0, "peak": 0}  # bytes `page_locked` holds, and their peak
_locked_bytes_lock = threading.Lock()  # a block may be let go on another thread (a delayed update's)
_unlocking = True  # until the interpreter exits: then the process's end gives every block back, CUDA maybe first


def _stop_unlocking() -> None:
    global _unlocking
    _unlocking = False


atexit.register(_stop_unlocking)


class _PageLocked(mmap.mmap):
    """Anonymous private memory that `page_locked` page-locks where it lies. torch.frombuffer keeps the map alive
    while a tensor views it; the last view gone, the block is unlocked here, before mmap's own deallocation unmaps it
    (a weakref finalizer would run after). The device finishes first: a copy dropped unwaited (at teardown) may still
    be moving the block's bytes. On the device that locked it, whichever thread drops the last view; not in a forked
    child, which never locked it."""
    address = 0
    owner = 0
    device = 0

    def __del__(self) -> None:
        if not (_unlocking and self.address and self.owner == os.getpid()):
            return
        with torch.cuda.device(self.device):
            try:
                torch.cuda.synchronize()
            finally:  # unlocked even when the device reports an error
                status = torch.cuda.cudart().cudaHostUnregister(self.address)
        if int(status) == 0:
            with _locked_bytes_lock:
                locked_bytes["now"] -= len(self)


def page_locked(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` uninitialised elements of host memory (at least one), page-locked where they lie (cudaHostRegister),
    as much as asked for, and given back with the last view of them (the 1.31B GPT-2's 2.6 GB gradient shard took
    4 GiB page-locked from the caching host allocator)."""
    block = _PageLocked(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(block, dtype=dtype, count=numel)
    # cudaHostRegisterPortable, as torch.cuda._pin_memory_utils.pin_memory registers a pointer: locked for every
    # CUDA context.
    status = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), len(block), 1)
    if int(status) != 0:
        raise RuntimeError(f"page-locking {len(block)} bytes of host memory failed (CUDA error {int(status)}): "
                           f"the host may be short of memory, or of the locked-memory limit (ulimit -l)")
    block.address, block.owner, block.device = flat.data_ptr(), os.getpid(), torch.cuda.current_device()
    with _locked_bytes_lock:
        locked_bytes["now"] += len(block)
        locked_bytes["peak"] = max(locked_bytes["peak"], locked_bytes["now"])
    return flat
