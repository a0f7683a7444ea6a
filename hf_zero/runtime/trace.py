"""Trace spans: each phase of a step named in a torch.profiler trace ("hf_zero.gather unit 7", "hf_zero.reduce
bucket 3"), as FSDP2 and torchtitan label theirs, so that a profile reads by phase rather than by aten op.

A span is torch's record_function while a profiler records, and nothing otherwise: a record_function costs about
4 µs even with no profiler on, and stage 3 opens a few per unit each step. A plan's memory count (hf_zero.plan)
watches the spans instead (`watching_spans`): what a gather allocates is parameters, what a reduction allocates is
gradients.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Iterator, TypeVar

import torch
from torch.profiler import record_function

PREFIX = "hf_zero."
F = TypeVar("F", bound=Callable[..., Any])
_NOTHING = contextlib.nullcontext()
_watcher: Callable[[str], ContextManager[object]] | None = None


@contextlib.contextmanager
def watching_spans(watcher: Callable[[str], ContextManager[object]]) -> Iterator[None]:
    """Inside, each span is `watcher(phase)` (instead of a profiler's record_function)."""
    global _watcher
    before, _watcher = _watcher, watcher
    try:
        yield
    finally:
        _watcher = before


def span(phase: str, *what: object) -> ContextManager[object]:
    """The span of one phase, named `hf_zero.<phase> <what...>` (e.g. span("gather", "unit", 7))."""
    if _watcher is not None:
        return _watcher(phase)
    if not torch.autograd._profiler_enabled():
        return _NOTHING
    return record_function(" ".join([PREFIX + phase, *map(str, what)]))


def spanned(phase: str) -> Callable[[F], F]:
    """A function whose every call is the span `hf_zero.<phase>`."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def within_span(*args: Any, **kwargs: Any) -> Any:
            with span(phase):
                return fn(*args, **kwargs)
        return within_span  # type: ignore[return-value]
    return wrap
