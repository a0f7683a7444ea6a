"""Launching: spawn_gloo's ranks, and a script that builds an engine and exits without
destroy_process_group (as every Trainer script does) having its group destroyed before interpreter
finalization, where gloo can abort."""
from __future__ import annotations

import contextlib
import gc
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

import hf_zero
from hf_zero.runtime.comm import (
    CollectiveError,
    CollectiveMismatch,
    Communicator,
    Ledger,
    issued_for,
)
from hf_zero.runtime.launch import (
    HEARTBEAT_SECONDS,
    collective_timeout,
    free_port,
    spawn_gloo,
)
from hf_zero.settings.config import ZeroConfigError
from hf_zero.settings.environment import CHECK_COLLECTIVES_ENV as CHECK_ENV
from hf_zero.settings.environment import (
    COLLECTIVE_TIMEOUT_ENV,
    SIMULATE_ENV,
    check_collectives,
)

SCRIPT = """
import atexit, os
import torch, torch.distributed as dist
# Registered first, so it runs last: after hf_zero's handler, as finalization would.
atexit.register(lambda: print("group alive at the end of exit:", dist.is_initialized(), flush=True))
import hf_zero
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {{"zero_stage": {stage}}})
engine.backward(engine(torch.ones(2, 4)).sum())
engine.step()
print("trained", flush=True)
"""


def test_a_script_that_never_destroys_its_process_group_has_it_destroyed_at_exit():
    for stage in (2, 3):
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port(), stage=stage)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[-2:] == ["trained", "group alive at the end of exit: False"], done.stdout


def environment_variable(name: str) -> str | None:
    return os.environ.get(name)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawned_ranks_see_the_callers_environment_as_it_is_now(monkeypatch, start_method):
    spawn_gloo(environment_variable, 1, "HF_ZERO_PROBE")  # the forkserver is running before the variable is set
    monkeypatch.setenv("HF_ZERO_PROBE", start_method)
    assert spawn_gloo(environment_variable, 2, "HF_ZERO_PROBE", start_method=start_method) == [start_method] * 2


def walked_by_the_collector() -> tuple[int, list[bool]]:
    walked = {id(o) for o in gc.get_objects()}
    started_with = (torch.nn.Module.__init__, walked_by_the_collector)
    return gc.get_freeze_count(), [id(f) in walked for f in started_with]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawned_ranks_start_with_what_they_imported_frozen_out_of_the_cyclic_collector(start_method):
    """What a rank has when its function starts (the forkserver's imports, or a spawned rank's, and the modules
    unpickling the function imported: this one, torch) is frozen: no full collection in the rank walks it (0.2 s
    of a core each)."""
    (frozen, walked), = spawn_gloo(walked_by_the_collector, 1, start_method=start_method)
    assert frozen > 100_000 and walked == [False, False], (frozen, walked)


def mmapped_bytes_of_a_1_mib_block() -> int:
    """How many bytes glibc serves a 1 MiB malloc from mmap (0: from its heap)."""
    import ctypes

    from hf_zero.runtime.host_memory import _glibc

    libc = _glibc()
    libc.malloc.restype = ctypes.c_void_p
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(1 << 20)
    mmapped = libc.mallinfo2().hblkhd - before
    libc.free(ctypes.c_void_p(block))
    return mmapped


def test_forked_ranks_take_glibcs_mmap_threshold_from_the_callers_environment(monkeypatch):
    """glibc reads MALLOC_MMAP_THRESHOLD_ only when a process starts; a rank forked from a forkserver started before
    the variable was set takes it too, as a fresh process would (the memory tests fix it). 64 KiB tells the two apart
    (the server's imports raised its own threshold above 1 MiB); 16 MiB checks the other way."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(16 << 20))
    assert spawn_gloo(mmapped_bytes_of_a_1_mib_block, 2) == [0, 0]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    assert all(mmapped >= 1 << 20 for mmapped in spawn_gloo(mmapped_bytes_of_a_1_mib_block, 2))


def test_the_forkserver_starts_without_the_callers_mmap_threshold(monkeypatch):
    """A server started under the variable would keep its threshold for the ranks of every later caller."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # the next call starts the server, under the variable
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    assert all(mmapped >= 1 << 20 for mmapped in spawn_gloo(mmapped_bytes_of_a_1_mib_block, 1))
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    # glibc's own threshold, which the server's imports (torch, transformers) raised above 1 MiB by freeing larger
    # blocks, not the 64 KiB of the caller that started it
    assert spawn_gloo(mmapped_bytes_of_a_1_mib_block, 1) == [0]


def debug_level() -> str:
    return dist.get_debug_level().name


def test_spawned_ranks_run_under_the_callers_distributed_debug_level_not_the_forkservers(monkeypatch):
    """torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported, which the forkserver did once."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    spawn_gloo(debug_level, 1)  # a forkserver that imported torch.distributed under DETAIL, if none was running
    assert spawn_gloo(debug_level, 2) == ["DETAIL"] * 2
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    assert spawn_gloo(debug_level, 2) == ["OFF"] * 2


def test_an_unknown_start_method_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'forkserver' or 'spawn', not 'fork'"):
        spawn_gloo(environment_variable, 1, "HOME", start_method="fork")


ABORTS_AT_TEARDOWN = """
import atexit, os, sys
class AbortsAtTeardown:
    def __del__(self):
        os.abort()  # as a C++ thread that outlives its owner does when modules and statics are torn down
keeper = AbortsAtTeardown()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # left with an idle worker, as NVMe offload's I/O pool is
pool.submit(int).result()
atexit.register(lambda: print("atexit ran", flush=True))
print("trained", end="")  # neither a newline nor a flush: the exit must still flush it
if len(sys.argv) > 1:
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("script_exit", [None, 3])
def test_a_rank_that_finished_its_script_cannot_abort_in_interpreter_teardown(tmp_path, script_exit):
    script = tmp_path / "script.py"
    script.write_text(ABORTS_AT_TEARDOWN)
    extra = [] if script_exit is None else [str(script_exit)]
    plain = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True, timeout=120)
    assert plain.returncode == -6  # the abort this guards against
    rank = subprocess.run([sys.executable, "-m", "hf_zero.cli.run", str(script), *extra], capture_output=True,
                          text=True, timeout=120)
    assert rank.returncode == (script_exit or 0), rank.stderr[-2000:]
    assert rank.stdout == "trainedatexit ran\n"


def rank_1_aborts_in_a_native_call() -> None:
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the suite's folder where cores are on
        os.abort()  # as a C++ check that fails, or glibc finding its heap corrupt, ends a process
    time.sleep(60)


def test_a_rank_killed_by_a_signal_is_named_with_where_each_of_its_threads_was():
    start = time.monotonic()
    with pytest.raises(ProcessExitedException, match=r"(?s)process 1 terminated with signal SIGABRT; where its "
                                                     r"threads were:.*Fatal Python error: Aborted.*"
                                                     r"in rank_1_aborts_in_a_native_call"):
        spawn_gloo(rank_1_aborts_in_a_native_call, 2)
    assert time.monotonic() - start < 50  # rank 0 is stopped, not waited for


def collective_only_rank_0_joins(through: str) -> None:
    """Rank 0 enters one collective that rank 1 never joins (rank 1 is busy elsewhere, as a hung rank is)."""
    tensor = torch.ones(8)
    if dist.get_rank() == 1:
        time.sleep(120)
    elif through == "engine":
        Communicator(Ledger()).all_reduce_(tensor, async_op=True).wait()
    else:
        dist.all_reduce(tensor)


@pytest.mark.parametrize("through, named", [
    ("engine", r"rank 0: all_reduce #1 of its group of 2 \(8 float32 elements\) did not complete"),
    ("torch", r"rank 0 of 2 failed, waiting in torch.distributed.all_reduce called from .*test_launch.py:\d+"),
])
def test_a_collective_a_rank_never_joins_fails_within_the_timeout_naming_the_rank_and_the_collective(
        monkeypatch, through, named):
    """gloo's own default would wait 30 minutes (5 under spawn_gloo); the suite waits 40 s, here 3."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "3")
    start = time.monotonic()
    with pytest.raises(Exception, match=named) as failure:
        spawn_gloo(collective_only_rank_0_joins, 2, through)
    # gloo's collective says "Timed out", its group's creation at the group's first collective "wait timeout"
    assert re.search("timed out|wait timeout|Connection closed", str(failure.value), re.IGNORECASE)
    assert time.monotonic() - start < 30  # not the 120 s rank 1 sleeps, nor a default timeout


def ranks_issue_different_collectives(at: int, asynchronous: bool) -> None:
    """The ranks issue `at` - 1 all-reduces alike, then rank 0 an all-reduce and rank 1 a broadcast of the same
    size, or both an all-reduce but for different things (as two equal stage-3 units are)."""
    comm, tensor = Communicator(Ledger()), torch.ones(8)
    for _ in range(at - 1):
        comm.all_reduce_(tensor, async_op=asynchronous).wait()
    if asynchronous:
        with issued_for(f"the forward gather of unit 'blocks.{dist.get_rank()}'"):
            comm.all_reduce_(tensor, async_op=True).wait()
    else:
        comm.all_reduce_(tensor) if dist.get_rank() == 0 else comm.broadcast_(tensor)


@pytest.mark.parametrize("at, asynchronous, named", [
    (1, False, r"rank 0: all_reduce \(8 float32 elements\); rank 1: broadcast \(8 float32 elements\)"),
    (3, True, r"rank 0: all_reduce \(8 float32 elements\) for the forward gather of unit 'blocks.0'; "
              r"rank 1: all_reduce \(8 float32 elements\) for the forward gather of unit 'blocks.1'"),
])
@pytest.mark.parametrize("simulated", ["", "late"])
def test_collectives_the_ranks_issue_differently_stop_every_rank_at_once_naming_each(monkeypatch, at, asynchronous,
                                                                                     named, simulated):
    """Before a collective the schedule did not predict is launched (under simulation "late" too, which launches
    at the wait), every rank stops naming each rank's collective: not the timeout's wait (here 30 s), nor gloo's
    abort of the process, nor a silent mix of two tensors of one size."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "30")
    monkeypatch.setenv(SIMULATE_ENV, simulated)
    start = time.monotonic()
    with pytest.raises(Exception, match=rf"the ranks issued different collectives as collective #{at} of their "
                                        rf"group of 2 \({named}\).*--zero_unit_module_classes"):
        spawn_gloo(ranks_issue_different_collectives, 2, at, asynchronous)
    assert time.monotonic() - start < 25


def going_on_after_a_mismatch() -> str:
    """The ranks part at their first collective; each catches the error and issues another."""
    comm, tensor = Communicator(Ledger()), torch.ones(8)
    with contextlib.suppress(CollectiveMismatch):
        comm.all_reduce_(tensor) if dist.get_rank() == 0 else comm.broadcast_(tensor)
    try:
        comm.all_reduce_(tensor)
    except CollectiveMismatch as again:
        return str(again)
    return "went on"


def test_once_the_ranks_have_parted_every_later_collective_of_the_group_raises_the_same_error():
    """A script that catches the mismatch and goes on would pair hashes with the wrong collectives from then on."""
    for said in spawn_gloo(going_on_after_a_mismatch, 2):
        assert said.startswith("the ranks issued different collectives as collective #1 of their group of 2")


def repeat_a_schedule(rounds: int, comm: Communicator, tensor: torch.Tensor) -> None:
    """`rounds` rounds of the all-reduces of units 'a' and 'b', as a training loop repeats its steps."""
    for _ in range(rounds):
        for unit in "ab":
            with issued_for(f"unit '{unit}'"):
                comm.all_reduce_(tensor, async_op=True).wait()


def a_predicted_collective_is_launched_before_the_others_issue_it(rounds: int, shared: str, patience: float) -> bool:
    """After `rounds` rounds, rank 0 issues unit 'a' again and says so in `shared`; rank 1 issues it once it has
    read that, or after `patience` seconds. A rank that waited for the others' hashes before launching would not
    say so before rank 1 issued."""
    comm, tensor = Communicator(Ledger()), torch.ones(8)
    repeat_a_schedule(rounds, comm, tensor)
    said = Path(shared)
    if dist.get_rank() == 0:
        with issued_for("unit 'a'"):
            work = comm.all_reduce_(tensor, async_op=True)
        said.write_text("issued")
        work.wait()
        return True
    deadline = time.monotonic() + patience
    while not said.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    read_first = said.exists()
    with issued_for("unit 'a'"):
        comm.all_reduce_(tensor, async_op=True).wait()
    return read_first


def test_a_collective_the_repeated_schedule_predicts_is_launched_without_waiting_for_the_other_ranks(tmp_path):
    """The check's round trip is paid where the schedule is new, not on every collective of every step: it is
    stage-3 host time per unit (benchmarks/bench_stage3_host.py)."""
    assert spawn_gloo(a_predicted_collective_is_launched_before_the_others_issue_it, 2, 2,
                      str(tmp_path / "said"), 20) == [True, True]
    # The first time through, unit 'a' follows nothing seen before: rank 0 waits for rank 1's hash to launch it.
    assert spawn_gloo(a_predicted_collective_is_launched_before_the_others_issue_it, 2, 0,
                      str(tmp_path / "said first"), 2) == [True, False]


def rank_1_leaves_a_repeated_schedule(report_to: str) -> None:
    """Three rounds alike, then rank 1 all-reduces unit 'c' where the schedule (and rank 0) has unit 'b'. Each rank
    writes its error to `report_to`; rank 1 then closes its groups and exits, which fails rank 0's wait (closing the
    groups alone does not: rank 0's connections stay open until rank 1's process ends)."""
    comm, tensor = Communicator(Ledger()), torch.ones(8)
    repeat_a_schedule(3, comm, tensor)
    try:
        with issued_for("unit 'a'"):
            comm.all_reduce_(tensor, async_op=True).wait()
        with issued_for("unit 'b'" if dist.get_rank() == 0 else "unit 'c'"):
            comm.all_reduce_(tensor, async_op=True).wait()
    except CollectiveError as error:
        Path(f"{report_to}{dist.get_rank()}").write_text(str(error))
        if dist.get_rank() == 1:
            dist.destroy_process_group()
            os._exit(0)
        raise


def test_a_rank_that_leaves_a_repeated_schedule_stops_every_rank_naming_each(monkeypatch, tmp_path):
    """Rank 0 issued unit 'b' as the schedule predicts and waits in it; rank 1, whose unit 'c' the schedule did not
    predict, compares first, finds rank 0's hash to be the predicted collective's and stops without launching (a
    launch would pair 'c' with 'b'). Rank 0, left waiting, names the same mismatch when its collective fails, not
    only a closed connection."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "30")
    start = time.monotonic()
    with pytest.raises(Exception):
        spawn_gloo(rank_1_leaves_a_repeated_schedule, 2, str(tmp_path / "error"))
    named = (r"the ranks issued different collectives as collective #8 of their group of 2 \(rank 0: all_reduce "
             r"\(8 float32 elements\) for unit 'b'; rank 1: {}\)")
    assert re.search(named.format(r"all_reduce \(8 float32 elements\) for unit 'c'"), (tmp_path / "error1").read_text())
    # Rank 0 never saw unit 'c': it names what rank 1 did not do, and rank 1's own error names what it did.
    assert re.search(named.format("a collective other than the schedule's"), (tmp_path / "error0").read_text())
    assert time.monotonic() - start < 25  # not the collective timeout


def test_hf_zero_check_collectives_0_turns_the_check_off_and_other_values_are_refused(monkeypatch):
    """Off, two all-reduces of one size issued for different things pair silently: the check is what caught them."""
    monkeypatch.setenv(CHECK_ENV, "0")
    spawn_gloo(ranks_issue_different_collectives, 2, 3, True)
    monkeypatch.setenv(CHECK_ENV, "yes")
    with pytest.raises(ZeroConfigError, match=f"{CHECK_ENV} must be one of 1 \\(compare every collective across the "
                                              f"ranks, the default\\), 0 \\(do not\\); got 'yes'"):
        check_collectives()


def rank_1_stops(report_to: str) -> None:
    """Rank 1 stops (as `kill -STOP` stops it) before the collective rank 0 waits in; rank 0 writes its error
    to `report_to`, then kills rank 1."""
    comm = Communicator(Ledger())
    pids = comm.all_gather_object(os.getpid())
    comm.all_reduce_(torch.ones(8))
    if dist.get_rank() == 1:
        time.sleep(2 * HEARTBEAT_SECONDS)  # its heartbeat has said all_reduce #2 was its latest
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        comm.all_reduce_(torch.ones(8))
    except CollectiveError as error:
        Path(report_to).write_text(str(error))
    finally:
        os.kill(pids[1], signal.SIGKILL)


def test_a_rank_that_stops_answering_is_named_by_the_rank_left_waiting(monkeypatch, tmp_path):
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "5")
    with pytest.raises(Exception):  # rank 1 was killed
        spawn_gloo(rank_1_stops, 2, str(tmp_path / "error.txt"))
    error = (tmp_path / "error.txt").read_text()
    assert re.fullmatch(r"rank 0: all_reduce #3 of its group of 2 \(8 float32 elements\) did not complete: .*Timed out.*"
                        r"\. rank 1 has not answered for \d+ s \(the last collective it issued: rank 1: all_reduce #2 of "
                        r"its group of 2 \(8 float32 elements\)\)", error, re.DOTALL), error


@pytest.mark.slow
def test_a_rank_stopped_before_it_joins_the_process_group_is_named_in_one_line_and_the_run_ends(tmp_path):
    """Rank 1 stopped (SIGSTOP) as it starts to join (tests/scripts/faults). Rank 0 failed after the
    timeout with a 25-line traceback ending in torch's `DistStoreError: wait timeout ... keys:
    /default_pg/0//cpu//0/1`, naming no rank; mid-training the same fault was already named. And
    torchrun waited 30 s more for the stopped rank to act on its SIGTERM; the rank that named it ends it."""
    import psutil

    faults = Path(__file__).parents[1] / "scripts" / "faults"
    environ = {**os.environ, "HF_ZERO_TEST_KILLS": "1:0:stop=join",
               "PYTHONPATH": os.pathsep.join([str(faults), os.environ.get("PYTHONPATH", "")])}
    hf_zero_train = subprocess.Popen([sys.executable, "-m", "hf_zero", "train", "--nproc_per_node", "2",
                                      "--max_steps", "400", "--log_every", "5", "--collective_timeout", "5"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                     env=environ)

    def ranks() -> dict[str, psutil.Process]:  # by name (hf_zero.cli.node_ranks), not their own children's
        with contextlib.suppress(psutil.Error):
            return {c.name(): c for c in psutil.Process(hf_zero_train.pid).children(recursive=True)
                    if c.name().startswith("rank ") and not c.parent().name().startswith("rank ")}
        return {}

    stopped, deadline = None, time.time() + 60
    try:
        while stopped is None and time.time() < deadline and hf_zero_train.poll() is None:
            with contextlib.suppress(psutil.Error):
                rank_1 = ranks().get("rank 1")
                stopped = rank_1 if rank_1 is not None and rank_1.status() == psutil.STATUS_STOPPED else None
            time.sleep(0.05)
        assert stopped is not None, "rank 1 was never seen stopped"
        while "rank 0" in ranks() and time.time() < deadline:
            time.sleep(0.1)
        rank_0_ended = time.time()
        _, err = hf_zero_train.communicate(timeout=60)
        ended_after, rank_1_ended = time.time() - rank_0_ended, not stopped.is_running()
    finally:
        if stopped is not None:
            with contextlib.suppress(psutil.Error):
                stopped.kill()
        hf_zero_train.kill()
    said = [line for line in err.splitlines() if line.startswith("hf-zero train: ")]
    assert said == ["hf-zero train: rank 0: the 2 processes did not all join the process group within 5 s: rank 1 "
                    "never started to join (stopped, crashed before its join, or still starting; --collective_timeout "
                    "sets how long the others wait) (torch: wait timeout after 5000ms, keys: "
                    "/default_pg/0//cpu//0/1)"], err
    assert "Traceback" not in err, err
    assert ended_after < 10 and rank_1_ended, (ended_after, err)  # not after torchrun's 30 s


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan", "1e300", "1e-9", "0.5", "2592001"])
def test_a_collective_timeout_outside_one_second_to_30_days_is_refused_naming_the_variable(monkeypatch, value):
    """1e300 raised OverflowError inside every rank, 1e-9 rounded to a timeout of 0 ms."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, value)
    with pytest.raises(ZeroConfigError, match=f"{COLLECTIVE_TIMEOUT_ENV} must be a number of seconds from 1 to "
                                              f"2,592,000 \\(30 days\\); got '{value}'"):
        collective_timeout(None)


def leave_state_behind() -> dict:
    """What a test's ranks find when they start, then change all of it, as a careless test would: the seeded
    random generators, the environment, the working folder, torch's global settings, a module's cache."""
    found = {"torch": torch.rand(3), "python": random.random(), "env": os.environ.get("HF_ZERO_LEFT_BEHIND"),
             "cwd": os.getcwd(), "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
             "threads": torch.get_num_threads(), "cache": getattr(hf_zero, "_left_behind", None)}
    torch.manual_seed(1234)
    random.seed(1234)
    os.environ["HF_ZERO_LEFT_BEHIND"] = "yes"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    hf_zero._left_behind = "yes"
    return found


def test_a_tests_ranks_start_from_the_same_state_whatever_the_previous_test_left():
    first, second = spawn_gloo(leave_state_behind, 2), spawn_gloo(leave_state_behind, 2)
    torch.manual_seed(1234)
    left_behind = {"torch": torch.rand(3), "python": random.Random(1234).random()}
    for before, after in zip(first, second):
        found_torch = after.pop("torch")
        assert torch.equal(before.pop("torch"), found_torch)  # torch's fixed default seed, as in a new process
        assert not torch.equal(found_torch, left_behind["torch"])
        # Python reseeds its generator from the system at every fork: fresh, so never the left-behind stream.
        assert before.pop("python") != left_behind["python"] != after.pop("python")
        assert before == after and before["env"] is None and before["cache"] is None
        assert before["dtype"] == torch.float32 and before["threads"] == 1 and before["grad"]


def test_a_rank_waits_ten_minutes_for_the_others_by_default_not_torchs_thirty(monkeypatch):
    from hf_zero.hf.arguments import ZeroTrainingArguments

    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV)
    assert collective_timeout() == timedelta(minutes=10)
    assert ZeroTrainingArguments(output_dir="out", use_cpu=True).ddp_timeout == 600  # the Trainer's process group
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "75")
    assert ZeroTrainingArguments(output_dir="out", use_cpu=True).ddp_timeout == 75
    assert ZeroTrainingArguments(output_dir="out", use_cpu=True, ddp_timeout=90).ddp_timeout == 90  # the user's


@pytest.mark.parametrize("command", ["train", "run"])
def test_the_launchers_collective_timeout_flag_reaches_the_ranks(monkeypatch, tmp_path, command):
    from hf_zero.cli import commands as cli
    from hf_zero.cli import node_ranks

    seen = []
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV)
    monkeypatch.setattr(node_ranks, "start_node_ranks", lambda *launch: seen.append(os.environ[COLLECTIVE_TIMEOUT_ENV]))
    monkeypatch.setattr(cli, "use_mmap_for_large_allocations", lambda: None)  # this process's allocator left as it is
    script = tmp_path / "script.py"
    script.write_text("")
    args = [str(script), "--use_cpu"] if command == "run" else []
    assert cli.main([command, "--nproc_per_node", "2", "--collective_timeout", "45", *args]) == 0
    assert seen == ["45.0"]


def test_a_bad_collective_timeout_flag_is_one_line_naming_it(refused_before_launch):
    assert refused_before_launch("train", "--collective_timeout", "soon") == (
        2, "hf-zero train: argument --collective_timeout: the value must be a number of seconds from 1 to 2,592,000 "
           "(30 days); got 'soon' "
           "(--help lists the flags)\n")
