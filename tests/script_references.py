"""The reference runs of the script tests, on ranks forked from the worker's forkserver.

A script test launches the run it tests as a user does (`hf-zero run`, torchrun): a launcher, and a new interpreter
per rank under torchrun or a fork server under hf-zero's commands, each importing torch and transformers (4-10 s of a
core on a 2-core machine). The run it compares with (the
model built whole, the uninterrupted run, stock DDP) needs none of that: it is the same script with the same
arguments, started here on ranks forked from the server that imported them once (hf_zero.runtime.launch.spawn_gloo),
with the variables torchrun gives one node's ranks (rank, world size, local rank and size, the master's address).

Their gloo group is spawn_gloo's, started before the script, which accelerate then uses as it finds it: it waits
HF_ZERO_COLLECTIVE_TIMEOUT (40 s in the suite) for a collective, not the script's --ddp_timeout.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from hf_zero.cli.run import main, run_as_main
from hf_zero.runtime.launch import spawn_gloo


def _script_rank(script: str, args: list[str], stock: bool, log_dir: str) -> int | str | None:
    # The rank's stdout and stderr, the Trainer's logs among them, go to its own file, as torchrun would pass them on.
    sys.stdout.flush()
    sys.stderr.flush()
    with open(Path(log_dir) / f"rank{dist.get_rank()}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            if not stock:
                return main([script, *args])
            run_as_main(Path(script), args)
            return 0
        except SystemExit as stop:
            return stop.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def _tails(log_dir: str, ranks: int) -> str:
    logs = (Path(log_dir) / f"rank{rank}.log" for rank in range(ranks))
    return "\n".join(f"--- rank {rank}:\n{log.read_text()[-2000:] if log.exists() else '(no output)'}"
                     for rank, log in enumerate(logs))


def run_script_reference(script: Path | str, args: list[str], ranks: int, stock: bool = False) -> str:
    """`script args` on `ranks` forked ranks, as `hf-zero run --nproc_per_node ranks` runs it (stock: as plain
    torchrun does, transformers' own classes); returns the ranks' output, rank 0's first. For the run a test compares
    with, never for the one it tests. A rank that fails fails the test with each rank's last output."""
    with tempfile.TemporaryDirectory(prefix="hf_zero_reference_") as log_dir:
        try:
            codes = spawn_gloo(_script_rank, ranks, str(script), list(args), stock, log_dir)
        except Exception as error:
            raise AssertionError(f"the reference run failed: {error}\n{_tails(log_dir, ranks)}") from error
        assert all(code in (0, None) for code in codes), f"exit codes {codes}:\n{_tails(log_dir, ranks)}"
        return "".join((Path(log_dir) / f"rank{rank}.log").read_text() for rank in range(ranks))
