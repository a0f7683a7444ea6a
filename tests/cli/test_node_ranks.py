"""hf_zero/cli/node_ranks.py: the ranks of `hf-zero run` and `hf-zero train` forked from one fork server that
imported what they run, started, watched and restarted by torchrun's agent. That they train as users' ranks do is
every test that launches them (tests/cli, tests/hf, tests/test_examples.py); these check the fork itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from hf_zero.cli import run, train_lm

REPORTS_ITS_PLACE = """import json, os, sys
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
print(json.dumps({"rank": int(os.environ["RANK"]), "parent": os.getppid(), "forked_by": parent,
                  "name": open("/proc/self/comm").read().strip(),
                  "trainer_imported_before_the_script": "transformers.trainer" in sys.modules}), flush=True)
"""


def test_the_ranks_are_forked_from_one_server_that_imported_the_trainer_stack_each_named_by_its_rank(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(REPORTS_ITS_PLACE)
    launch = subprocess.run([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(script),
                             "--use_cpu"], capture_output=True, text=True, timeout=300, check=False)
    assert launch.returncode == 0, launch.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in launch.stdout.splitlines() if line.startswith("{")),
                   key=lambda said: said["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], launch.stdout
    assert ranks[0]["parent"] == ranks[1]["parent"]
    assert all("multiprocessing.forkserver" in r["forked_by"] and "hf_zero.cli.node_ranks" in r["forked_by"]
               for r in ranks), ranks
    assert [r["name"] for r in ranks] == ["rank 0", "rank 1"]
    assert all(r["trainer_imported_before_the_script"] for r in ranks)


def fork_server_imports(modules: list[str], pythonpath: str = "") -> subprocess.CompletedProcess:
    """What the fork server does at its start (its preload), in a new interpreter."""
    code = (f"import os; os.environ['HF_ZERO_FORK_SERVER_IMPORTS'] = {','.join(modules)!r}; "
            "import hf_zero.cli.node_ranks")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          check=False)


def test_what_the_fork_server_imports_for_either_command_makes_no_cuda_call():
    """CUDA initialised in the fork server is lost to every rank forked from it: the ranks' imports must not touch
    it, which this machine without a GPU checks as well as one with (the server watches torch.cuda's calls)."""
    imports = [*run.RANK_IMPORTS, *train_lm.RANK_IMPORTS, "hf_zero.cli.rank_main"]
    started = fork_server_imports(imports)
    assert started.returncode == 0, started.stderr[-3000:]


def test_an_import_that_calls_cuda_stops_the_fork_server_naming_the_call(tmp_path):
    (tmp_path / "asks_for_a_gpu.py").write_text("import torch\n"
                                                "DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    started = fork_server_imports(["hf_zero.hf.trainer", "asks_for_a_gpu"], pythonpath=str(tmp_path))
    assert started.returncode != 0
    assert ("importing hf_zero.hf.trainer,asks_for_a_gpu called torch.cuda.is_available() in hf-zero's fork server"
            in started.stderr), started.stderr[-3000:]
