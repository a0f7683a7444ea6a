"""The one door to asynchronous device work: pinned host buffers, non-blocking copies in both
directions and the events that say when they have landed, and the stream gradient reductions run on
(`CommStream`). No other module calls `copy_(non_blocking=True)`, `pin_memory`, `torch.cuda` events or
streams.

On a GPU a non-blocking copy is only queued: a host-to-device copy reads its pinned source some time
later, and a device-to-host copy fills its destination some time later. The host may touch those
buffers again only after waiting on the copy (`Copy.wait`). Device work queued after the copy on the
same stream (compute, NCCL collectives) is ordered after it and needs no wait.

Copies run on one of three streams: the compute stream (the default), the communication stream (what a
reduction's settle copies, `CommStream`) and the copy stream (`overlap=True`: copies that must not hold up the
compute queued after them, such as a prefetched parameter shard or an offloaded activation checkpoint). Copies
on one stream run in order; copies on two streams are ordered only by a wait (`Copy.ready`, `CommStream.wait`).

On CPU every copy is immediate, so a missing wait can never show. `HF_ZERO_SIMULATE_ASYNC` makes the CPU behave
as a GPU would at its most unlucky, which is how the tests check the GPU path. "late" (or "1"): asynchronous
work lands as late as a GPU may land it:
- host to device: the destination receives the values at once when the copy is on the compute stream (later
  compute is stream-ordered), else only when a stream waits on it (`Copy.ready`) or the host does; it holds
  poison (NaN) until then. The source stays lent to the copy until the host waits on it: writing into it
  meanwhile (through file I/O, the C++ kernel, or torch) is caught, naming the buffer.
- device to host: the destination holds poison until the copy is waited on, and receives the values the
  source had when the copy was queued. Reading or writing it meanwhile is caught.
- a host buffer that copies on two streams use, one of them writing it, with no wait ordering them, is caught.
- a reduction on the communication stream runs when the compute stream waits on it; an asynchronous collective
  (hf_zero.comm) runs when waited on, its outputs poison until then, and its inputs must not change meanwhile.
A wait lands every copy queued before it on the same stream, as a CUDA event does.
"early": asynchronous work runs the moment it is issued, copies and reductions and collectives whole, as a GPU
with an idle side stream runs them: code that counts on them not having run yet (a buffer reused before the
work that reads it was issued, a shard zeroed after its reduction was handed over) shows as a wrong result.

File I/O reads and writes the memory of host tensors only: a device address handed to the operating
system is a crash or silent garbage, so `bytes_of` refuses anything else.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HOST = torch.device("cpu")
SIMULATE_ENV = "HF_ZERO_SIMULATE_ASYNC"
SIMULATION_MODES = ("late", "early")
COMPUTE, COMM, COPY = "compute", "comm", "copy"  # the streams a copy may be queued on
# On a GPU (tests/test_gpu.py): "STREAM:CYCLES" queues CYCLES of `torch.cuda._sleep` on one side, so that a
# missing wait reads or writes a buffer too early and shows as a wrong number, the GPU's own version of the
# simulation below. STREAM "compute": before every asynchronous copy and every reduction's hand-over, so copies
# land late and backward writes its buckets late (a reduction that does not wait on the compute stream reads a
# bucket too early; a host that does not wait on a copy reads or writes its buffer too early). STREAM "comm":
# before every reduction on the communication stream (compute that does not wait on it reads its result early).
# STREAM "copy": before every copy on the copy stream (compute that does not wait on one reads its destination
# early).
DELAY_ENV = "HF_ZERO_CUDA_DELAY"


class PendingCopyError(RuntimeError):
    """The host touched a buffer that a queued device copy still reads or writes."""


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """Where this process computes: its accelerator (chosen by `use_local_accelerator`), else the host. Ranks
    of a gloo process group compute on the host even beside a GPU (`--use_cpu`, local test ranks): their
    collectives run on host tensors, and several of them would otherwise share, or look for, one GPU."""
    if not has_accelerator() or (dist.is_initialized() and dist.get_backend() == "gloo"):
        return HOST
    return torch.device("cuda", torch.cuda.current_device())


def use_local_accelerator(local_rank: int) -> None:
    """Makes accelerator `local_rank` (torchrun's LOCAL_RANK: one per process on a node) this process's own."""
    torch.cuda.set_device(local_rank)


def _delay_device(stream: str) -> None:
    """Queues DELAY_ENV's cycles of device sleep on the current stream when DELAY_ENV names `stream`."""
    where, _, cycles = os.environ.get(DELAY_ENV, "").partition(":")
    if where == stream:
        torch.cuda._sleep(int(cycles))


def simulation() -> str | None:
    """How asynchronous work runs on CPU (tests: HF_ZERO_SIMULATE_ASYNC): "late", "early" or None (at once)."""
    mode = os.environ.get(SIMULATE_ENV, "")
    if mode in ("", "0"):
        return None
    mode = "late" if mode == "1" else mode
    if mode not in SIMULATION_MODES:
        raise ValueError(f"{SIMULATE_ENV} must be one of {', '.join(SIMULATION_MODES)} (or 1: late); got {mode!r}")
    return mode


def simulating() -> bool:
    """Whether asynchronous work behaves as on a GPU (`simulation`), though it runs on CPU."""
    return simulation() is not None


_current = threading.local()  # simulation: the stream device work is queued on now (`stream` attribute)


def _stream_now() -> str:
    return getattr(_current, "stream", COMPUTE)


@contextlib.contextmanager
def _queued_on(name: str, stream: "torch.cuda.Stream | None") -> Iterator[None]:
    """Device work issued inside goes to `stream` (a GPU), or is counted as queued on stream `name` (CPU)."""
    if stream is not None:
        with torch.cuda.stream(stream):
            yield
        return
    previous, _current.stream = _stream_now(), name
    try:
        yield
    finally:
        _current.stream = previous


_copy_streams: dict[int, "torch.cuda.Stream"] = {}


def _copy_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The copy stream of a GPU (one per device, made on first use); None on the host."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        _copy_streams[index] = torch.cuda.Stream(index)
    return _copy_streams[index]


def on_copy_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """Device work issued inside runs on `device`'s copy stream: after the copies queued there (`overlap=True`),
    without waiting for the compute queued before it. A collective issued inside (NCCL waits on the stream it is
    issued from) reads what those copies brought, while the compute stream runs on."""
    return _queued_on(COPY, _copy_stream(device))


def _pins() -> bool:
    """Whether host buffers a device copies to and from are pinned: when this process computes on a GPU."""
    return compute_device().type == "cuda"


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer that a device copies to and from, pinned where `_pins` (allocated so, not copied).
    Pinned only for buffers that copies use again and again: the caching host allocator rounds each one
    up to a power of two and keeps it for the life of the process, so a one-off buffer pinned here is
    page-locked memory the host never gets back."""
    if simulating():
        return _in_host_memory(lambda: _as_if_pinned(numel, dtype))
    return torch.empty(numel, dtype=dtype, pin_memory=_pins())


def host_memory_empty(numel: int, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> torch.Tensor:
    """Ordinary (pageable) host memory for what the engine keeps on the host whatever it computes on: offloaded
    masters and their start values, the staging of files. Under the simulation it is host memory, not the
    simulated device's (`DeviceMemory`)."""
    return _in_host_memory(lambda: (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=HOST))


def _in_host_memory(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make(), a tensor the caller places in host memory; the simulation counts it so (`DeviceMemory`)."""
    if not simulating():
        return make()
    with torch.utils._python_dispatch._disable_current_modes():
        tensor = make()
    _simulator.host_storages.add(tensor)
    return tensor


class _PinnedBytes(bytearray):
    """Simulation: the memory of an as-if-pinned buffer (a bytearray subclass, so that it can be watched)."""


def _as_if_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Simulation: an empty host buffer with the one property of pinned memory that the
    host can trip over, a storage that cannot be resized (`release_storage` cannot give it back in place),
    counted in `pinned_host_bytes` while it lives."""
    nbytes = numel * dtype.itemsize
    memory = _PinnedBytes(nbytes)
    _simulator.pinned_now += nbytes
    _simulator.pinned_peak = max(_simulator.pinned_peak, _simulator.pinned_now)
    weakref.finalize(memory, _simulator.unpin, nbytes)
    fixed = torch.frombuffer(memory, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return fixed.view(dtype)


def pinned_host_bytes() -> tuple[int, int]:
    """(now, peak since `reset_pinned_peak`) bytes of page-locked host memory this process holds: on a GPU
    what the caching host allocator holds, cached blocks included; under the simulation the as-if-pinned
    buffers alive; else none."""
    if simulating():
        return _simulator.pinned_now, _simulator.pinned_peak
    if has_accelerator() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        return stats.get("allocated_bytes.current", 0), stats.get("allocated_bytes.peak", 0)
    return 0, 0


def reset_pinned_peak() -> None:
    if simulating():
        _simulator.pinned_peak = _simulator.pinned_now
    elif has_accelerator() and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()


# ---- copies and their events --------------------------------------------------------------------
@dataclass(eq=False)
class Copy:
    """A queued copy. `wait()` blocks the host until it (and every copy queued before it) has landed."""
    name: str
    host: torch.Tensor  # the host side: the source of a copy to the device, the destination of one to the host
    to_device: bool
    event: "torch.cuda.Event | None" = None
    stream: str = COMPUTE
    snapshot: torch.Tensor | None = None  # simulation: the values the copy moves, as they were when queued
    poison: torch.Tensor | None = None  # simulation, to the host: what the destination holds until it lands
    # simulation, to the device on a side stream: the destination, poison until a stream or the host waits
    undelivered: torch.Tensor | None = None
    landed: bool = False
    # simulation: streams that waited on this copy's stream after it was queued (their later copies follow it)
    ordered_before: set[str] | None = None

    def wait(self) -> None:
        """The host waits until the copy (and every copy queued before it on its stream) has landed."""
        if self.event is not None:
            self.event.synchronize()
        if not self.landed:
            _simulator.land_through(self)

    def ready(self) -> None:
        """The stream the caller queues on now waits for the copy (its destination may be read there); the host
        does not: the source of a copy to the device stays lent until `wait`."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        elif self.undelivered is not None:
            _simulator.deliver(self)


DONE = Copy("done", torch.empty(0), to_device=True, landed=True)


class LatestCopy:
    """The last of a series of copies queued on one stream: waiting on it waits on every one before it.
    Whoever lends a buffer to copies keeps one, and whoever writes the buffer waits on it first."""

    def __init__(self) -> None:
        self.copy = DONE

    def add(self, copy: Copy) -> None:
        self.copy = copy

    def wait(self) -> None:
        self.copy.wait()
        self.copy = DONE


def copy_to_device(dst: torch.Tensor, src: torch.Tensor, name: str, overlap: bool = False) -> Copy:
    """Queues `dst` (device) <- `src` (host, pinned on a GPU). `src` stays lent until the copy is waited on.
    `overlap`: on the copy stream, where the compute queued after it does not wait for it; whoever reads `dst`
    makes their stream wait first (`Copy.ready`, or work issued `on_copy_stream`)."""
    return _copy(dst, src, name, to_device=True, overlap=overlap)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, name: str, overlap: bool = False) -> Copy:
    """Queues `dst` (host, pinned on a GPU) <- `src` (device). `dst` holds the values once waited on.
    `overlap`: on the copy stream, where the compute queued after it does not wait for it."""
    return _copy(dst, src, name, to_device=False, overlap=overlap)


def to_device(src: torch.Tensor, device: torch.device, name: str, overlap: bool = False) -> tuple[torch.Tensor, Copy]:
    """`src` (host) on `device`, and the copy that puts it there: `src` stays lent until that is waited on.
    Without a copy to make (already there, not simulating) it is `src` itself."""
    if src.device == device and not simulating():
        return src, DONE
    dst = torch.empty_like(src, device=device)
    return dst, copy_to_device(dst, src, name, overlap)


def to_host(src: torch.Tensor, name: str, overlap: bool = False) -> tuple[torch.Tensor, Copy]:
    """`src` (device) in a new host buffer, and the copy that fills it (wait before reading). A tensor
    already in host memory is returned as it is, unless simulating."""
    if src.device == HOST and not simulating():
        return src, DONE
    dst = host_empty(src.numel(), src.dtype).view(src.shape)
    return dst, copy_to_host(dst, src, name, overlap)


def in_host_memory(src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`src` in host memory (as `dtype`): itself when it is there, else copied into ordinary (pageable) memory,
    filled when this returns. For one-off copies, such as a checkpoint's pieces, which pinned memory would keep
    page-locked for good (`host_empty`). A copy from the device into pageable memory is synchronous: no copy to
    wait on. Under the simulation always a copy: the simulated device's memory is apart from the host's."""
    return _in_host_memory(lambda: src.to(HOST, dtype, copy=simulating()).contiguous())


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
    host, on_device = (src, dst) if to_device else (dst, src)
    if simulating():
        return _simulator.queue(dst, src, name, to_device, COPY if overlap else _stream_now())
    if not has_accelerator() or dst.device == src.device:
        dst.copy_(src)  # within host memory (or within the device) a copy is ordered like any other work
        return DONE
    if not overlap:
        _delay_device("compute")
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Copy(name, host, to_device, event)
    side = _copy_stream(on_device.device)
    # The compute queued so far wrote the source (to the host), or used the block the allocator just gave the
    # destination (to the device): the copy starts after it.
    side.wait_stream(torch.cuda.current_stream(on_device.device))
    with torch.cuda.stream(side):
        _delay_device("copy")
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    # The allocator reuses a freed block in the order of the stream that allocated it: keep this one from compute
    # until the copy stream is done with it, should the compute stream drop the tensor first.
    on_device.record_stream(side)
    return Copy(name, host, to_device, event, stream=COPY)


# ---- the communication stream ----------------------------------------------------------------
@dataclass(eq=False)
class Reduction:
    """A collective submitted to the communication stream (`CommStream.submit`)."""
    launch: Callable[[], Any]  # issues the collective and returns its work handle
    settle: Callable[[], None]  # device work once it is done (this rank's chunk into its shard)
    event: "torch.cuda.Event | None" = None  # GPU: recorded on the communication stream after settle
    work: Any = None  # CPU: the collective's handle once launched
    settled: bool = False


class CommStream:
    """Where gradient reductions run. On a GPU that is a stream of their own: each reduction waits for the
    compute work queued before it (its bucket is written), then runs its collective and settles on the
    communication stream, so backward's compute never waits on a collective. The compute stream waits on
    the communication stream only where the host is about to hand a reduction's buffers back for reuse
    (`wait`) and once at the end of backward (`join`), as FSDP2's reduce-scatter stream and DeepSpeed's
    reduction stream do. Whatever the host does with a reduction's buffers or results comes after `wait`.

    On CPU a collective runs in gloo's own thread from `submit` on, and `settle` runs at `wait`. Under the
    simulation the whole reduction runs at `wait` ("late"), as late as a GPU may run it: a bucket the host writes
    again before waiting is reduced with the wrong values, and a shard read before waiting misses the
    reduction; either shows as a wrong result. "early": it runs whole at `submit`.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.queued: list[Reduction] = []  # CPU: submitted, not yet settled, in order

    def submit(self, launch: Callable[[], Any], settle: Callable[[], None]) -> Reduction:
        reduction = Reduction(launch, settle)
        if self.stream is not None:
            _delay_device("compute")
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                _delay_device("comm")
                launch().wait()  # the communication stream waits on the collective, the host does not
                settle()
                reduction.event = torch.cuda.Event()
                reduction.event.record(self.stream)
            reduction.settled = True
            return reduction
        mode = simulation()
        if mode != "late":
            with _queued_on(COMM, None):
                reduction.work = launch()
        self.queued.append(reduction)
        if mode == "early":
            self.wait(reduction)
        return reduction

    def done(self, reduction: Reduction) -> bool:
        """Whether waiting on `reduction` would not hold anything up (a GPU: its event has passed)."""
        if reduction.event is not None:
            return reduction.event.query()
        return reduction.settled or (reduction.work is not None and reduction.work.is_completed())

    def wait(self, reduction: Reduction) -> None:
        """The compute stream (the host, on CPU) waits for `reduction` and every one submitted before it."""
        if reduction.event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(reduction.event)
            return
        while not reduction.settled:
            earliest = self.queued.pop(0)
            with _queued_on(COMM, None):
                work = earliest.work if earliest.work is not None else earliest.launch()
                work.wait()
                earliest.settle()
            earliest.settled = True
        if simulating():  # the compute stream's later copies come after the settles' copies
            _simulator.order(COMM, COMPUTE)

    def join(self) -> None:
        """The compute stream waits for every reduction submitted so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        elif self.queued:
            self.wait(self.queued[-1])


# ---- host access ------------------------------------------------------------------------------
def check_host_access(tensor: torch.Tensor, writing: bool) -> None:
    """Raises PendingCopyError when the host may not yet read (or write) `tensor`: a queued copy still reads
    it (writing only) or will still write it. Checked by file I/O and the C++ kernels; simulation only."""
    if simulating():
        _simulator.check_access(tensor, writing)


def bytes_of(tensor: torch.Tensor, writing: bool) -> memoryview:
    """A host tensor's memory as bytes, without a copy, for file I/O that reads it or (`writing`) fills it.
    Not through numpy: a storage handed to numpy can no longer be resized, and stage 3 frees gathered
    buffers by resizing their storage to zero."""
    if tensor.device.type != "cpu":
        raise ValueError(f"bytes_of reads host memory; got a tensor on {tensor.device} (copy it to the host first)")
    if not tensor.is_contiguous():
        raise ValueError("bytes_of needs a contiguous tensor")
    check_host_access(tensor, writing)
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


# ---- the simulated device's memory -----------------------------------------------------------------
class _Storages:
    """Tensor storages, held weakly: a storage freed (and its address reused) drops out."""

    def __init__(self) -> None:
        self.refs: dict[int, StorageWeakRef] = {}

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.refs[storage._cdata] = StorageWeakRef(storage)

    def __contains__(self, tensor: torch.Tensor) -> bool:
        ref = self.refs.get(tensor.untyped_storage()._cdata)
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


class DeviceMemory(TorchDispatchMode):
    """Simulation: while active, counts the memory allocated on the simulated device, as `max_memory_allocated`
    does on a GPU: every tensor storage an operation creates, except host memory made by this layer
    (`host_empty`, `host_memory_empty`, `in_host_memory`), for as long as it lives, with its peak (`peak`).
    A storage given back by resizing (stage 3's freed units) counts as freed, and again once re-grown. What was
    allocated before it became active is not counted: it measures growth."""

    def __init__(self) -> None:
        super().__init__()
        if not simulating():
            raise RuntimeError(f"DeviceMemory counts the simulated device's memory: set {SIMULATE_ENV}")
        self.storages = _Storages()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" \
                    and tensor.untyped_storage()._cdata not in inputs and tensor not in self.storages \
                    and tensor not in _simulator.host_storages:
                self.storages.add(tensor)
        self.peak = max(self.peak, self.storages.nbytes())
        return out


# ---- the CPU simulation of a GPU's copy engine -------------------------------------------------
def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the two tensors' memory spans share a byte."""
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    return a_lo < b_hi and b_lo < a_hi


def poison(tensor: torch.Tensor) -> None:
    """Simulation: fills `tensor` with what a buffer holds before device work fills it (NaN, or 0xA5 bytes)."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    else:
        tensor.view(torch.uint8).fill_(0xA5)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


class _Simulator:
    """Copies queued in order on each simulated stream (hf_zero.device's CPU test mode)."""

    def __init__(self) -> None:
        self.queued: list[Copy] = []  # every stream's, in the order queued
        self.host_storages = _Storages()  # host memory, not the simulated device's (`DeviceMemory`)
        self.lock = threading.Lock()
        self.pinned_now = self.pinned_peak = 0  # bytes of as-if-pinned buffers alive, and their peak

    def unpin(self, nbytes: int) -> None:
        self.pinned_now -= nbytes

    def queue(self, dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, stream: str) -> Copy:
        host = src if to_device else dst
        if simulation() == "early":
            dst.copy_(src)
            return Copy(name, host, to_device, stream=stream, landed=True)
        with self.lock:
            for earlier in [c for c in self.queued if overlaps(c.host, host)]:
                if earlier.stream == stream or stream in earlier.ordered_before:
                    self._land_through(earlier)  # device work is stream-ordered: the earlier copy lands first
                elif not (to_device and earlier.to_device):  # two reads of a host buffer do not race
                    raise PendingCopyError(f"{name} is queued on the {stream} stream while {earlier.name}, on the "
                                           f"{earlier.stream} stream, still uses the same host memory, and no wait "
                                           f"orders the two: wait on the earlier copy first")
            copy = Copy(name, host, to_device, stream=stream, snapshot=src.detach().clone(), ordered_before=set())
            if not to_device:
                poison(dst)
                copy.poison = dst.detach().clone()
            elif stream == _stream_now():
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

    def deliver(self, copy: Copy) -> None:
        """A stream waited on `copy` (to the device, on a side stream): its destination holds the values."""
        with self.lock:
            self._deliver(copy)

    @staticmethod
    def _deliver(copy: Copy) -> None:
        if copy.undelivered is not None:
            copy.undelivered.copy_(copy.snapshot)
            copy.undelivered = None

    def check_access(self, tensor: torch.Tensor, writing: bool) -> None:
        with self.lock:
            self._check(tensor, writing)

    def land_through(self, copy: Copy) -> None:
        with self.lock:
            self._land_through(copy)

    def _land_through(self, copy: Copy) -> None:
        if copy in self.queued:
            on_its_stream = [c for c in self.queued if c.stream == copy.stream]
            for earlier in on_its_stream[:on_its_stream.index(copy) + 1]:
                self._land(earlier)
                self.queued.remove(earlier)
        copy.landed = True

    def _check(self, tensor: torch.Tensor, writing: bool) -> None:
        for copy in self.queued:
            if overlaps(tensor, copy.host) and (writing or not copy.to_device):
                what = ("reads it, to the device" if copy.to_device else "will fill it, from the device")
                raise PendingCopyError(f"the host {'writes' if writing else 'reads'} {copy.name} while a queued "
                                       f"copy still {what}: wait on the copy first")

    def _land(self, copy: Copy) -> None:
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


_simulator = _Simulator()
