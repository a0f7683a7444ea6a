"""The simulated GPU's memory beside the host's: host memory the device layer made (`host_storages`, `in_host_memory`),
and buffers as if pinned (`as_if_pinned`), counted in `pinned` while they live. Every other storage is the simulated
device's (`hf_zero.testing.dispatch.DeviceMemory` counts it)."""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes


class Storages:
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


host_storages = Storages()  # host memory made by the layer, not the simulated device's
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

