"""Delayed parameter update (ZeRO-Offload, section 5.2).

After `warmup_steps` ordinary steps, the host update of step i runs in a background thread while the
device computes the forward and backward of step i+1 with the parameters from before that update;
it is waited for, and its parameters handed to the model, at the next optimizer step. The masters
still take every update in order; what changes is that each gradient is computed one update late.
The warm-up keeps the first, fastest-moving steps exact, as the paper recommends.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from hf_zero.runtime.device import joined, run_beside


class DelayedUpdate:
    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-delayed-update")
        self.pending: Future | None = None

    def overlaps(self, step: int) -> bool:
        """Whether optimizer step number `step` (from 0) runs in the background."""
        return step >= self.warmup_steps

    def launch(self, update: Callable[[], None]) -> None:
        assert self.pending is None, "wait() for the previous update before launching the next"
        self.pending = run_beside(self.pool, update, "delayed update thread")

    def wait(self) -> bool:
        """Waits for the update in flight (re-raising its error); False when there was none."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        joined(pending)
        return True
