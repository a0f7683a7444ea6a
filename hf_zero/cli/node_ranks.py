"""This node's ranks of `hf-zero run` and `hf-zero train`. torchrun's agent starts them (its rendezvous, restarts and
failure reports) by forking each from one fork server that imported what they run, once. A rank that torchrun
starts as a new interpreter imports torch, transformers' Trainer stack and hf_zero itself: about 4 s of a core,
on every start and every restart. This module imports only the standard library until one of its functions
runs: the launcher reads its flags before it imports torch."""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import multiprocessing
import multiprocessing.process
import os
import sys
import traceback

# The fork server's imports, handed to it in its environment (its preload names modules, not what to run them in).
_SERVER_IMPORTS_ENV = "HF_ZERO_FORK_SERVER_IMPORTS"


def start_node_ranks(torchrun_argv: list[str], module: str, module_args: list[str]) -> None:
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
    _a_rank_that_exited_cleanly_returned()
    record(lambda: elastic_launch(config, run_forked_rank)(module, module_args))()


def _a_rank_that_exited_cleanly_returned() -> None:
    """Makes torch's agent, in this launcher, count a forked rank that exited with status 0 as one that returned.
    It waits for each rank's return value: a script that ends with os._exit(0) (a common way out of a hang at exit),
    or a rank ended by a KeyboardInterrupt (which torch's spawn wrapper swallows), left it and the other ranks
    waiting for ever, where torchrun's interpreters end the launch as a success."""
    from torch.distributed.elastic.multiprocessing import api

    waits_for_returns = api.MultiprocessContext._is_done
    if getattr(waits_for_returns, "counts_clean_exits", False):
        return

    def is_done(context: api.MultiprocessContext) -> bool:
        for local_rank, process in enumerate(context._pc.processes):
            if process.exitcode == 0:  # a returning rank exits only once the agent has read every return
                context._return_values.setdefault(local_rank, None)
        return waits_for_returns(context)

    is_done.counts_clean_exits = True
    api.MultiprocessContext._is_done = is_done


def _without_the_agents_traceback(record: logging.LogRecord) -> bool:
    """The agent's report of a forked rank that exited with an error status ("failed (exitcode: 2) local_rank: 0
    ...") without the traceback of its own wait for the ranks, which says nothing of the rank: the report of a rank
    torchrun started as an interpreter has none."""
    from torch.multiprocessing import ProcessExitedException

    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True


# Why the fork server could not import what its ranks run, or None: each rank says it and stops.
server_failure: str | None = None


def _import_in_fork_server() -> None:
    """In the fork server (this module is its preload): what its ranks run, imported with Python's cyclic collector
    off and then frozen out of it (hf_zero.runtime.host_memory.start_up_frozen): they live as long as the ranks.
    A failure is kept for the ranks to say: the fork server's preload would drop an ImportError without a word,
    and a server that stopped would leave the launcher a broken connection to report."""
    global server_failure
    imports = os.environ.pop(_SERVER_IMPORTS_ENV, None)
    if imports is None:  # imported anywhere else
        return
    from hf_zero.runtime.host_memory import start_up_frozen

    try:
        with start_up_frozen():
            for name in imports.split(","):
                importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - said by every rank instead
        server_failure = f"hf-zero's fork server could not import {imports}: {type(error).__name__}: {error}"
        return
    if _cuda_touched():
        server_failure = (f"importing {imports} initialised CUDA in hf-zero's fork server, which the ranks forked "
                          f"from it cannot use. Start the ranks with torchrun instead (torchrun --nproc_per_node N "
                          f"-m hf_zero.cli.run SCRIPT ..., or -m hf_zero.cli.train_lm)")


def _cuda_touched() -> bool:
    """Whether this process initialised CUDA, or made a call after which torch refuses CUDA in its forks ("Cannot
    re-initialize CUDA in forked subprocess": torch's device count marks the process), by torch's own flags, the
    second read in a fork. The ranks' imports make no such call (tests/cli/test_node_ranks.py checks it on
    machines without a GPU too)."""
    import torch

    if torch.cuda.is_initialized():
        return True
    probe = os.fork()
    if probe == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) != 0


def run_forked_rank(module: str, args: list[str]) -> None:
    """A rank forked from the fork server (start_node_ranks), running `module` as torchrun's `python -u -m module
    args` runs it in a new interpreter. torch's elastic agent takes a return as success, and reads a failure from
    the exit status (an uncaught exception's traceback is the rank's to print, as an interpreter's would be)."""
    _let_the_fork_server_end_with_its_launcher()
    _as_a_new_interpreter_starts()
    if server_failure is not None:
        if os.environ.get("LOCAL_RANK") == "0":
            print(server_failure, file=sys.stderr, flush=True)
        os._exit(2)
    sys.argv = [importlib.util.find_spec(module).origin, *args]
    from hf_zero.cli.rank_main import end_forked_rank
    from hf_zero.runtime.launch import rank_process_name

    name_process(rank_process_name(os.environ["RANK"]))

    try:
        importlib.import_module(module).start_rank(end=end_forked_rank)
    except BaseException:  # noqa: BLE001 - the script's: torch's spawn wrapper would keep it from stderr
        traceback.print_exc()
        end_forked_rank(1)


def _as_a_new_interpreter_starts() -> None:
    """What a rank torchrun starts has and a fork does not: it is multiprocessing's main process (transformers'
    data collators check the name), its standard streams write each line when it is printed (`-u`), and numpy's
    global generator is seeded from the system's entropy, not left as the fork server's for every rank and restart
    (Python's own `random` reseeds itself after a fork)."""
    this = multiprocessing.current_process()
    this.name, this._identity, this._parent_pid, this._parent_name = "MainProcess", (), None, None
    multiprocessing.process._parent_process = None
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


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
