"""What the stream checker sees of torch: every op torch runs in the checked thread, through a torch dispatch mode
(`_Dispatch`), and `Tensor.tolist`, which reads memory without an op the mode sees. `start_checking` and
`stop_checking` put both in place and take them out; `DeviceMemory` listens to the same mode to count the simulated
device's memory."""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_zero.settings.environment import SIMULATE_ENV
from hf_zero.testing import stream_checker
from hf_zero.testing.memory import Storages, host_storages
from hf_zero.testing.stream_checker import StreamChecker
from hf_zero.testing.streams import HOST, quieted, simulating, simulation, stream_now


def start_checking() -> None:
    """Checks stream order from now on (the simulation "late"): every op torch runs in this thread, and every
    copy, collective, event and free of the device layer. Idempotent; `stop_checking` ends it."""
    if simulation() != "late":
        return
    if stream_checker.checker is None:
        stream_checker.checker = StreamChecker()
    _dispatch.start()
    torch.Tensor.tolist = _read_back_tolist


def stop_checking() -> None:
    """Ends the check and forgets what it knew (a test leaving the simulation); raises the races found at torch's
    frees that no op came after to report."""
    ending, stream_checker.checker = stream_checker.checker, None
    torch.Tensor.tolist = _tolist
    if not _dispatch.listeners:
        _dispatch.stop()
    if ending is not None:
        ending.raise_deferred()


_tolist = torch.Tensor.tolist


def _read_back_tolist(tensor: torch.Tensor) -> Any:
    """Tensor.tolist, which reads a CPU tensor's memory without an op the dispatch mode sees: from the simulated
    device's memory that is a value read back, as `.item()` is (on a GPU a copy the host waits for)."""
    plain = _plain(tensor)
    checker = stream_checker.checker
    if checker is not None and plain is not None and not host_storages.holds(plain.untyped_storage()) \
            and not quieted():
        stream = stream_now()
        checker.access(stream, [plain], [], "Tensor.tolist")
        checker.wait_stream(HOST, stream)
    return _tolist(tensor)


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
        checker = stream_checker.checker
        check = checker is not None and not quieted() and func.namespace == "aten" \
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


class DeviceMemory:
    """While active, counts the memory allocated on the simulated device, as `max_memory_allocated` does on a
    GPU: every tensor storage an op creates, except host memory made by the layer, for as long as it lives, with
    its peak (`peak`). A storage given back by resizing (stage 3's freed units) counts as freed, and again once
    re-grown. What was allocated before it became active is not counted: it measures growth. It listens to the
    stream checker's dispatch mode, which it starts if needed."""

    def __init__(self) -> None:
        if not simulating():
            raise RuntimeError(f"DeviceMemory counts the simulated device's memory: set {SIMULATE_ENV}")
        self.storages = Storages()
        self.peak = 0

    def __enter__(self) -> "DeviceMemory":
        _dispatch.listeners.append(self)
        _dispatch.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        _dispatch.listeners.remove(self)
        if stream_checker.checker is None and not _dispatch.listeners:
            _dispatch.stop()

    def observe(self, inputs: set[int], out: Any) -> None:
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" \
                    and tensor.untyped_storage()._cdata not in inputs and tensor not in self.storages \
                    and tensor not in host_storages:
                self.storages.add(tensor)
        self.peak = max(self.peak, self.storages.nbytes())



@contextlib.contextmanager
def seen_in_this_thread() -> Iterator[None]:
    """The ops torch runs in the calling thread inside are seen too (a host thread beside the checked one)."""
    mode = _Dispatch()
    mode.start()
    try:
        yield
    finally:
        mode.stop()
