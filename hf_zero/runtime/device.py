"""The one door to asynchronous device work: streams and the events that order them, pinned host buffers,
non-blocking copies in both directions, the stream gradient reductions run on (`CommStream`), and the memory
stage 3 gives back and takes again (`release_storage`). No other module calls `copy_(non_blocking=True)`,
`pin_memory`, `record_stream`, `torch.cuda` events or streams.

The rule. Work queued on a side stream (a copy, a collective, a one-rank collective's local copy, any op issued
inside `on_copy_stream`, a reduction on the communication stream) is read by the compute stream only after the
compute stream waited on an event recorded after it (`Event.wait`, `Copy.ready`, a collective's `wait()` made
on the compute stream, `CommStream.wait`), and by the host only after the host waited (`Copy.wait`). A side
stream that reads what the compute stream wrote, or fills memory it allocated, first waits on the compute stream
(`on_copy_stream` and every copy on the copy stream do). Memory goes back to the allocator only after every
stream that used it is done with it: the stream that allocated it waited on them, or the memory was recorded on
them. On a GPU these are CUDA streams and events; on CPU everything is immediate, and
`HF_ZERO_SIMULATE_ASYNC` plays the GPU, checking the rule on every op (hf_zero.testing.simulated_gpu).

Copies run on one of three streams: the compute stream (the default), the communication stream (what a
reduction's settle copies, `CommStream`) and the copy stream (`overlap=True`: copies that must not hold up the
compute queued after them, such as a prefetched parameter shard or an offloaded activation checkpoint).

File I/O reads and writes the memory of host tensors only: a device address handed to the operating
system is a crash or silent garbage, so `bytes_of` refuses anything else.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.settings.environment import cuda_delay
from hf_zero.testing import simulated_gpu as sim
from hf_zero.testing.simulated_gpu import COMM, COMPUTE, COPY, simulating
from hf_zero.testing.simulated_gpu import HOST as HOST_STREAM

HOST = torch.device("cpu")
# HF_ZERO_CUDA_DELAY, on a GPU (tests/test_gpu.py): "STREAM:CYCLES" queues CYCLES of `torch.cuda._sleep` on one
# side, so that a missing wait reads or writes a buffer too early and shows as a wrong number, the GPU's own version
# of the simulation. STREAM "compute": before every asynchronous copy and every reduction's hand-over, so copies
# land late and backward writes its buckets late (a reduction that does not wait on the compute stream reads a
# bucket too early; a host that does not wait on a copy reads or writes its buffer too early). STREAM "comm":
# before every reduction on the communication stream (compute that does not wait on it reads its result early).
# STREAM "copy": before every copy and every op issued on the copy stream (compute that does not wait on one
# reads its destination early).


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
    """Queues HF_ZERO_CUDA_DELAY's cycles of device sleep on the current stream when it names `stream`."""
    delay = cuda_delay()
    if delay is not None and delay[0] == stream:
        torch.cuda._sleep(delay[1])


# ---- streams and events -------------------------------------------------------------------------
@dataclass(eq=False)
class Event:
    """The work queued on one stream up to the point it was recorded (`record_event`): a CUDA event, or the
    simulation's (`simulated`: the stream checker's id). Neither: nothing to wait for."""
    cuda: "torch.cuda.Event | None" = None
    simulated: int | None = None

    def wait(self) -> None:
        """The stream the caller queues on now waits for the event's work (the host does not)."""
        if self.cuda is not None:
            torch.cuda.current_stream().wait_event(self.cuda)
        elif self.simulated is not None and sim.checker is not None:
            sim.checker.wait(sim.stream_now(), self.simulated)

    def synchronize(self) -> None:
        """The host waits for the event's work (and so does everything it queues later)."""
        if self.cuda is not None:
            self.cuda.synchronize()
        elif self.simulated is not None and sim.checker is not None:
            sim.checker.wait(HOST_STREAM, self.simulated)

    def query(self) -> bool:
        return self.cuda.query() if self.cuda is not None else True

    def __del__(self) -> None:
        if self.simulated is not None and getattr(sim, "checker", None) is not None:
            sim.checker.forget(self.simulated)


NO_WORK = Event()


def record_event(device: torch.device | None = None) -> Event:
    """An event for the work queued so far on the stream the caller queues on now (of `device`, by default the
    one this process computes on)."""
    device = device if device is not None else compute_device()
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return Event(cuda=event)
    if sim.checker is not None:
        return Event(simulated=sim.checker.record(sim.stream_now()))
    return NO_WORK


_copy_streams: dict[int, "torch.cuda.Stream"] = {}


# ---- host threads beside the one driving the device ---------------------------------------------
def run_beside(pool: ThreadPoolExecutor, work: Callable[[], None], name: str) -> Future:
    """Submits `work` to `pool`'s thread, which runs it beside the thread that drives the device; `joined` waits for
    it. Under the stream checker that thread is a timeline of its own, `name`: the host touching memory it writes (or
    writing memory it reads) before joining it is refused, as an unordered stream's access is."""
    begun = sim.fork_thread_timeline()
    return pool.submit(sim.thread_timeline, name, begun, work)


def joined(running: Future) -> None:
    """Waits for work `run_beside` submitted, re-raising its error; what it did is ordered before the host's next op."""
    sim.join_thread_timeline(running.result())


def _copy_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """The copy stream of a GPU (one per device, made on first use); None on the host."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _copy_streams:
        _copy_streams[index] = torch.cuda.Stream(index)
    return _copy_streams[index]


@contextlib.contextmanager
def on_copy_stream(device: torch.device):
    """Device work issued inside runs on `device`'s copy stream, after the copies queued there (`overlap=True`)
    and after the work queued so far on the stream the caller was on (which wrote what it reads, and used the
    memory the allocator gave what it fills), without holding up the compute queued after it. Whoever reads
    what it wrote waits on an event recorded inside (`record_event`), or on its collective's handle, first."""
    side = _copy_stream(device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            _delay_device("copy")
            yield
        return
    if sim.checker is not None:
        sim.checker.wait_stream(COPY, sim.stream_now())
    with sim.on_stream(COPY):
        yield


# ---- host memory --------------------------------------------------------------------------------
def _pins() -> bool:
    """Whether host buffers a device copies to and from are pinned: when this process computes on a GPU."""
    return compute_device().type == "cuda"


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer that a device copies to and from, pinned where `_pins` (allocated so, not copied), from the
    caching host allocator: for buffers made again and again (a landing, a staging of the same size each step),
    which it hands back without pinning anew. It rounds each block up to a power of two and keeps it for the life of
    the process: a one-off buffer pinned here is page-locked memory the host never gets back, and a buffer kept for
    the whole run belongs in `host_buffers_for_good`."""
    if simulating():
        return sim.as_if_pinned(numel, dtype)
    return torch.empty(numel, dtype=dtype, pin_memory=_pins())


_page_locked = {"now": 0, "peak": 0}  # bytes `host_buffers_for_good` holds page-locked, and their peak
_page_locked_lock = threading.Lock()  # a block may be let go on another thread (a delayed update's)
_unlocking = True  # until the interpreter exits: then the process's end gives every block back, CUDA maybe first


def _stop_unlocking() -> None:
    global _unlocking
    _unlocking = False


atexit.register(_stop_unlocking)


class _PageLocked(mmap.mmap):
    """Anonymous private memory that `host_buffers_for_good` page-locks where it lies. torch.frombuffer keeps the map
    alive while a tensor views it; the last view gone, the block is unlocked here, before mmap's own deallocation
    unmaps it (a weakref finalizer would run after). The device finishes first: a copy dropped unwaited (at teardown)
    may still be moving the block's bytes. On the device that locked it, whichever thread drops the last view; not
    in a forked child, which never locked it."""
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
            with _page_locked_lock:
                _page_locked["now"] -= len(self)


def host_buffers_for_good(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Host buffers that copies use for the whole run (the offloaded gradient shards, the staged new parameters, a
    unit's offloaded parameters), uninitialised, cut from one block of exactly their size, pinned where `_pins`. Not
    from the caching host allocator, which would round the block up to a power of two and gains nothing from a block
    never handed back (the 1.31B GPT-2's 2.6 GB gradient shard took 4 GiB page-locked): the block is page-locked
    where it lies (cudaHostRegister), as much as asked for, and given back with its last view."""
    total = sum(numels)
    if simulating():
        flat = sim.as_if_pinned(total, dtype)
    elif not _pins() or total == 0:
        flat = torch.empty(total, dtype=dtype)
    else:
        block = _PageLocked(-1, total * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(block, dtype=dtype, count=total)
        # cudaHostRegisterPortable, as torch.cuda._pin_memory_utils.pin_memory registers a pointer: locked for every
        # CUDA context.
        status = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), len(block), 1)
        if int(status) != 0:
            raise RuntimeError(f"page-locking {len(block)} bytes of host memory failed (CUDA error {int(status)}): "
                               f"the host may be short of memory, or of the locked-memory limit (ulimit -l)")
        block.address, block.owner, block.device = flat.data_ptr(), os.getpid(), torch.cuda.current_device()
        with _page_locked_lock:
            _page_locked["now"] += len(block)
            _page_locked["peak"] = max(_page_locked["peak"], _page_locked["now"])
    return list(flat.split(numels))


def host_memory_empty(numel: int, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> torch.Tensor:
    """Ordinary (pageable) host memory for what the engine keeps on the host whatever it computes on: offloaded
    masters and their start values, the staging of files. Under the simulation it is host memory, not the
    simulated device's (`DeviceMemory`)."""
    return _in_host_memory(lambda: (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=HOST))


def _in_host_memory(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    return sim.in_host_memory(make) if simulating() else make()


def in_host_memory(src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`src` in host memory (as `dtype`): itself when it is there, else copied into ordinary (pageable) memory,
    filled when this returns. For one-off copies, such as a checkpoint's pieces, which pinned memory would keep
    page-locked for good (`host_empty`). A copy from the device into pageable memory is synchronous: no copy to
    wait on. Under the simulation always a copy: the simulated device's memory is apart from the host's."""
    if not simulating():
        return src.to(HOST, dtype).contiguous()
    if sim.checker is not None:  # synchronous: the host waits for the stream, which reads the source
        sim.checker.access(sim.stream_now(), [src], [], "a synchronous copy to the host")
        sim.checker.wait_stream(HOST_STREAM, sim.stream_now())
    return sim.in_host_memory(lambda: src.to(HOST, dtype, copy=True).contiguous())


def pinned_host_bytes() -> tuple[int, int]:
    """(now, peak since `reset_pinned_peak`) bytes of page-locked host memory this process holds: on a GPU
    what the caching host allocator holds, cached blocks included, and `host_buffers_for_good`'s blocks; under the
    simulation the as-if-pinned buffers alive; else none."""
    if simulating():
        return sim.pinned["now"], sim.pinned["peak"]
    if has_accelerator() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        # The two peaks may not have fallen together: their sum bounds the peak from above.
        return (stats.get("allocated_bytes.current", 0) + _page_locked["now"],
                stats.get("allocated_bytes.peak", 0) + _page_locked["peak"])
    return 0, 0


def reset_pinned_peak() -> None:
    if simulating():
        sim.pinned["peak"] = sim.pinned["now"]
    elif has_accelerator() and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
        _page_locked["peak"] = _page_locked["now"]


# ---- device memory given back and taken again -----------------------------------------------------
def release_storage(tensor: torch.Tensor, what: str = "a buffer's release") -> None:
    """Frees a tensor's memory but keeps the tensor and its storage object, so views of it (autograd's
    saved ones, an optimizer's) stay valid and see the memory once `allocate_storage` gives it back. The
    allocator hands the memory to its stream's next allocation at once: every other stream that used it must be
    done (the stream checker holds it to that)."""
    if sim.checker is not None:
        sim.checker.free(tensor, what)
    tensor.untyped_storage().resize_(0)


def allocate_storage(tensor: torch.Tensor) -> bool:
    """Gives a released tensor its memory back (uninitialised), from the stream the caller queues on now;
    False when it already had it."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() >= nbytes:
        return False
    tensor.untyped_storage().resize_(nbytes)
    if sim.checker is not None:
        sim.checker.allocated(tensor, sim.stream_now())
    return True


# ---- copies ------------------------------------------------------------------------------------
@dataclass(eq=False)
class Copy:
    """A queued copy. `wait()` blocks the host until it (and every copy queued before it) has landed."""
    name: str
    host: torch.Tensor  # the host side: the source of a copy to the device, the destination of one to the host
    to_device: bool
    event: Event = NO_WORK
    stream: str = COMPUTE
    queued: sim.QueuedCopy | None = None  # under the simulation: the copy as the simulation holds it back

    @property
    def landed(self) -> bool:
        return self.queued is None or self.queued.landed

    def wait(self) -> None:
        """The host waits until the copy (and every copy queued before it on its stream) has landed."""
        if self.queued is not None:
            sim.engine.land_through(self.queued)
        else:
            self.event.synchronize()

    def ready(self) -> None:
        """The stream the caller queues on now waits for the copy (its destination may be read there); the host
        does not: the source of a copy to the device stays lent until `wait`."""
        if self.queued is not None:
            sim.engine.ready(self.queued)
        else:
            self.event.wait()


DONE = Copy("done", torch.empty(0), to_device=True)


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


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str, to_device: bool, overlap: bool) -> Copy:
    host, on_device = (src, dst) if to_device else (dst, src)
    if simulating():
        stream = COPY if overlap else sim.stream_now()
        if overlap and sim.checker is not None:
            sim.checker.record_stream(on_device, COPY)
        return Copy(name, host, to_device, stream=stream, queued=sim.engine.queue(dst, src, name, to_device, stream))
    if not has_accelerator() or dst.device == src.device:
        dst.copy_(src)  # within host memory (or within the device) a copy is ordered like any other work
        return DONE
    if not overlap:
        _delay_device("compute")
        dst.copy_(src, non_blocking=True)
        return Copy(name, host, to_device, record_event(on_device.device))
    side = _copy_stream(on_device.device)
    # The compute queued so far wrote the source (to the host), or used the block the allocator just gave the
    # destination (to the device): the copy starts after it.
    side.wait_stream(torch.cuda.current_stream(on_device.device))
    with torch.cuda.stream(side):
        _delay_device("copy")
        dst.copy_(src, non_blocking=True)
        event = record_event(on_device.device)
    # The allocator reuses a freed block in the order of the stream that allocated it: keep this one from compute
    # until the copy stream is done with it, should the compute stream drop the tensor first.
    on_device.record_stream(side)
    return Copy(name, host, to_device, event, stream=COPY)


# ---- collectives ---------------------------------------------------------------------------------
def collective_issued(group: str, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str) -> Event:
    """A collective of process group `group` is issued now from the stream the caller queues on: as NCCL runs it,
    on the group's own stream, after the work queued so far on the caller's, reading `reads` and writing
    `writes`. Returns the event of its end, which its handle's wait() makes the waiting stream wait on. On a GPU
    NCCL does all of this itself (NO_WORK); under the simulation the stream checker is told."""
    if sim.checker is None:
        return NO_WORK
    stream = f"collectives of {group}"
    sim.checker.wait_stream(stream, sim.stream_now())
    sim.checker.access(stream, reads, writes, what)
    return Event(simulated=sim.checker.record(stream))


def quiet() -> contextlib.AbstractContextManager:
    """The ops inside move a collective's data as its backend does (declared by `collective_issued`)."""
    return sim.quiet() if sim.checker is not None else contextlib.nullcontext()


# ---- the communication stream ----------------------------------------------------------------
@dataclass(eq=False)
class Reduction:
    """A collective submitted to the communication stream (`CommStream.submit`)."""
    launch: Callable[[], Any]  # issues the collective and returns its work handle
    settle: Callable[[], None]  # device work once it is done (this rank's chunk into its shard)
    issued: Event = NO_WORK  # the submitting stream's work before it (simulation: what it waits on when it runs)
    event: Event = NO_WORK  # recorded on the communication stream after settle
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
    simulation the whole reduction runs at `wait` ("late"), as late as a GPU may run it, ordered after the work
    queued before its submit only: a bucket the host writes again before waiting is reduced with the wrong values
    and refused by the stream checker, and a shard read before waiting misses the reduction. "early": it runs
    whole at `submit`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
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
                reduction.event = record_event(self.stream.device)
            reduction.settled = True
            return reduction
        reduction.issued = record_event(self.device)
        mode = sim.simulation()
        if mode != "late":
            with sim.on_stream(COMM):
                reduction.work = launch()
        self.queued.append(reduction)
        if mode == "early":
            self.wait(reduction)
        return reduction

    def done(self, reduction: Reduction) -> bool:
        """Whether waiting on `reduction` would not hold anything up (a GPU: its event has passed)."""
        if reduction.event.cuda is not None:
            return reduction.event.query()
        return reduction.settled or (reduction.work is not None and reduction.work.is_completed())

    def wait(self, reduction: Reduction) -> None:
        """The compute stream (the host, on CPU) waits for `reduction` and every one submitted before it."""
        if self.stream is not None:
            reduction.event.wait()
            return
        while not reduction.settled:
            earliest = self.queued.pop(0)
            # Under the simulation "late" the reduction runs only now, ordered after what was queued before its
            # submit (`issued`), not after what the host did since.
            with sim.on_stream(COMM), sim.issued_earlier():
                earliest.issued.wait()
                work = earliest.work if earliest.work is not None else earliest.launch()
                work.wait()
                earliest.settle()
                earliest.event = record_event(self.device)
            earliest.settled = True
        reduction.event.wait()
        if simulating():  # the compute stream's later copies come after the settles' copies
            sim.engine.order(COMM, COMPUTE)

    def join(self) -> None:
        """The compute stream waits for every reduction submitted so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        elif self.queued:
            self.wait(self.queued[-1])


# ---- host access ------------------------------------------------------------------------------
def check_host_access(tensor: torch.Tensor, writing: bool) -> None:
    """Raises PendingCopyError when the host may not yet read (or write) `tensor`: a queued copy still reads
    it (writing only) or will still write it, and StreamOrderError when a stream's access to it is not ordered
    before the host's. Checked by file I/O and the C++ kernels; simulation only."""
    if simulating():
        sim.engine.check_access(tensor, writing)


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
