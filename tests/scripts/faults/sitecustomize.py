"""Faults for the restart tests, in every interpreter started with this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up): HF_ZERO_TEST_KILLS lists `RANK:RESTART:WHAT`, and the process that is rank RANK in its
RESTART-th start (torchrun's TORCHELASTIC_RESTART_COUNT) kills itself with SIGKILL, as the OOM killer or a node fault
would, at WHAT: `backward=N` (its Nth backward, so inside step N at one micro-batch a step) or `save=TEXT` (writing a
safetensors file whose path holds TEXT). Nothing is changed in a process the list does not name."""
from __future__ import annotations

import os
import signal


def _kill_when(what: str) -> None:
    kind, _, value = what.partition("=")
    if kind == "backward":
        import torch

        original, calls = torch.autograd.backward, [0]

        def backward(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(value):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        torch.autograd.backward = backward
    elif kind == "save":
        import safetensors.torch

        original_save = safetensors.torch.save_file

        def save_file(tensors, filename, *args, **kwargs):
            if value in str(filename):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_save(tensors, filename, *args, **kwargs)

        safetensors.torch.save_file = save_file
    else:
        raise ValueError(f"HF_ZERO_TEST_KILLS: unknown fault {what!r}")


def _install() -> None:
    rank, restart = os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for entry in filter(None, os.environ.get("HF_ZERO_TEST_KILLS", "").split(",")):
        kill_rank, kill_restart, what = entry.split(":", 2)
        if (kill_rank, kill_restart) == (rank, restart):
            _kill_when(what)


_install()
