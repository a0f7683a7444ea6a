"""The files ZeRO-Infinity's NVMe tier keeps a rank's states in (hf_zero.optim.nvme), through one door: the
timeline in force says which `Files` serve them (`Timeline.files`, reached through
hf_zero.runtime.device.nvme_files). A real run's are the disk's. A plan's simulated rank (hf_zero.plan) plugs in
files that count the bytes allocated, read and written: its tensors have sizes and no memory, and a plan never
touches the folder it names."""
from __future__ import annotations

import abc
import ctypes
import errno
import os
import shutil
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import torch


class Files(abc.ABC):
    """What the NVMe tier does with its files: each kind of files does all of it, so that none falls through to a
    disk it must not touch."""

    @abc.abstractmethod
    def fresh_folder(self, folder: Path) -> None:
        """An empty `folder`: what an earlier run left there is never resumed from."""

    @abc.abstractmethod
    def allocate(self, path: Path, nbytes: int) -> int:
        """A new file of `nbytes` at `path`, reading as zeros until written, its room taken now (too little fails
        here: OSError), open for reading and writing; its descriptor."""

    @abc.abstractmethod
    def transfer(self, fd: int, tensor: torch.Tensor, offset: int, read: bool) -> None:
        """Fills host tensor `tensor` from byte `offset` of the file (`read`), or writes it there; OSError when
        fewer bytes moved."""

    @abc.abstractmethod
    def close(self, fd: int) -> None:
        """The file is done with."""

    @abc.abstractmethod
    def executor(self, workers: int, name: str) -> Executor:
        """Where the transfers run beside the host's update."""


class DiskFiles(Files):
    """The disk: `os.posix_fallocate` to size a file before training starts, `os.preadv`/`os.pwritev` straight
    into and out of host tensors' memory (they release the GIL, so I/O threads overlap the host's update)."""

    def fresh_folder(self, folder: Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()

    def allocate(self, path: Path, nbytes: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            raise
        return fd

    def transfer(self, fd: int, tensor: torch.Tensor, offset: int, read: bool) -> None:
        # The caller made sure the host may touch `tensor` now (hf_zero.runtime.device.check_host_access).
        view = host_bytes(tensor)
        done = os.preadv(fd, [view], offset) if read else os.pwritev(fd, [view], offset)
        if done != len(view):
            raise OSError(errno.EIO, f"{'read' if read else 'wrote'} {done} of {len(view)} bytes")

    def close(self, fd: int) -> None:
        os.close(fd)

    def executor(self, workers: int, name: str) -> Executor:
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)


DISK = DiskFiles()


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A host tensor's memory as bytes, without a copy. Not through numpy: a storage handed to numpy can no longer be
    resized, and stage 3 frees gathered buffers by resizing their storage to zero."""
    if tensor.device.type != "cpu":
        raise ValueError(f"file I/O reads host memory; got a tensor on {tensor.device} (copy it to the host first)")
    if not tensor.is_contiguous():
        raise ValueError("file I/O needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
