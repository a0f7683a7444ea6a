"""What a rank runs around its main: one that `hf-zero run` or `hf-zero train` forked (hf_zero.cli.node_ranks), or
that torchrun started (`torchrun -m hf_zero.cli.run`)."""
from __future__ import annotations

import os
from typing import Callable

from hf_zero.checkpoint import CheckpointError
from hf_zero.runtime.comm import CollectiveError
from hf_zero.runtime.launch import (
    JoinError,
    die_with_launcher,
    end_local_ranks,
    exit_skipping_teardown,
    finish_as_exit_would,
    rendezvous_apart_from_earlier_starts,
    say_once,
)
from hf_zero.settings.config import ZeroConfigError

Ending = Callable[[int | str | None], None]


def run_rank(main: Callable[[], int | str | None], prog: str, end: Ending | None = None) -> None:
    """Runs `main` as a rank: it ends with its launcher, and an error hf_zero raises for the user to act on (a
    bad setting, a damaged checkpoint, a rank that stopped answering) is one line, said once, instead of a
    traceback on every rank and torchrun's report of each. `end` ends the rank with main's exit code (by default
    without the interpreter's teardown: exit_skipping_teardown)."""
    die_with_launcher()
    rendezvous_apart_from_earlier_starts()  # before the script starts its process group
    try:
        code = main()
    except SystemExit as stop:  # the script's own sys.exit
        code = stop.code
    except (ZeroConfigError, CheckpointError, CollectiveError, JoinError) as error:
        say_once(f"{prog}: {error}")
        if isinstance(error, JoinError):  # said once: the run ends now, not when torchrun gives up on them
            end_local_ranks(error.never_started)
        code = 2
    (end or exit_skipping_teardown)(code)


def end_forked_rank(code: int | str | None) -> None:
    """Ends a rank forked by `hf-zero run` or `hf-zero train` (hf_zero.cli.node_ranks) with `code`, as
    exit_skipping_teardown ends one torchrun started: torch's elastic agent counts a return as success, and an
    exit status for the failure it reports."""
    status = finish_as_exit_would(code)
    if status:
        os._exit(status)
    # Returned, the rank ends once the agent has read the return: multiprocessing's os._exit, without the
    # interpreter's teardown either.
