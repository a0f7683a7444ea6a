"""The `__main__` of a rank that torchrun started (`hf-zero run` and `hf-zero train` start them)."""
from __future__ import annotations

from typing import Callable, NoReturn

from hf_zero.checkpoint import CheckpointError
from hf_zero.runtime.comm import CollectiveError
from hf_zero.runtime.launch import (
    JoinError,
    die_with_launcher,
    end_local_ranks,
    exit_skipping_teardown,
    rendezvous_apart_from_earlier_starts,
    say_once,
)
from hf_zero.settings.config import ZeroConfigError


def run_rank(main: Callable[[], int | str | None], prog: str) -> NoReturn:
    """Runs `main` as a rank: it ends with its launcher, and an error hf_zero raises for the user to act on (a
    bad setting, a damaged checkpoint, a rank that stopped answering) is one line, said once, instead of a
    traceback on every rank and torchrun's report of each."""
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
    exit_skipping_teardown(code)
