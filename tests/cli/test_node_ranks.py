"""hf_zero/cli/node_ranks.py: the ranks of `hf-zero run` and `hf-zero train` forked from one fork server that
imported what they run, started, watched and restarted by torchrun's agent. That they train as users' ranks do is
every test that launches them (tests/cli, tests/hf, tests/test_examples.py); these check what the fork changes
against what a rank torchrun starts as a new interpreter has."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_zero.cli import run, train_lm

REPORTS_ITS_PLACE = """import json, multiprocessing, os, sys
import numpy
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
print(json.dumps({"rank": int(os.environ["RANK"]), "parent": os.getppid(), "forked_by": parent,
                  "torch_in_the_parent": "libtorch_cpu" in open(f"/proc/{os.getppid()}/maps").read(),
                  "name": open("/proc/self/comm").read().strip(),
                  "process": multiprocessing.current_process().name,
                  "has_a_parent_process": multiprocessing.parent_process() is not None,
                  "numpy_draw": numpy.random.random()}), flush=True)
"""


def hf_zero_run(script: str, tmp_path, timeout: float = 300) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(path), "--use_cpu"],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_the_ranks_are_forked_from_one_server_that_imported_torch_and_start_as_a_new_interpreter_would(tmp_path):
    launch = hf_zero_run(REPORTS_ITS_PLACE, tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in launch.stdout.splitlines() if line.startswith("{")),
                   key=lambda said: said["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], launch.stdout
    assert ranks[0]["parent"] == ranks[1]["parent"]
    assert all("multiprocessing.forkserver" in r["forked_by"] and "hf_zero.cli.node_ranks" in r["forked_by"]
               and r["torch_in_the_parent"] for r in ranks), ranks
    assert [r["name"] for r in ranks] == ["rank 0", "rank 1"]
    # As a new interpreter: multiprocessing's main process, and numpy's global generator seeded anew.
    assert [(r["process"], r["has_a_parent_process"]) for r in ranks] == [("MainProcess", False)] * 2
    assert ranks[0]["numpy_draw"] != ranks[1]["numpy_draw"]


def test_a_scripts_error_is_its_ranks_own_traceback_and_a_clean_os_exit_ends_the_launch(tmp_path):
    """A rank's uncaught exception prints its traceback and fails the launch; a script that ends with os._exit(0)
    (which torch's agent, waiting for each forked rank's return, waited on for ever) ends it as a success."""
    failed = hf_zero_run("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('boom on rank 1')\n"
                         "import time\ntime.sleep(60)\n", tmp_path)
    assert failed.returncode != 0
    assert "raise ValueError('boom on rank 1')\nValueError: boom on rank 1" in failed.stderr, failed.stderr[-3000:]
    ended = hf_zero_run("import os\nos._exit(0)\n", tmp_path, timeout=60)  # a hang fails within a minute
    assert ended.returncode == 0, ended.stderr[-3000:]


def fork_server_imports(modules: list[str], pythonpath: str = "") -> str:
    """Why a fork server that imports `modules` at its start (its preload) would stop its ranks, or ''."""
    code = (f"import os; os.environ['HF_ZERO_FORK_SERVER_IMPORTS'] = {','.join(modules)!r}\n"
            "from hf_zero.cli import node_ranks\nprint(node_ranks.server_failure or '')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))}
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                             check=False)
    assert started.returncode == 0, started.stderr[-3000:]
    return started.stdout.strip()


RECORDS_CUDA_CALLS = """import importlib, json, sys, torch
calls = []
def recorded(name, original):
    def call(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)
    return call
for name in ("is_available", "device_count", "init", "_lazy_init", "is_bf16_supported", "get_device_capability",
             "get_device_properties", "current_device", "get_rng_state", "manual_seed", "set_device"):
    setattr(torch.cuda, name, recorded(name, getattr(torch.cuda, name)))
for module in sys.argv[1:]:
    importlib.import_module(module)
print(json.dumps(calls))
"""


def test_what_the_fork_server_imports_for_either_command_makes_no_cuda_call():
    """CUDA initialised in the fork server is lost to every rank forked from it, and torch's device count alone
    marks the process so that its forks refuse CUDA. The fork server reads torch's flags at its start; this
    machine, without a GPU, checks the calls themselves."""
    imports = [*run.RANK_IMPORTS, *train_lm.RANK_IMPORTS, "hf_zero.cli.rank_main"]
    made = subprocess.run([sys.executable, "-c", RECORDS_CUDA_CALLS, *imports], capture_output=True, text=True,
                          timeout=300, check=False)
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads(made.stdout) == []
    assert fork_server_imports(imports) == ""


@pytest.mark.parametrize("flag", ["is_initialized", "_is_in_bad_fork"])
def test_a_fork_server_whose_imports_touched_cuda_stops_its_ranks_naming_the_imports(tmp_path, flag):
    """torch's flags as a GPU machine would set them (a test double the imported module plugs in): initialised, or
    a fork refused."""
    (tmp_path / "touches_cuda.py").write_text(f"import torch\ntorch.cuda.{flag} = lambda: True\n")
    assert fork_server_imports(["hf_zero.hf.trainer", "touches_cuda"], pythonpath=str(tmp_path)) == (
        "importing hf_zero.hf.trainer,touches_cuda initialised CUDA in hf-zero's fork server, which the ranks forked "
        "from it cannot use. Start the ranks with torchrun instead (torchrun --nproc_per_node N -m hf_zero.cli.run "
        "SCRIPT ..., or -m hf_zero.cli.train_lm)")


def test_a_fork_server_that_could_not_import_stops_its_ranks_naming_the_error(tmp_path):
    (tmp_path / "broken.py").write_text("raise ImportError('no module named flash_attn_9')\n")
    assert fork_server_imports(["hf_zero.hf.trainer", "broken"], pythonpath=str(tmp_path)) == (
        "hf-zero's fork server could not import hf_zero.hf.trainer,broken: ImportError: no module named flash_attn_9")
