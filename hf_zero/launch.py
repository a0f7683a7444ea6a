"""Process groups: join the one torchrun set up, or start local gloo ranks for tests and demos."""
from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import socket
import sys
import tempfile
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zero.device import has_accelerator, use_local_accelerator


def processes_per_node(world_size: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE: the processes on this node (all `world_size` of them when it is not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


COLLECTIVE_TIMEOUT_ENV = "HF_ZERO_COLLECTIVE_TIMEOUT"


def collective_timeout(default: timedelta | None) -> timedelta | None:
    """How long a rank waits in one collective for the others before it fails: HF_ZERO_COLLECTIVE_TIMEOUT
    seconds where that is set (the test suite sets 40, so that a hung collective fails its test within a
    minute), else `default` (None: torch's own, 30 minutes)."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if text is None:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV} must be a positive number of seconds; got {text!r}")
    return timedelta(seconds=seconds)


def init_distributed(backend: str | None = None) -> None:
    """Initialises torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).
    A single process without that environment runs without a process group."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if backend is None:
        backend = "nccl" if has_accelerator() else "gloo"
    if backend == "nccl":
        use_local_accelerator(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=collective_timeout(None))


@functools.cache  # registers once per process
def destroy_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits, if the script has not (scripts
    written for the Trainer never do), so that gloo's worker threads are joined while the interpreter is
    whole: a worker that needs the GIL during finalization, to drop a tensor it held last, aborts the
    process (pytorch/pytorch#179291). The threads go only with the last reference to the group; DeepSpeed,
    when something imports it, keeps one in its functions' default arguments."""
    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def exit_skipping_teardown(code: int | str | None) -> NoReturn:
    """Ends a rank the way `sys.exit(code)` would, without the interpreter's teardown. Non-daemon threads are
    joined, the atexit handlers run (the process group is destroyed, logs flushed) and the standard streams
    are flushed; what is skipped is the destruction of modules and C++ statics, where a library's thread
    that outlives its owner makes the process abort ("terminate called without an active exception", seen
    rarely at the exit of Trainer scripts). A rank that finished its work cannot fail after it."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # As the interpreter does first: threading's own exit hooks run (they tell thread pools' idle workers to
    # stop, hf_zero's NVMe and delayed-update pools among them), then the non-daemon threads are joined.
    # Joining without the hooks waited forever on those workers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


def say_once(message: str) -> None:
    """Prints `message` (the same error on every rank) from rank 0 alone, before any rank exits. Under torchrun
    the other ranks wait for rank 0 to have printed it: torchrun stops every process as soon as one exits
    with an error, and would stop rank 0 before it said anything."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    with contextlib.suppress(Exception):  # the store gone, or rank 0 died otherwise: exit anyway
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=60))
        if rank == 0:
            store.set("hf_zero/said", "1")
        else:
            store.wait(["hf_zero/said"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            threads: int, environ: dict[str, str]) -> None:
    torch.set_num_threads(threads)
    os.environ.clear()  # the caller's environment, not the one a forkserver started with
    os.environ.update(environ)
    # What torchrun sets for ranks on one node (accelerate would otherwise fill in LOCAL_WORLD_SIZE=1).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    # A bounded timeout turns a collective one rank never joins into an error instead of a hung run.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=collective_timeout(timedelta(minutes=5)))
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except Exception as e:
        raise RuntimeError(f"rank {rank} of {world_size} failed{_while_in_collective(e)}: "
                           f"{type(e).__name__}: {e}") from e
    finally:
        dist.destroy_process_group()


def _while_in_collective(error: BaseException) -> str:
    """", waiting in <collective> called from <file:line>" when `error` came out of a torch.distributed call
    (the engine's own collectives name themselves: hf_zero.comm.CollectiveError), else ""."""
    torch_distributed = os.path.dirname(dist.__file__)
    frames = traceback.extract_tb(error.__traceback__)
    for i, frame in enumerate(frames):
        if frame.filename == dist.distributed_c10d.__file__:
            caller = ([f for f in frames[:i] if not f.filename.startswith(torch_distributed)] or [frame])[-1]
            return f", waiting in torch.distributed.{frame.name} called from {caller.filename}:{caller.lineno}"
    return ""


# Ranks are forked from one server process that imported these once: a spawned rank re-imports torch
# and transformers, seconds per rank on a small machine, and a test suite starts ranks by the hundred.
FORKSERVER_PRELOAD = ["torch", "transformers", "hf_zero.trainer"]


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
               start_method: str = "forkserver") -> list[Any]:
    """Runs fn(*args) on `world_size` local CPU ranks over gloo on 127.0.0.1 and returns each rank's result.
    `fn` must be importable (defined at module level); results travel through torch.save; ranks get the
    caller's environment.
    By default ranks are forked from a forkserver (never from the caller, whose threads and accelerator
    state a fork would copy). "spawn" starts fresh interpreters instead, for runs that measure a process's
    own memory (a fork inherits the server's allocator state) or need a variable that a preloaded module
    reads when imported (HF_ENDPOINT, by huggingface_hub) set after the server started."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method is 'forkserver' or 'spawn', not {start_method!r}")
    if start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, threads, dict(os.environ)),
                           nprocs=world_size, start_method=start_method)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
