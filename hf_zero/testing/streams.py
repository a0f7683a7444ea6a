"""Where the simulated GPU's work is queued now, per thread: the stream (`stream_now`), the host timeline of a
thread that runs beside the one driving the device (`host_of_this_thread`), and whether the ops inside are the
simulation's own doing (`quiet`) or run later than the host issued them (`issued_earlier`)."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from hf_zero.runtime.timeline import COMPUTE
from hf_zero.settings import environment

HOST = "host"  # the host's timeline, beside the device's streams (hf_zero.runtime.timeline: COMPUTE, COMM, COPY)

_current = threading.local()


def simulation() -> str | None:
    """How asynchronous work runs on CPU (tests: HF_ZERO_SIMULATE_ASYNC): "late", "early" or None (at once)."""
    return environment.simulation()


def simulating() -> bool:
    """Whether asynchronous work behaves as on a GPU (`simulation`), though it runs on CPU."""
    return simulation() is not None


def stream_now() -> str:
    """The stream the calling thread queues device work on now (`on_stream`)."""
    return getattr(_current, "stream", COMPUTE)


@contextlib.contextmanager
def queued_on(name: str) -> Iterator[None]:
    """Device work the calling thread issues inside is queued on stream `name`."""
    previous, _current.stream = stream_now(), name
    try:
        yield
    finally:
        _current.stream = previous


def host_of_this_thread() -> str:
    """The host timeline of the calling thread: HOST, or a background thread's own (`as_host_timeline`)."""
    return getattr(_current, "host_timeline", HOST)


@contextlib.contextmanager
def as_host_timeline(name: str) -> Iterator[None]:
    """The calling thread is host timeline `name` inside, ordered by its start and end events only: not issued by
    the host as it goes, as device work is."""
    _current.host_timeline, _current.issued_earlier = name, True
    try:
        yield
    finally:
        del _current.host_timeline, _current.issued_earlier


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The ops inside are the simulation's own doing (a collective's data movement, a snapshot of a copy's
    values): the stream checker takes the accesses the device layer declares for them instead."""
    _current.quiet = getattr(_current, "quiet", 0) + 1
    try:
        yield
    finally:
        _current.quiet -= 1


def quieted() -> bool:
    """Whether the calling thread is inside `quiet`."""
    return bool(getattr(_current, "quiet", 0))


@contextlib.contextmanager
def issued_earlier() -> Iterator[None]:
    """The ops inside run later than the host issued them (a reduction the simulation "late" runs at its wait):
    what the host did since does not order them; the event they first wait on carries their issue's order."""
    previous, _current.issued_earlier = is_issued_earlier(), True
    try:
        yield
    finally:
        _current.issued_earlier = previous


def is_issued_earlier() -> bool:
    """Whether the calling thread's ops run later than the host issued them (`issued_earlier`)."""
    return getattr(_current, "issued_earlier", False)
