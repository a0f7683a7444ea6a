"""Faults for the restart tests, in every interpreter started with this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up): HF_ZERO_TEST_KILLS lists `RANK:RESTART:WHAT`, and the process that is rank RANK in its
RESTART-th start (torchrun's TORCHELASTIC_RESTART_COUNT) kills itself with SIGKILL, as the OOM killer or a node fault
would, at WHAT: `backward=N` (its Nth backward, so inside step N at one micro-batch a step) or `save=TEXT` (writing a
safetensors file whose path holds TEXT); or stops itself (SIGSTOP, as a debugger would) at `stop=join` (as it starts to
join the process group, before it tells the others). Which process is which is read at each call, as a forked rank
learns it after the fork; a process the list does not name calls the originals."""
from __future__ import annotations

import os
import signal


def _listed() -> list[tuple[str, str, str, str]]:
    """HF_ZERO_TEST_KILLS's entries as (rank, restart, kind, value); an unknown kind is refused."""
    entries = []
    for entry in filter(None, os.environ.get("HF_ZERO_TEST_KILLS", "").split(",")):
        rank, restart, what = entry.split(":", 2)
        kind, _, value = what.partition("=")
        if kind not in ("backward", "save", "stop"):
            raise ValueError(f"HF_ZERO_TEST_KILLS: unknown fault {what!r}")
        entries.append((rank, restart, kind, value))
    return entries


def _faults_now(kind: str) -> list[str]:
    """The values of the faults of `kind` listed for this process as it is now: a rank that `hf-zero run` forked
    is the fork server, which ran this module, until the fork, and gets its RANK after it."""
    now = (os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), kind)
    return [value for *which, value in _listed() if tuple(which) == now]


def _install() -> None:
    listed = {kind for _, _, kind, _ in _listed()}
    if "backward" in listed:
        import torch

        original_backward, calls = torch.autograd.backward, [0]

        def backward(*args, **kwargs):
            calls[0] += 1
            if str(calls[0]) in _faults_now("backward"):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_backward(*args, **kwargs)

        torch.autograd.backward = backward
    if "save" in listed:
        import safetensors.torch

        original_save = safetensors.torch.save_file

        def save_file(tensors, filename, *args, **kwargs):
            if any(value in str(filename) for value in _faults_now("save")):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_save(tensors, filename, *args, **kwargs)

        safetensors.torch.save_file = save_file
    if "stop" in listed:
        from hf_zero.runtime import launch

        original_announce = launch._announce_joining

        def announce_joining(*args, **kwargs):  # the first thing a rank's join does
            if "join" in _faults_now("stop"):
                os.kill(os.getpid(), signal.SIGSTOP)
            return original_announce(*args, **kwargs)

        launch._announce_joining = announce_joining


_install()
