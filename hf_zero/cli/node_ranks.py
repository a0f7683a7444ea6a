"""This node's ranks of `hf-zero run` and `hf-zero train`. torchrun's agent starts them (its rendezvous, restarts and
failure reports) by forking each from one fork server that imported what they run, once. A rank that torchrun
starts as a new interpreter imports torch, transformers' Trainer stack and hf_zero itself: about 4 s of a core,
on every start and every restart. This module imports only the standard library until one of its functions
runs: the launcher reads its flags before it imports torch."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# The fork server's imports, handed to it in its environment (its preload names modules, not what to run them in).
_SERVER_IMPORTS_ENV = "HF_ZERO_FORK_SERVER_IMPORTS"


def start_node_ranks(torchrun_argv: list[str], module: str, module_args: list[str]) -> Any:
    """Starts this node's ranks of `python -m module module_args` as `torchrun torchrun_argv` would, each forked
    from a fork server that imported the module's `RANK_IMPORTS`. Raises torch's ChildFailedError when a rank
    fails, once the agent has said which and why. The fork server starts here, after the launcher has set the
    ranks' environment, which it and so every rank inherit (torchrun's OMP_NUM_THREADS; glibc's mmap threshold,
    which a process reads once, when it starts)."""
    import multiprocessing.forkserver

    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    if multiprocessing.forkserver._forkserver._forkserver_pid is not None:
        raise RuntimeError("hf-zero's launcher starts the fork server its ranks are forked from, with the ranks' "
                           "environment, and this process already runs one: launch from a process of its own "
                           "(the hf-zero command)")
    config, _, _ = config_from_args(parse_args([*torchrun_argv, "-m", module, *module_args]))
    config.start_method = "forkserver"
    multiprocessing.set_forkserver_preload([__name__])
    os.environ[_SERVER_IMPORTS_ENV] = ",".join([*importlib.import_module(module).RANK_IMPORTS, "hf_zero.cli.rank_main"])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[_SERVER_IMPORTS_ENV]
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_the_agents_traceback)
    return record(lambda: elastic_launch(config, run_forked_rank)(module, module_args))()


def _without_the_agents_traceback(record: logging.LogRecord) -> bool:
    """The agent's report of a forked rank that exited with an error status ("failed (exitcode: 2) local_rank: 0
    ...") without the traceback of its own wait for the ranks, which says nothing of the rank: the report of a rank
    torchrun started as an interpreter has none."""
    from torch.multiprocessing import ProcessExitedException

    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True


def _import_in_fork_server() -> None:
    """In the fork server (this module is its preload): what its ranks run, imported with Python's cyclic collector
    off and then frozen out of it (hf_zero.runtime.host_memory.start_up_frozen): they live as long as the ranks."""
    imports = os.environ.pop(_SERVER_IMPORTS_ENV, None)
    if imports is None:  # imported anywhere else
        return
    from hf_zero.runtime.host_memory import start_up_frozen

    with start_up_frozen(), _without_cuda(imports):
        for name in imports.split(","):
            importlib.import_module(name)


# torch.cuda's calls that initialise CUDA, or mark the process so that no fork of it can (torch's "poison fork").
_CUDA_CALLS = ("is_available", "device_count", "init", "_lazy_init")


@contextlib.contextmanager
def _without_cuda(imports: str) -> Iterator[None]:
    """Raises when a CUDA call was made inside: CUDA that the fork server initialised is lost to every rank forked
    from it ("Cannot re-initialize CUDA in forked subprocess"). The ranks' imports make none
    (tests/cli/test_node_ranks.py); should a library start to, every launch stops here, on machines without a GPU
    too, rather than only the ranks of those with one."""
    import torch.cuda

    called: list[str] = []

    def watched(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if watching:
                called.append(name)
            return original(*args, **kwargs)
        return call

    watching = True
    originals = {name: getattr(torch.cuda, name) for name in _CUDA_CALLS}
    for name, original in originals.items():
        setattr(torch.cuda, name, watched(name, original))
    try:
        yield
    finally:
        watching = False  # a module that bound a watched call keeps it: it calls the original, unrecorded
        for name, original in originals.items():
            setattr(torch.cuda, name, original)
    if called:
        raise RuntimeError(f"importing {imports} called torch.cuda.{called[0]}() in hf-zero's fork server: the "
                           f"ranks forked from it could not use CUDA. Start them with torchrun instead "
                           f"(torchrun --nproc_per_node N -m hf_zero.cli.run ...)")


def run_forked_rank(module: str, args: list[str]) -> None:
    """A rank forked from the fork server (start_node_ranks), running `module` as torchrun's `python -u -m module
    args` would. torch's elastic agent takes a return as success, and reads a failure from the exit status."""
    _let_the_fork_server_end_with_its_launcher()
    sys.argv = [importlib.util.find_spec(module).origin, *args]
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # what `-u` is there for: each line shown when it is printed
    name_process(f"rank {os.environ['RANK']}")
    from hf_zero.cli.rank_main import end_forked_rank

    importlib.import_module(module).start_rank(end=end_forked_rank)


def _let_the_fork_server_end_with_its_launcher() -> None:
    """Closes this rank's copy of the pipe by which the fork server learns that its launcher ended (multiprocessing
    hands it to every process the server forks, for forking more). The server ends once no process holds it, and
    the ranks with it (hf_zero.runtime.launch.die_with_launcher): with the ranks holding it, ranks and server
    outlived a launcher killed with SIGKILL. A fork server this rank asks for later is a new one."""
    from multiprocessing import forkserver

    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None


def name_process(name: str) -> None:
    """Names this process (Linux's comm: what `top` and `ps -o comm` show, 15 characters). A forked rank's command
    line is its fork server's, and its environment as /proc shows it too: its name tells it apart
    (hf_zero.runtime.launch.end_local_ranks)."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


_import_in_fork_server()
