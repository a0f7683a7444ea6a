"""Process groups: join the one torchrun set up, or start local gloo ranks for tests and demos."""
from __future__ import annotations

import atexit
import functools
import os
import socket
from datetime import timedelta
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_distributed(backend: str | None = None) -> None:
    """Initialises torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).
    A single process without that environment runs without a process group."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


@functools.cache  # registers once per process
def destroy_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits, if the script has not. Scripts
    written for the Trainer never do, and a gloo group left to interpreter finalization can abort the
    process (SIGABRT, "terminate called without an active exception") after the work is done: its
    worker threads still hold work objects whose tensors need the GIL (pytorch/pytorch#179291)."""
    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A bounded timeout turns a collective one rank never joins into an error instead of a hung run.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """Runs fn(*args) on `world_size` local CPU ranks over gloo on 127.0.0.1 and returns each rank's result.
    `fn` must be importable (defined at module level); results travel through torch.save."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, threads),
                           nprocs=world_size, start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
