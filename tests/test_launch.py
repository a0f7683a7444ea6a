"""Launching: spawn_gloo's ranks, and a script that builds an engine and exits without
destroy_process_group (as every Trainer script does) having its group destroyed before interpreter
finalization, where gloo can abort."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_zero.launch import free_port, spawn_gloo

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
    rank = subprocess.run([sys.executable, "-m", "hf_zero.run", str(script), *extra], capture_output=True,
                          text=True, timeout=120)
    assert rank.returncode == (script_exit or 0), rank.stderr[-2000:]
    assert rank.stdout == "trainedatexit ran\n"
