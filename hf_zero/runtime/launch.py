"""Process groups: join the one torchrun set up, or start local gloo ranks for tests and demos."""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import gc
import hashlib
import json
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zero.runtime.device import has_accelerator, use_local_accelerator
from hf_zero.runtime.host_memory import mmap_threshold_from_environment
from hf_zero.settings import environment
from hf_zero.settings.environment import DEFAULT_COLLECTIVE_TIMEOUT

logger = logging.getLogger("hf_zero")


def collective_timeout(default: timedelta | None = DEFAULT_COLLECTIVE_TIMEOUT) -> timedelta | None:
    """How long a rank waits in one collective for the others before it fails: HF_ZERO_COLLECTIVE_TIMEOUT
    seconds where that is set (`--collective_timeout` of the launchers sets it; the test suite sets 40, so
    that a hung collective fails its test within a minute), else `default`."""
    return environment.collective_timeout(default)


@functools.cache  # once per process
def rendezvous_apart_from_earlier_starts() -> None:
    """After torchrun started the ranks again (--max_restarts), they meet in the store the earlier start used:
    torchrun keeps its store across restarts, and torch's env:// rendezvous adds no prefix for it (it expects a new
    store each time). A restarted rank then read the address a dead rank had published and waited on it until the
    timeout (gloo's connectFullMesh: "Connection refused"). Each start after the first meets under a prefix of its
    own: torch's env:// handler, wrapped in its registry of rendezvous handlers, for whichever code starts the
    process group (accelerate's, under the Trainer)."""
    restart = environment.restarts_so_far()
    if restart == 0:
        return
    from torch.distributed.rendezvous import (
        _rendezvous_handlers,  # register_rendezvous_handler refuses "env"
    )

    env_handler = _rendezvous_handlers["env"]

    def env_handler_of_this_start(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any):
        for store, rank, world_size in env_handler(url, timeout, **kwargs):
            yield dist.PrefixStore(f"hf_zero/restart_{restart}/", store), rank, world_size

    _rendezvous_handlers["env"] = env_handler_of_this_start


def init_distributed(backend: str | None = None) -> None:
    """Initialises torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...).
    A single process without that environment runs without a process group."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    rendezvous_apart_from_earlier_starts()
    if backend is None:
        backend = "nccl" if has_accelerator() else "gloo"
    if backend == "nccl":
        use_local_accelerator(environment.integer("LOCAL_RANK", 0, 0))
    rank, timeout = environment.integer("RANK", 0, 0), collective_timeout()
    store = _announce_joining(rank)
    try:
        dist.init_process_group(backend, timeout=timeout)
    except dist.DistError as error:  # torch's says which store key it waited for, not which rank never came
        missing = _never_started(store, rank)
        raise JoinError(f"rank {rank}: the {environment.world_size()} processes did not all join the process group "
                        f"within {timeout.total_seconds():.0f} s{_not_joined(missing)} (torch: "
                        f"{str(error).splitlines()[0]})", missing or ()) from None
    start_heartbeat()


class JoinError(RuntimeError):
    """Some rank never joined the process group: the message names it where the rendezvous store can tell, and
    `never_started` holds the ranks that never started to join."""

    def __init__(self, message: str, never_started: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.never_started = list(never_started)


def _joining_key(rank: int) -> str:
    return f"hf_zero/joining/{environment.restarts_so_far()}/{rank}"


def _announce_joining(rank: int) -> dist.TCPStore | None:
    """Tells the rendezvous store that this rank is joining the process group, so that a rank whose join times out
    can name the ranks that never came; None where the store does not answer yet (rank 0 hosts it under
    spawn_gloo, from its join on)."""
    if "MASTER_ADDR" not in os.environ or environment.world_size() == 1:
        return None
    try:
        store = _store_client()
        store.set(_joining_key(rank), "1")
        return store
    except Exception:  # no store to tell: a timeout is reported without the names
        return None


def _never_started(store: dist.TCPStore | None, me: int) -> list[int] | None:
    """The ranks other than `me` that never started to join, by the rendezvous store; None where it cannot tell."""
    if store is None:
        return None
    try:
        return [r for r in range(environment.world_size()) if r != me and not store.check([_joining_key(r)])]
    except Exception:  # the store gone: the error is said without the names
        return None


def _not_joined(missing: list[int] | None) -> str:
    if missing is None:
        return ""
    if missing:
        return (f": rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never started to join "
                f"(stopped, crashed before its join, or still starting; --collective_timeout sets how long the "
                f"others wait)")
    return ": every rank started to join, and some rank did not finish"


def rank_process_name(rank: int | str) -> str:
    """The name a rank forked by hf-zero's commands gives its process (hf_zero.cli.node_ranks.name_process), by
    which end_local_ranks tells it from its siblings."""
    return f"rank {rank}"


def end_local_ranks(ranks: list[int]) -> None:
    """Kills those of `ranks` that this rank's parent (torchrun, or hf-zero's fork server) started on this
    node, once this rank has said why the run ends: a rank stopped before its join (SIGSTOP, a debugger) acts on
    torchrun's SIGTERM only when it goes on, so torchrun waited another 30 s for its SIGKILL before the run ended.
    Elsewhere nothing."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not ranks or run_id is None:
        return
    import psutil

    wanted = {str(rank) for rank in ranks}
    names = {rank_process_name(rank) for rank in ranks}  # the ranks hf_zero.cli.node_ranks forked
    with contextlib.suppress(psutil.Error):  # torchrun gone: nobody waits
        for sibling in psutil.Process(os.getppid()).children():
            with contextlib.suppress(psutil.Error):  # it ended meanwhile, or is not ours to read
                environ = sibling.environ()  # a forked rank's is its fork server's, the one it had at its exec
                if (environ.get("TORCHELASTIC_RUN_ID") == run_id and environ.get("RANK") in wanted
                        or sibling.name() in names):
                    sibling.kill()


# ---- heartbeat: which rank stopped answering ------------------------------------------------------
# gloo and NCCL say only that a collective timed out, not which rank failed to join it. Every rank writes
# to the rendezvous store, each HEARTBEAT_SECONDS, that it is alive and which collective it issued last;
# a rank whose collective fails reads the others' (`other_ranks_report`), and its error names the rank
# that stopped answering (a rank stopped, swapping, or hung with the GIL held) or, when all are alive,
# where each one is instead (ranks that issued collectives in different orders). Ages compare the clocks of
# two nodes: they must agree within a second or two (NTP).
HEARTBEAT_SECONDS = 1.0
_heartbeat: dict[str, Any] = {}  # "latest": this rank's latest collective, described on demand


def note_collective(describe: Callable[[], str]) -> None:
    """Records this rank's latest collective (hf_zero.runtime.comm calls it for each one; formatted only when sent)."""
    _heartbeat["latest"] = describe


def _heartbeat_key(rank: int) -> str:
    return f"hf_zero/heartbeat/{environment.restarts_so_far()}/{rank}"


def _store_client() -> dist.TCPStore:
    """A connection of its own to the rendezvous store (torchrun's, or rank 0's under spawn_gloo)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=5))


@functools.cache  # one per process
def start_heartbeat() -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1 and "MASTER_ADDR" in os.environ):
        return
    try:
        store = _store_client()
    except Exception as e:  # a process group set up through another rendezvous: train on, without names
        logger.warning(f"no heartbeat: the rendezvous store at MASTER_ADDR:MASTER_PORT does not answer ({e}); a "
                       f"collective that times out will not name the rank that stopped answering")
        return
    key, stop = _heartbeat_key(dist.get_rank()), threading.Event()

    def beat() -> None:
        while not stop.is_set():
            latest = _heartbeat.get("latest")
            try:
                store.set(key, json.dumps([time.time(), latest() if latest else None]))
            except Exception:  # the store is gone (its host exited): nobody is left to read it
                return
            stop.wait(HEARTBEAT_SECONDS)

    thread = threading.Thread(target=beat, name="hf_zero heartbeat", daemon=True)
    thread.start()
    _heartbeat["ranks"] = dist.get_world_size()

    def stop_beating() -> None:  # before finalization, which would end the thread inside a C++ call and abort
        stop.set()
        thread.join()

    atexit.register(stop_beating)


def other_ranks_report() -> str:
    """What the other ranks last said through the heartbeat: those that stopped answering, or where the others
    are. Empty when there is no heartbeat (one process)."""
    if "ranks" not in _heartbeat:
        return ""
    try:
        store, now, me = _store_client(), time.time(), dist.get_rank()
        silent, elsewhere = [], []
        for rank in (r for r in range(_heartbeat["ranks"]) if r != me):
            if not store.check([_heartbeat_key(rank)]):
                silent.append(f"rank {rank} has never reported")
                continue
            when, latest = json.loads(store.get(_heartbeat_key(rank)))
            if now - when > 3 * HEARTBEAT_SECONDS:
                silent.append(f"rank {rank} has not answered for {now - when:.0f} s (the last collective it issued: "
                              f"{latest or 'none'})")
            else:
                elsewhere.append(f"{latest or f'rank {rank}: none yet'}")
    except Exception as e:  # the store's host may be what stopped (rank 0 under spawn_gloo)
        return f". The other ranks' heartbeats could not be read ({type(e).__name__}: {e})"
    if silent:
        return ". " + "; ".join(silent)
    shown = "; ".join(elsewhere[:4]) + ("; ..." if len(elsewhere) > 4 else "")
    return f". Every other rank is alive; the latest collective each issued: {shown}"


def die_with_launcher() -> None:
    """Makes this rank end when the process that started it does: torchrun, or the fork server of `hf-zero run` and
    `hf-zero train`, which ends with their launcher. So the ranks end even when the launcher is killed with SIGKILL
    and cannot stop them itself (Linux's parent-death signal; elsewhere nothing). Without it they go on training,
    reparented to init, holding the GPUs."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


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
    os._exit(finish_as_exit_would(code))


def finish_as_exit_would(code: int | str | None) -> int:
    """What the interpreter does at `sys.exit(code)` before its teardown: a message printed, the non-daemon
    threads joined, the atexit handlers run, the standard streams flushed. Returns the exit status."""
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
    return code or 0


def say_once(message: str) -> None:
    """Prints `message` on stderr once however many ranks hold it: the first rank to get there prints it (the rank
    that exits first has torchrun stop the others), and a rank whose message is another one prints that too."""
    if environment.world_size() > 1 and "MASTER_ADDR" in os.environ:
        with contextlib.suppress(Exception):  # the store gone: say it anyway
            key = f"hf_zero/said/{hashlib.sha256(message.encode()).hexdigest()}"
            if _store_client().add(key, 1) > 1:
                return
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range. A port the kernel hands out (bind to 0) is
    free only until it hands it out again, to any outgoing connection (gloo opens many), which can happen before
    the rendezvous binds it: EADDRINUSE, seen once in a suite run. Below that range only another listener can
    take it. Drawn from the system's randomness: tests reseed Python's generator."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randint(10000, max(10001, ephemeral_low - 1))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every port drawn was taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            threads: int, environ: dict[str, str]) -> None:
    # What the rank starts with, the server's imports and those unpickling fn made, lives as long as the rank: out
    # of the cyclic collector's walks (hf_zero.runtime.host_memory.start_up_frozen says what they cost).
    gc.freeze()
    torch.set_num_threads(threads)
    # A rank stopped because another failed (torch.multiprocessing sends SIGTERM) first prints every thread's stack:
    # for a rank that hung, where it hung, beside the error the rank left waiting on it raised.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # A rank that dies of a signal (SIGSEGV, SIGABRT) leaves no Python error: where each of its threads was is kept
    # for spawn_gloo's error, which would otherwise say only the signal.
    faulthandler.enable(_fatal_report(out_dir, rank).open("w"), all_threads=True)
    os.environ.clear()  # the caller's environment, not the one a forkserver started with
    os.environ.update(environ)
    mmap_threshold_from_environment()  # which glibc reads from the environment only when a process starts
    # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read it again, so that the
    # caller's setting (DETAIL's checks of every collective across ranks, or none) is the one the ranks run under.
    dist.set_debug_level_from_env()
    # What torchrun sets for ranks on one node (accelerate would otherwise fill in LOCAL_WORLD_SIZE=1).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    # A bounded timeout turns a collective one rank never joins into an error instead of a hung run.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=collective_timeout(timedelta(minutes=5)))
    start_heartbeat()
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    except Exception as e:
        waiting = _while_in_collective(e)
        raise RuntimeError(f"rank {rank} of {world_size} failed{waiting}: {type(e).__name__}: {e}"
                           f"{other_ranks_report() if waiting else ''}") from e
    finally:
        dist.destroy_process_group()


def _fatal_report(out_dir: str, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}.fatal"


def _while_in_collective(error: BaseException) -> str:
    """", waiting in <collective> called from <file:line>" when `error` came out of a torch.distributed call
    (the engine's own collectives name themselves: hf_zero.runtime.sequence_check.CollectiveError), else ""."""
    torch_distributed = os.path.dirname(dist.__file__)
    frames = traceback.extract_tb(error.__traceback__)
    for i, frame in enumerate(frames):
        if frame.filename == dist.distributed_c10d.__file__:
            caller = ([f for f in frames[:i] if not f.filename.startswith(torch_distributed)] or [frame])[-1]
            return f", waiting in torch.distributed.{frame.name} called from {caller.filename}:{caller.lineno}"
    return ""


def _forkserver_running() -> None:
    """Starts the forkserver, unless it runs, without the caller's MALLOC_MMAP_THRESHOLD_: glibc would fix the
    threshold in the server, and so in every rank it forks for a later caller without the variable."""
    from multiprocessing import forkserver

    threshold = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    try:
        forkserver.ensure_running()
    finally:
        if threshold is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold


# Ranks are forked from one server process that imported these once: a spawned rank re-imports torch
# and transformers, seconds per rank on a small machine, and a test suite starts ranks by the hundred.
FORKSERVER_PRELOAD = ["torch", "transformers", "hf_zero.hf.trainer"]


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
               start_method: str = "forkserver") -> list[Any]:
    """Runs fn(*args) on `world_size` local CPU ranks over gloo on 127.0.0.1 and returns each rank's result.
    `fn` must be importable (defined at module level); results travel through torch.save; ranks get the
    caller's environment, glibc's MALLOC_MMAP_THRESHOLD_ included.
    By default ranks are forked from a forkserver (never from the caller, whose threads and accelerator
    state a fork would copy). "spawn" starts fresh interpreters instead, for runs whose memory measurement
    depends on the heap a fork inherits from the server, or that need a variable that a preloaded module
    reads when imported (HF_ENDPOINT, by huggingface_hub) set after the server started."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method is 'forkserver' or 'spawn', not {start_method!r}")
    if start_method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(FORKSERVER_PRELOAD)
        _forkserver_running()
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, threads, dict(os.environ)),
                               nprocs=world_size, start_method=start_method)
        except mp.ProcessExitedException as e:
            fatal_report = _fatal_report(out_dir, e.error_index)
            if e.signal_name and fatal_report.exists() and fatal_report.stat().st_size:
                stacks = fatal_report.read_text().split("\nExtension modules:")[0]  # (the list of every one loaded)
                raise mp.ProcessExitedException(f"{e}; where its threads were:\n{stacks}", e.error_index, e.error_pid,
                                                e.exit_code, e.signal_name) from None
            raise
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
