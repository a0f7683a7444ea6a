"""ZeRO-Infinity's NVMe tier for the optimizer: this rank's fp32 masters and Adam moments live in files
and stream through a fixed pool of host buffers, one tile at a time.

Each step walks this rank's elements in tiles of `tile_numel`. Three buffer slots rotate: while the
update runs on one tile, the next tile is being read and the previous one written, by two I/O threads
(`os.preadv` / `os.pwritev` release the GIL). Host memory is the pool, 3 x 12 bytes x tile_numel, however
large the model.

Every state has two files, A and B: a step reads one and writes the other, and only a step that wrote
every tile switches to the new side. A failed write (a full disk, a removed drive) therefore leaves the
last good state untouched, and the error says which file. The files are fully allocated when the
engine is built, so a disk too small is refused before training starts.
"""
from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_zero.export import bytes_of
from hf_zero.offload.host import HOST, HostAdam, to_host_memory

KINDS = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 3  # reading the next tile, updating this one, writing the last one


class NvmeError(RuntimeError):
    """An NVMe read or write failed; the message names the file. The previous state is intact."""


@dataclass
class Tile:
    g: int       # param group
    k: int       # chunk within the group
    lo: int      # elements [lo, hi) of the chunk
    hi: int
    offset: int  # byte offset in the group's files


def check_nvme_path(path: str | os.PathLike) -> Path:
    """The folder must exist and be writable: refused with what to do before any work starts."""
    folder = Path(path)
    if not folder.is_dir():
        raise NvmeError(f"nvme_path {str(path)!r} does not exist or is not a folder; create it on the NVMe drive "
                        f"(e.g. mkdir -p {path})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise NvmeError(f"nvme_path {str(path)!r} is not writable by this process; fix its permissions or choose "
                        f"another folder")
    return folder


class NvmeAdamStates:
    """The masters and Adam moments of this rank's chunks in files, stepped tile by tile with HostAdam."""

    def __init__(self, nvme_path: str | os.PathLike, rank: int, chunk_numels: list[list[int]],
                 fp32_init: list[list[torch.Tensor]], host_adam: HostAdam, tile_numel: int) -> None:
        self.folder = check_nvme_path(nvme_path) / f"rank{rank:05d}"
        shutil.rmtree(self.folder, ignore_errors=True)  # states of an earlier run are never resumed from here
        self.folder.mkdir()
        self.host_adam, self.tile_numel = host_adam, tile_numel
        self.chunk_numels = chunk_numels
        self.chunk_offsets = [[4 * sum(numels[:k]) for k in range(len(numels))] for numels in chunk_numels]
        self.steps = [torch.tensor(0.0) for _ in chunk_numels]  # Adam's step, one per param group
        self.side = 0  # which of the A/B files hold the current state
        self.fds: dict[tuple[int, str, int], int] = {}
        for g, numels in enumerate(chunk_numels):
            for kind in KINDS:
                for side in (0, 1):
                    self.fds[(g, kind, side)] = self._allocate(self._path(g, kind, side), 4 * sum(numels))
        tile = min(tile_numel, max((n for numels in chunk_numels for n in numels), default=1))
        self.slots = [{kind: to_host_memory(torch.empty(tile)) for kind in KINDS} for _ in range(SLOTS)]
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hf_zero-nvme")
        for g, chunks in enumerate(fp32_init):
            for k, values in enumerate(chunks):
                self.write_chunk(g, k, {"master": values.reshape(-1).float(),
                                        "exp_avg": torch.zeros(values.numel()),
                                        "exp_avg_sq": torch.zeros(values.numel())}, side=self.side)

    def _path(self, g: int, kind: str, side: int) -> Path:
        return self.folder / f"group{g}.{kind}.{'AB'[side]}"

    def _allocate(self, path: Path, nbytes: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            os.close(fd)
            free = shutil.disk_usage(self.folder).free
            raise NvmeError(f"cannot allocate {nbytes / 2**20:.1f} MiB for {path} ({os.strerror(error.errno)}); "
                            f"{free / 2**20:.1f} MiB free under nvme_path. Free space or choose another "
                            f"nvme_path") from error
        return fd

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for t in slot.values())

    def file_bytes(self) -> int:
        return 2 * 12 * sum(sum(numels) for numels in self.chunk_numels)

    # ---- file I/O --------------------------------------------------------------------------------
    def _io(self, read: bool, g: int, kind: str, side: int, offset: int, tensor: torch.Tensor) -> None:
        fd, view = self.fds[(g, kind, side)], bytes_of(tensor)
        try:
            done = os.preadv(fd, [view], offset) if read else os.pwritev(fd, [view], offset)
            if done != len(view):
                raise OSError(errno.EIO, f"{'read' if read else 'wrote'} {done} of {len(view)} bytes")
        except OSError as error:
            raise NvmeError(f"{'reading' if read else 'writing'} {self._path(g, kind, side)} at byte {offset} "
                            f"failed: {error.strerror or error}. The optimizer state of the last completed "
                            f"step is intact") from error

    def read_chunk(self, g: int, k: int) -> dict[str, torch.Tensor]:
        """A chunk's master and moments, read into new tensors (checkpoints)."""
        values = {kind: torch.empty(self.chunk_numels[g][k]) for kind in KINDS}
        for kind, tensor in values.items():
            self._io(True, g, kind, self.side, self.chunk_offsets[g][k], tensor)
        return values

    def write_chunk(self, g: int, k: int, values: dict[str, torch.Tensor], side: int | None = None) -> None:
        """Sets a chunk's master and moments (start-up and checkpoint loading)."""
        for kind, tensor in values.items():
            self._io(False, g, kind, self.side if side is None else side, self.chunk_offsets[g][k],
                     tensor.contiguous())

    # ---- the step --------------------------------------------------------------------------------
    def tiles(self) -> list[Tile]:
        return [Tile(g, k, lo, min(lo + self.tile_numel, n), self.chunk_offsets[g][k] + 4 * lo)
                for g, numels in enumerate(self.chunk_numels) for k, n in enumerate(numels)
                for lo in range(0, n, self.tile_numel)]

    def _transfer(self, read: bool, tile: Tile, slot: dict[str, torch.Tensor]) -> None:
        side = self.side if read else 1 - self.side
        for kind in KINDS:
            self._io(read, tile.g, kind, side, tile.offset, slot[kind][:tile.hi - tile.lo])

    @torch.no_grad()
    def step(self, grad_chunks: list[list[torch.Tensor]], outs: list[list[torch.Tensor]], grad_scale: float) -> None:
        """One Adam step over every tile; `outs` receive the new parameters in their dtype."""
        tiles = self.tiles()
        reads: dict[int, Future] = {}
        writes: dict[int, Future] = {}
        try:
            if tiles:
                reads[0] = self.io.submit(self._transfer, True, tiles[0], self.slots[0])
            for i, tile in enumerate(tiles):
                if i + 1 < len(tiles):  # prefetch the next tile once its slot's last write is done
                    nxt = (i + 1) % SLOTS
                    if nxt in writes:
                        writes.pop(nxt).result()
                    reads[i + 1] = self.io.submit(self._transfer, True, tiles[i + 1], self.slots[nxt])
                reads.pop(i).result()
                slot = self.slots[i % SLOTS]
                n = tile.hi - tile.lo
                state = {"step": self.steps[tile.g].clone(), "exp_avg": slot["exp_avg"][:n],
                         "exp_avg_sq": slot["exp_avg_sq"][:n]}
                grad = grad_chunks[tile.g][tile.k][tile.lo:tile.hi].to(HOST)
                self.host_adam.step_chunk(tile.g, slot["master"][:n], grad, outs[tile.g][tile.k][tile.lo:tile.hi],
                                          grad_scale, state)
                writes[i % SLOTS] = self.io.submit(self._transfer, False, tile, slot)
        finally:  # never leave I/O running into the next step, even when one failed
            pending = list(reads.values()) + list(writes.values())
            errors = [f.exception() for f in pending]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed
        self.steps = [s + 1 for s in self.steps]
        self.side = 1 - self.side  # only now: a failure above leaves the previous side current

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
