"""ZeRO-Infinity's NVMe tier for the optimizer: this rank's fp32 masters and Adam moments live in files
and stream through a fixed pool of host buffers, one tile at a time.

Each step walks this rank's elements in tiles of `tile_numel`. Three buffer slots rotate: while the
update runs on one tile, the next tile is being read and the previous one written, by two I/O threads
(`os.preadv` / `os.pwritev`, through the device layer's files, release the GIL). Host memory is the pool,
3 x 12 bytes x tile_numel, however large the model.

Every state has two files, A and B: a step reads one and writes the other, and only a step that wrote
every tile switches to the new side. A failed write (a full disk, a removed drive) therefore leaves the
last good state untouched, and the error says which file. The files are fully allocated when the
engine is built, so a disk too small is refused before training starts.

With `offload_param: nvme` (stage 3) the compute-dtype parameter shard is one more file pair in the
same tile stream: each tile's update writes the new parameters beside the new states, so parameters and
states switch sides together. Units read their chunk from the published side (`ParamReader`) when they
are gathered; the side is published only when the step is handed to the model, so a delayed update
writing the other side never shows the forward a half-written shard.

At stages 2-3 the reduced gradient shard is in files too (`accumulate_grad`), as ZeRO-Infinity offloads
gradients with the optimizer states: each bucket's reduced chunk is written (or added, over accumulation
steps) as it lands during backward, and the step reads it back tile by tile beside the states. Host memory
then holds no gradient shard at all (4 bytes per element of this rank's shard in fp32). The gradient files
have two sides as well: `seal_grads` hands the side a backward wrote to the step and sends the next
backward to the other one, so the next backward never overwrites what a delayed update still reads. Each
chunk's sum of squares is taken as it is written, so the gradient norm needs no pass over the files.
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hf_zero.optim.host import HostAdam, StagedOutputs, adamw_mode_of
from hf_zero.optim.update import UpdateBackend
from hf_zero.runtime.device import (
    HOST,
    Copy,
    LatestCopy,
    check_host_access,
    host_empty,
    host_memory_empty,
    in_host_memory,
    nvme_files,
)
from hf_zero.runtime.trace import spanned
from hf_zero.settings.config import nvme_path_problem

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")  # fp32, read and written by every step
SLOTS = 3  # reading the next tile, updating this one, writing the last one


class NvmeError(RuntimeError):
    """An NVMe read or write failed; the message names the file. The previous state is intact."""


@dataclass
class Tile:
    g: int       # param group
    k: int       # chunk within the group
    lo: int      # elements [lo, hi) of the chunk
    hi: int
    start: int   # element offset of the tile in the group's files


def check_nvme_path(path: str | os.PathLike) -> Path:
    """The folder must exist and be writable (ZeroConfig checked it already; it may have changed since)."""
    problem = nvme_path_problem(path)
    if problem:
        raise NvmeError(f"nvme_path {problem}")
    return Path(path)


class NvmeAdamStates:
    """The masters and Adam moments of this rank's chunks in files, stepped tile by tile with HostAdam;
    with `param_dtype`, the compute-dtype parameters too (offload_param nvme); with `grad_dtype`, the
    reduced gradients (stages 2-3)."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, chunk_numels: list[list[int]],
                 fp32_init: list[list[torch.Tensor]], host_adam: HostAdam, tile_numel: int,
                 param_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None) -> None:
        self.files = nvme_files()
        self.folder = check_nvme_path(nvme_path) / f"rank{rank:05d}"
        self.files.fresh_folder(self.folder)
        self.host_adam, self.tile_numel = host_adam, tile_numel
        self.chunk_numels = chunk_numels
        self.chunk_starts = [[sum(numels[:k]) for k in range(len(numels))] for numels in chunk_numels]
        self.dtypes = {kind: torch.float32 for kind in STATE_KINDS}
        if param_dtype is not None:
            self.dtypes["param"] = param_dtype
        self.holds_params = param_dtype is not None
        if grad_dtype is not None:
            self.dtypes["grad"] = grad_dtype
        self.holds_grads = grad_dtype is not None
        self.grad_write_side = 0  # the side the backward writes; the step reads `grad_read_side`
        self.grad_read_side = 1
        self.grads_written: set[tuple[int, int]] = set()  # chunks the current write side holds values of
        # The fp64 sums of squares of what they hold, as Python floats: a few bytes each, and no small tensor
        # allocated between the I/O thread's temporaries for the whole backward (which kept tens of MiB of
        # glibc's heap from going back).
        self.grad_square_sums: dict[tuple[int, int], float] = {}
        # How a chunk's sum of squares is taken: the optimizer's (UpdateBackend.measure_grads_with).
        self.square_sum: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
        self.steps = [torch.tensor(0.0) for _ in chunk_numels]  # Adam's step, one per param group
        self.side = 0  # which of the A/B files hold the current state
        self.published_side = 0  # which side the model's parameters are read from (offload_param nvme)
        self.fds: dict[tuple[int, str, int], int] = {}
        for g, numels in enumerate(chunk_numels):
            for kind, dtype in self.dtypes.items():
                for side in (0, 1):
                    self.fds[(g, kind, side)] = self._allocate(self._path(g, kind, side),
                                                               sum(numels) * dtype.itemsize)
        tile = min(tile_numel, max((n for numels in chunk_numels for n in numels), default=1))
        # Ordinary memory: the slots go between the files and the kernel, and no device copy reads them.
        self.slots = [{kind: host_memory_empty(tile, dtype) for kind, dtype in self.dtypes.items()}
                      for _ in range(SLOTS)]
        self.io = self.files.executor(2, "hf_zero-nvme")
        # Adam's moments start at zero, which the new files read as: only the masters are written (a zeroed
        # buffer of a shard's size for the moments was that much more host memory and 2x the disk writes).
        for g, chunks in enumerate(fp32_init):
            for k, values in enumerate(chunks):
                self.write_chunk(g, k, {"master": values.reshape(-1)}, side=self.side)

    def _path(self, g: int, kind: str, side: int) -> Path:
        return self.folder / f"group{g}.{kind}.{'AB'[side]}"

    def _allocate(self, path: Path, nbytes: int) -> int:
        try:
            return self.files.allocate(path, nbytes)
        except OSError as error:
            free = shutil.disk_usage(self.folder).free
            raise NvmeError(f"cannot allocate {nbytes / 2**20:.1f} MiB for {path} ({os.strerror(error.errno)}); "
                            f"{free / 2**20:.1f} MiB free under nvme_path. Free space or choose another "
                            f"nvme_path") from error

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def file_bytes(self) -> int:
        numel = sum(sum(numels) for numels in self.chunk_numels)
        return 2 * numel * sum(dtype.itemsize for dtype in self.dtypes.values())

    # ---- file I/O --------------------------------------------------------------------------------
    def _io(self, read: bool, g: int, kind: str, side: int, start: int, tensor: torch.Tensor) -> None:
        """Reads or writes `tensor` at element `start` of a state's file."""
        offset = start * self.dtypes[kind].itemsize
        check_host_access(tensor, writing=read)
        try:
            self.files.transfer(self.fds[(g, kind, side)], tensor, offset, read)
        except OSError as error:
            raise NvmeError(f"{'reading' if read else 'writing'} {self._path(g, kind, side)} at byte {offset} "
                            f"failed: {error.strerror or error}. The optimizer state of the last completed "
                            f"step is intact") from error

    def read_chunk(self, g: int, k: int) -> dict[str, torch.Tensor]:
        """A chunk's master and moments, read into new tensors (checkpoints)."""
        values = {kind: host_memory_empty(self.chunk_numels[g][k]) for kind in STATE_KINDS}
        for kind, tensor in values.items():
            self._io(True, g, kind, self.side, self.chunk_starts[g][k], tensor)
        return values

    def write_chunk(self, g: int, k: int, values: dict[str, torch.Tensor], side: int | None = None) -> None:
        """Sets a chunk's master and moments, and parameters if given (start-up and checkpoint loading)."""
        for kind, tensor in values.items():
            self._io(False, g, kind, self.side if side is None else side, self.chunk_starts[g][k],
                     in_host_memory(tensor, self.dtypes[kind]))

    def read_param(self, g: int, k: int, out: torch.Tensor) -> None:
        """Chunk k of group g's parameters, as last published, into `out` (a unit being gathered)."""
        self._io(True, g, "param", self.published_side, self.chunk_starts[g][k], out)

    def publish(self) -> None:
        """Hands the last completed step's parameters to the model: later reads see them."""
        self.published_side = self.side

    # ---- the step --------------------------------------------------------------------------------
    def tiles(self) -> list[Tile]:
        return [Tile(g, k, lo, min(lo + self.tile_numel, n), self.chunk_starts[g][k] + lo)
                for g, numels in enumerate(self.chunk_numels) for k, n in enumerate(numels)
                for lo in range(0, n, self.tile_numel)]

    def _transfer(self, read: bool, tile: Tile, slot: dict[str, torch.Tensor], grad_side: int) -> None:
        side = self.side if read else 1 - self.side
        # Parameters are only written, gradients only read.
        kinds = [*STATE_KINDS, "grad"] if read else [*STATE_KINDS, "param"]
        for kind in (k for k in kinds if k in self.dtypes):
            self._io(read, tile.g, kind, grad_side if kind == "grad" else side, tile.start,
                     slot[kind][:tile.hi - tile.lo])

    @torch.no_grad()
    def step(self, grad_chunks: list[list[torch.Tensor]], outs: Callable[[int, int], torch.Tensor] | None,
             grad_scale: float, settings: list[dict[str, Any]] | None = None) -> None:
        """One Adam step over every tile; the new parameters go, in their dtype, to `outs(g, k)` (chunk k of
        group g's buffer, once no copy reads it) or (when the parameters live here too) to the files. The gradients
        are `grad_chunks`, or when they live here the side `seal_grads` last handed over. `settings`: the param
        groups' hyper-parameters (HostAdam.step_chunk)."""
        tiles = self.tiles()
        grad_side = self.grad_read_side  # taken now: seal_grads may hand over the next side while this runs
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        try:
            if tiles:
                reads[0] = self.io.submit(self._transfer, True, tiles[0], self.slots[0], grad_side)
            for i, tile in enumerate(tiles):
                if i + 1 < len(tiles):  # prefetch the next tile once its slot's last write is done
                    nxt = (i + 1) % SLOTS
                    if nxt in writes:
                        writes.pop(nxt).result()
                    reads[i + 1] = self.io.submit(self._transfer, True, tiles[i + 1], self.slots[nxt], grad_side)
                reads.pop(i).result()
                slot = self.slots[i % SLOTS]
                n = tile.hi - tile.lo
                state = {"step": self.steps[tile.g].clone(), "exp_avg": slot["exp_avg"][:n],
                         "exp_avg_sq": slot["exp_avg_sq"][:n]}
                grad = slot["grad"][:n] if self.holds_grads else grad_chunks[tile.g][tile.k][tile.lo:tile.hi].to(HOST)
                out = slot["param"][:n] if self.holds_params else outs(tile.g, tile.k)[tile.lo:tile.hi]
                self.host_adam.step_chunk(tile.g, slot["master"][:n], grad, out, grad_scale, state, settings)
                writes[i % SLOTS] = self.io.submit(self._transfer, False, tile, slot, grad_side)
        finally:  # never leave I/O running into the next step, even when one failed
            pending = list(reads.values()) + list(writes.values())
            errors = [f.exception() for f in pending]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        self.steps = [s + 1 for s in self.steps]
        self.side = 1 - self.side  # only now: a failure above leaves the previous side current

    # ---- gradients (stages 2-3) -------------------------------------------------------------------
    def accumulate_grad(self, g: int, k: int, values: torch.Tensor) -> Future:
        """Adds a reduced chunk into chunk k of group g's gradient in the background (an I/O thread):
        written as it is on the first backward since the gradients were handed over or cleared, read, added
        to and written back on later ones (accumulation). `values` (host memory) must stay as they are
        until the returned future is done."""
        return self.io.submit(self._accumulate_grad, g, k, values)

    def _accumulate_grad(self, g: int, k: int, values: torch.Tensor) -> None:
        side, start = self.grad_write_side, self.chunk_starts[g][k]
        total = values
        if (g, k) in self.grads_written:
            total = host_memory_empty(values.numel(), values.dtype)
            self._io(True, g, "grad", side, start, total)
            total.add_(values)
        self.grad_square_sums[(g, k)] = self.square_sum(g, k, total).item()
        self._io(False, g, "grad", side, start, total)
        self.grads_written.add((g, k))

    def grad_square_sum(self, g: int, k: int) -> torch.Tensor:
        """The fp64 sum of squares of chunk k of group g's gradient as accumulated so far (0 if none came)."""
        return torch.tensor(self.grad_square_sums.get((g, k), 0.0), dtype=torch.float64)

    def seal_grads(self) -> None:
        """The gradients written so far go to the next step; the next backward writes the other side."""
        self.grad_read_side, self.grad_write_side = self.grad_write_side, 1 - self.grad_write_side
        self.clear_grads()

    def clear_grads(self) -> None:
        """The next backward's gradients start from zero (what the write side holds is not read again)."""
        self.grads_written.clear()
        self.grad_square_sums.clear()

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for fd in self.fds.values():
            self.files.close(fd)
        self.fds.clear()


class NvmeUpdate(UpdateBackend):
    """ZeRO-Infinity: the masters and Adam moments in files (NvmeAdamStates), stepped tile by tile on the
    host. With `params_on_nvme` (offload_param nvme) the compute-dtype parameters are in the same files and
    stage-3 units read them from there; otherwise the new values are staged in host buffers and copied to
    the parameter chunks on publish(), so that a step failing half-way leaves the model at the last good step.
    The optimizer's param groups keep the chunks as placeholders: the masters are in the files."""

    states_in_optimizer = False
    untouched_refused_by = "offload_optimizer nvme"

    def __init__(self, optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                 fp32_init: list[list[torch.Tensor]] | None, nvme_path: str, rank: int, tile_numel: int,
                 params_on_nvme: bool, chunks_lent: LatestCopy | None, grad_dtype: torch.dtype | None,
                 delayed: bool = False) -> None:
        """`grad_dtype`: the reduced gradients live in the files too, in that dtype (stages 2-3). `delayed`: the steps
        run in the background during the next forward and backward."""
        super().__init__(optimizer, param_chunks, chunks_lent)
        param_dtype = param_chunks[0][0].dtype if params_on_nvme else None
        self.states = NvmeAdamStates(nvme_path, rank, [[c.numel() for c in cs] for cs in param_chunks],
                                     fp32_init or param_chunks,
                                     HostAdam(optimizer, adamw_mode_of(optimizer), beside_the_device=delayed),
                                     tile_numel, param_dtype, grad_dtype)
        if params_on_nvme:
            for g, chunks in enumerate(param_chunks):
                for k, chunk in enumerate(chunks):
                    self.states.write_chunk(g, k, {"param": chunk})
        self.outputs = None if params_on_nvme else StagedOutputs(param_chunks, staged=True)
        self.masters = param_chunks
        self._retarget()

    @spanned("nvme_step")
    def step(self, coef: float, grad_chunks: list[list[torch.Tensor]],
             settings: list[dict[str, Any]] | None = None) -> None:
        self.states.step(grad_chunks, None if self.outputs is None else self.outputs.writable, coef, settings)

    def gradient_files(self) -> NvmeAdamStates | None:
        return self.states if self.states.holds_grads else None

    def take_grads(self, grad_chunks: list[list[torch.Tensor]], keep: bool) -> list[list[torch.Tensor]]:
        if not self.states.holds_grads:
            return super().take_grads(grad_chunks, keep)
        self.states.seal_grads()  # the step reads what the backward wrote; the next backward the other side
        return grad_chunks  # placeholders: the step reads the files

    def measure_grads_with(self, square_sum: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        super().measure_grads_with(square_sum)
        self.states.square_sum = square_sum  # taken as each chunk is written

    def grad_square_sums(self, grad_chunks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        if not self.states.holds_grads:
            return super().grad_square_sums(grad_chunks)
        return [self.states.grad_square_sum(g, k) for g, grads in enumerate(grad_chunks) for k in range(len(grads))]

    def publish(self) -> None:
        if self.outputs is None:
            self.states.publish()
        else:
            self._writable_chunks()
            self.outputs.publish()

    def chunk_state(self, g: int, k: int) -> tuple[torch.Tensor, dict[str, Any]]:
        values = self.states.read_chunk(g, k)
        master = values.pop("master")
        return master, ({"step": self.states.steps[g], **values} if self.states.steps[g] > 0 else {})

    def load_chunk(self, g: int, k: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        """A state without moments (saved before the first step) starts Adam again, as torch's load_state_dict
        leaves an optimizer: zero moments and step 0, whatever this engine had stepped."""
        params = {"param": master} if self.outputs is None else {}
        moments = {kind: state[kind] for kind in ("exp_avg", "exp_avg_sq") if kind in state}
        if "step" not in state:
            zeros = host_memory_empty(master.numel(), zeroed=True)
            moments = {"exp_avg": zeros, "exp_avg_sq": zeros}
        self.states.write_chunk(g, k, {"master": master, **params, **moments})
        self.states.steps[g] = torch.tensor(float(state.get("step", 0)))
        if self.outputs is not None:
            self._writable_chunks()[g][k].copy_(master)

    def held_bytes(self) -> int:
        """The pool; the files are reported by states.file_bytes()."""
        return self.states.pool_bytes()

    def param_reader(self) -> "ParamReader | None":
        return ParamReader(self.states) if self.outputs is None else None


class ParamReader:
    """Host buffers for the parameter chunks of stage-3 units being gathered (offload_param nvme).

    A chunk is read into a buffer that stays lent until its unit's all-gather has finished and is given back
    with the copy that still reads it to the device (`release`); it is refilled only once that copy has landed.
    Buffers are reused: a read takes the longest released buffer that is large enough, else a new one of the
    chunk's own size. The pool therefore grows to the chunks in flight at once (the unit in use and those
    prefetched, bounded by prefetch_bucket_size), not to the shard, and a model whose root chunk (a vocabulary
    embedding) is several blocks large does not make every buffer that large."""

    def __init__(self, states: NvmeAdamStates) -> None:
        self.states = states
        self.free: list[tuple[torch.Tensor, Copy]] = []
        self.buffers: list[torch.Tensor] = []  # every buffer created

    def read(self, g: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk k of group g, the pool buffer it lies in: give it back with `release`)."""
        numel = self.states.chunk_numels[g][k]
        # The longest released first: its copy is the likeliest to have landed.
        fits = next((i for i, (buffer, _) in enumerate(self.free) if buffer.numel() >= numel), None)
        if fits is not None:
            buffer, copy = self.free.pop(fits)
            copy.wait()
        else:
            buffer = host_empty(numel, self.states.dtypes["param"])
            self.buffers.append(buffer)
        chunk = buffer[:numel]
        self.states.read_param(g, k, chunk)
        return chunk, buffer

    def release(self, buffer: torch.Tensor, copy: Copy) -> None:
        """Gives `buffer` back; `copy` (to the device) may still be reading it."""
        self.free.append((buffer, copy))

    def pool_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
