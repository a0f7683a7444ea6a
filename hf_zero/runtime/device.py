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
them.

What each of these does is the timeline's in force (`timeline`, hf_zero/runtime/timeline.py): CUDA streams and
events beside an accelerator (hf_zero/runtime/cuda_timeline.py), else the CPU's, where everything is immediate.
While `HF_ZERO_SIMULATE_ASYNC` is set, a simulated GPU that checks the rule on every op plays the GPU on CPU
instead: a test double, installed from outside (hf_zero.testing), through the one plug point here.

Copies run on one of three streams: the compute stream (the default), the communication stream (what a
reduction's landing copies, `CommStream`) and the copy stream (`overlap=True`: copies that must not hold up the
compute queued after them, such as a prefetched parameter shard or an offloaded activation checkpoint).

File I/O reads and writes the memory of host tensors only: a device address handed to the operating
system is a crash or silent garbage, so `bytes_of` refuses anything else. The files ZeRO-Infinity keeps its states
in are the timeline's too (`nvme_files`): the disk's, or a plan's count of their bytes.
"""
from __future__ import annotations

import contextlib
import importlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hf_zero.runtime.cuda_timeline import Cuda, after_current, delay
from hf_zero.runtime.files import Files, host_bytes
from hf_zero.runtime.timeline import COMM, DONE, HOST, IMMEDIATE, NO_WORK, Copy, Event, Timeline
from hf_zero.runtime.trace import span
from hf_zero.settings.environment import simulation


def has_accelerator() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """Where this process computes: its accelerator (chosen by `use_local_accelerator`), else the host. Ranks
    of a gloo process group compute on the host even beside a GPU (`--use_cpu`, local test ranks): their
    collectives run on host tensors, and several of them would otherwise share, or look for, one GPU."""
    if not has_accelerator() or (dist.is_initialized() and dist.get_backend() in HOST_BACKENDS):
        return HOST
    return torch.device("cuda", torch.cuda.current_device())


# Process groups whose collectives take host tensors: gloo's, and torch's fake one (a simulated world: `hf-zero plan`).
HOST_BACKENDS = ("gloo", "fake")


def use_local_accelerator(local_rank: int) -> None:
    """Makes accelerator `local_rank` (torchrun's LOCAL_RANK: one per process on a node) this process's own."""
    torch.cuda.set_device(local_rank)


# ---- the timeline in force ----------------------------------------------------------------------
_CUDA = Cuda()
_simulated: Timeline | None = None  # the simulated GPU's timeline, once installed (`install`)
_in_force: Timeline | None = None  # a timeline put in force from outside for a while (`timeline_in_force`)


def install(simulated: Timeline | None) -> None:
    """Makes `simulated` the timeline while HF_ZERO_SIMULATE_ASYNC is set: how the simulated GPU (or a test's
    setup) plugs in. None takes it out; the next device work under the variable installs the simulated GPU anew."""
    global _simulated
    _simulated = simulated


@contextlib.contextmanager
def timeline_in_force(line: Timeline) -> Iterator[None]:
    """Device work inside goes to `line`, whatever the machine: how a plan's simulated rank (hf_zero.plan) counts
    what the engine allocates where, on a machine that may have no accelerator."""
    global _in_force
    before, _in_force = _in_force, line
    try:
        yield
    finally:
        _in_force = before


def timeline() -> Timeline:
    """The timeline device work goes to now: one put in force (`timeline_in_force`), else the simulated GPU's while
    HF_ZERO_SIMULATE_ASYNC is set, else CUDA's beside an accelerator, else the CPU's. The simulated GPU is installed
    at the first device work under the variable (a rank's start, a spawned rank's, a test's), through this, the one
    place the runtime names it."""
    if _in_force is not None:
        return _in_force
    if simulation() is None:
        return _CUDA if has_accelerator() else IMMEDIATE
    if _simulated is None:
        importlib.import_module("hf_zero.testing.simulated_gpu").install()
    return _simulated


# ---- streams and events -------------------------------------------------------------------------
def record_event(device: torch.device | None = None) -> Event:
    """An event for the work queued so far on the stream the caller queues on now (of `device`, by default the
    one this process computes on)."""
    return timeline().record(device if device is not None else compute_device())


def on_copy_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """Device work issued inside runs on `device`'s copy stream, after the copies queued there (`overlap=True`)
    and after the work queued so far on the stream the caller was on (which wrote what it reads, and used the
    memory the allocator gave what it fills), without holding up the compute queued after it. Whoever reads
    what it wrote waits on an event recorded inside (`record_event`), or on its collective's handle, first."""
    return timeline().on_copy_stream(device)


# ---- host threads beside the one driving the device ---------------------------------------------
def run_beside(pool: ThreadPoolExecutor, work: Callable[[], None], name: str) -> Future:
    """Submits `work` to `pool`'s thread, which runs it beside the thread that drives the device; `joined` waits for
    it. Under the stream checker that thread is a timeline of its own, `name`: the host touching memory it writes (or
    writing memory it reads) before joining it is refused, as an unordered stream's access is."""
    return timeline().run_beside(pool, work, name)


def joined(running: Future) -> None:
    """Waits for work `run_beside` submitted, re-raising its error; what it did is ordered before the host's next op."""
    timeline().joined(running)


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
    return timeline().host_empty(numel, dtype, _pins())


def host_buffers_for_good(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Host buffers that copies use for the whole run (the offloaded gradient shards, the staged new parameters, a
    unit's offloaded parameters), uninitialised, cut from one block of exactly their size, pinned where `_pins`. Not
    from the caching host allocator, which would round the block up to a power of two and gains nothing from a block
    never handed back (the 1.31B GPT-2's 2.6 GB gradient shard took 4 GiB page-locked): the block is page-locked
    where it lies (hf_zero/runtime/pinned.py), as much as asked for, and given back with its last view."""
    total = sum(numels)
    return list(timeline().host_block(total, dtype, _pins() and total > 0).split(numels))


def host_memory_empty(numel: int, dtype: torch.dtype = torch.float32, zeroed: bool = False) -> torch.Tensor:
    """Ordinary (pageable) host memory for what the engine keeps on the host whatever it computes on: offloaded
    masters and their start values, the staging of files. Under the simulation it is host memory, not the
    simulated device's."""
    return timeline().host_memory(lambda: (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=HOST))


def in_host_memory(src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`src` in host memory (as `dtype`): itself when it is there, else copied into ordinary (pageable) memory,
    filled when this returns. For one-off copies, such as a checkpoint's pieces, which pinned memory would keep
    page-locked for good (`host_empty`). A copy from the device into pageable memory is synchronous: no copy to
    wait on. Under the simulation always a copy: the simulated device's memory is apart from the host's."""
    return timeline().host_copy(src, dtype)


def pinned_host_bytes() -> tuple[int, int]:
    """(now, peak since `reset_pinned_peak`) bytes of page-locked host memory this process holds: on a GPU
    what the caching host allocator holds, cached blocks included, and `host_buffers_for_good`'s blocks; under the
    simulation the as-if-pinned buffers alive; else none."""
    return timeline().pinned_bytes()


def reset_pinned_peak() -> None:
    timeline().reset_pinned_peak()


# ---- device memory given back and taken again -----------------------------------------------------
def release_storage(tensor: torch.Tensor, what: str = "a buffer's release") -> None:
    """Frees a tensor's memory but keeps the tensor and its storage object, so views of it (autograd's
    saved ones, an optimizer's) stay valid and see the memory once `allocate_storage` gives it back. The
    allocator hands the memory to its stream's next allocation at once: every other stream that used it must be
    done (the stream checker holds it to that)."""
    timeline().released(tensor, what)
    tensor.untyped_storage().resize_(0)


def allocate_storage(tensor: torch.Tensor) -> bool:
    """Gives a released tensor its memory back (uninitialised), from the stream the caller queues on now;
    False when it already had it."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() >= nbytes:
        return False
    tensor.untyped_storage().resize_(nbytes)
    timeline().allocated(tensor)
    return True


# ---- copies ------------------------------------------------------------------------------------
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
    with span("copy_to_device", name):
        return timeline().copy(dst, src, name, to_device=True, overlap=overlap)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, name: str, overlap: bool = False) -> Copy:
    """Queues `dst` (host, pinned on a GPU) <- `src` (device). `dst` holds the values once waited on.
    `overlap`: on the copy stream, where the compute queued after it does not wait for it."""
    with span("copy_to_host", name):
        return timeline().copy(dst, src, name, to_device=False, overlap=overlap)


def to_device(src: torch.Tensor, device: torch.device, name: str, overlap: bool = False) -> tuple[torch.Tensor, Copy]:
    """`src` (host) on `device`, and the copy that puts it there: `src` stays lent until that is waited on.
    Without a copy to make (already there, not simulating) it is `src` itself."""
    if src.device == device and not timeline().separate_memory:
        return src, DONE
    dst = torch.empty_like(src, device=device)
    return dst, copy_to_device(dst, src, name, overlap)


def to_host(src: torch.Tensor, name: str, overlap: bool = False) -> tuple[torch.Tensor, Copy]:
    """`src` (device) in a new host buffer, and the copy that fills it (wait before reading). A tensor
    already in host memory is returned as it is, unless simulating."""
    if src.device == HOST and not timeline().separate_memory:
        return src, DONE
    dst = host_empty(src.numel(), src.dtype).view(src.shape)
    return dst, copy_to_host(dst, src, name, overlap)


# ---- collectives ---------------------------------------------------------------------------------
def collective_issued(group: str, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str) -> Event:
    """A collective of process group `group` is issued now from the stream the caller queues on: as NCCL runs it,
    on the group's own stream, after the work queued so far on the caller's, reading `reads` and writing
    `writes`. Returns the event of its end, which its handle's wait() makes the waiting stream wait on. On a GPU
    NCCL does all of this itself (NO_WORK); under the simulation the stream checker is told."""
    return timeline().collective_issued(group, reads, writes, what)


def quiet() -> contextlib.AbstractContextManager:
    """The ops inside move a collective's data as its backend does (declared by `collective_issued`)."""
    return timeline().quiet()


# ---- the communication stream ----------------------------------------------------------------
@dataclass(eq=False)
class Reduction:
    """A collective submitted to the communication stream (`CommStream.submit`)."""
    launch: Callable[[], Any]  # issues the collective and returns its work handle
    land: Callable[[], None]  # device work once it is done (this rank's chunk into its shard)
    issued: Event = NO_WORK  # the submitting stream's work before it (simulation: what it waits on when it runs)
    event: Event = NO_WORK  # recorded on the communication stream after land
    work: Any = None  # CPU: the collective's handle once launched
    landed: bool = False


class CommStream:
    """Where gradient reductions run. On a GPU that is a stream of their own: each reduction waits for the
    compute work queued before it (its bucket is written), then runs its collective and lands on the
    communication stream, so backward's compute never waits on a collective. The compute stream waits on
    the communication stream only where the host is about to hand a reduction's buffers back for reuse
    (`wait`) and once at the end of backward (`join`), as FSDP2's reduce-scatter stream and DeepSpeed's
    reduction stream do. Whatever the host does with a reduction's buffers or results comes after `wait`.

    On CPU a collective runs in gloo's own thread from `submit` on, and `land` runs at `wait`. A timeline that
    runs asynchronous work late (the simulation "late") runs the whole reduction at `wait`, as late as a GPU may
    run it, ordered after the work queued before its submit only: a bucket the host writes again before waiting is
    reduced with the wrong values and refused by the stream checker, and a shard read before waiting misses the
    reduction. One that runs it early ("early") runs it whole at `submit`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.queued: list[Reduction] = []  # CPU: submitted, not yet landed, in order

    def submit(self, launch: Callable[[], Any], land: Callable[[], None]) -> Reduction:
        reduction = Reduction(launch, land)
        if self.stream is not None:
            delay("compute")
            with after_current(self.stream, "comm"):
                launch().wait()  # the communication stream waits on the collective, the host does not
                land()
                reduction.event = record_event(self.stream.device)
            reduction.landed = True
            return reduction
        line = timeline()
        reduction.issued = line.record(self.device)
        if not line.late:
            with line.on_stream(COMM):
                reduction.work = launch()
        self.queued.append(reduction)
        if line.early:
            self.wait(reduction)
        return reduction

    def done(self, reduction: Reduction) -> bool:
        """Whether waiting on `reduction` would not hold anything up (a GPU: its event has passed)."""
        if self.stream is not None:
            return reduction.event.query()
        return reduction.landed or (reduction.work is not None and reduction.work.is_completed())

    def wait(self, reduction: Reduction) -> None:
        """The compute stream (the host, on CPU) waits for `reduction` and every one submitted before it."""
        if self.stream is not None:
            reduction.event.wait()
            return
        line = timeline()
        while not reduction.landed:
            earliest = self.queued.pop(0)
            # A late timeline runs the reduction only now, ordered after what was queued before its submit
            # (`issued`), not after what the host did since.
            with line.on_stream(COMM), line.issued_earlier():
                earliest.issued.wait()
                work = earliest.work if earliest.work is not None else earliest.launch()
                work.wait()
                earliest.land()
                earliest.event = line.record(self.device)
            earliest.landed = True
        reduction.event.wait()
        line.compute_waited_on(COMM)  # the compute stream's later copies come after the landings' copies

    def join(self) -> None:
        """The compute stream waits for every reduction submitted so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        elif self.queued:
            self.wait(self.queued[-1])


# ---- files --------------------------------------------------------------------------------------
def nvme_files() -> Files:
    """The files ZeRO-Infinity's NVMe states are kept in, as the timeline in force has them: the disk, or a plan's
    count of their bytes."""
    return timeline().files()


# ---- host access ------------------------------------------------------------------------------
def check_host_access(tensor: torch.Tensor, writing: bool) -> None:
    """Raises when the host may not yet read (or write) `tensor`: under the simulation, PendingCopyError when a
    queued copy still reads it (writing only) or will still write it, and StreamOrderError when a stream's access
    to it is not ordered before the host's. Checked by file I/O and the C++ kernels."""
    timeline().check_host_access(tensor, writing)


def bytes_of(tensor: torch.Tensor, writing: bool) -> memoryview:
    """A host tensor's memory as bytes, without a copy, for file I/O that reads it or (`writing`) fills it, once the
    host may (`check_host_access`)."""
    check_host_access(tensor, writing)
    return host_bytes(tensor)
