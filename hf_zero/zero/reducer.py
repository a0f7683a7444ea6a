"""Bucket readiness during backward: the part of gradient reduction every stage shares.

Each parameter gets a post-accumulate-grad hook. When the last gradient of a bucket has arrived the
bucket is reduced at once, asynchronously when `overlap_comm` is on, so the collective overlaps the
rest of the backward pass. Buckets that some parameter never reached (unused parameters) are
reduced in `finish`, in bucket order, which is the same on every rank.

At most MAX_IN_FLIGHT reductions are outstanding: each holds a bucket buffer (stages 2-3), and
letting them pile up until the end of backward would hold a whole gradient's worth of buffers,
which is exactly the memory stage 2 exists to save (C_B: bounded buffers whatever the model size).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.zero.partition import FlatParamBuffer, Piece

BucketKey = tuple[int, int]  # (flat buffer index, bucket index)
MAX_IN_FLIGHT = 2


class GradientReducer:
    """For each gradient: `accumulate(param)`, then per bucket piece `write_piece` (launching
    `reduce_bucket(key)` as soon as a bucket is complete), then `release(param)`."""

    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool) -> None:
        self.flat_params = flat_params
        self.comm = comm
        self.overlap_comm = overlap_comm
        # Every piece of every parameter, keyed by parameter: a parameter may straddle two buckets.
        self.param_pieces: dict[nn.Parameter, list[tuple[BucketKey, Piece]]] = {}
        self.expected: dict[BucketKey, int] = {}
        for fi, flat in enumerate(flat_params):
            for s in flat.slices:
                self.param_pieces[s.param] = []
            for b in flat.buckets:
                self.expected[(fi, b.index)] = len(flat.pieces[b.index])
                for piece in flat.pieces[b.index]:
                    self.param_pieces[piece.slice.param].append(((fi, b.index), piece))
        self.pending: dict[BucketKey, int] = {}
        self.in_flight: deque[tuple[object, Callable[[], None]]] = deque()
        self.active = False
        self.reducing = False
        for p in self.param_pieces:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def accumulate(self, param: nn.Parameter) -> None:
        """Takes the parameter's gradient in as a whole (stages 0-1)."""

    def write_piece(self, key: BucketKey, piece: Piece, param: nn.Parameter) -> None:
        """Copies one piece of the gradient into its bucket (stages 2-3)."""

    def release(self, param: nn.Parameter) -> None:
        """Called once the gradient has been taken in."""

    def reduce_bucket(self, key: BucketKey) -> tuple[object, Callable[[], None]]:
        """Launches the bucket's collective; returns its work handle and what to run once it is done."""
        raise NotImplementedError

    def allocate(self) -> None:
        """Makes sure the gradient storage exists (stages 2-3 allocate it at the first backward)."""

    def buffer_bytes(self) -> int:
        """Communication buffers held now (stages 2-3: bucket buffers, C_B)."""
        return 0

    def begin(self, reduce: bool) -> None:
        """Called before each backward; `reduce` says whether this backward's buckets are reduced."""
        self.active, self.reducing = True, reduce
        self.pending = dict(self.expected)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.active:
            raise RuntimeError("a gradient arrived outside engine.backward(); call engine.backward(loss) "
                               "instead of loss.backward() so that ZeRO can reduce it")
        self.accumulate(param)
        if self.reducing:
            # Piece by piece, so that a parameter spanning many buckets never opens them all at once.
            for key, piece in self.param_pieces[param]:
                self.write_piece(key, piece, param)
                self.pending[key] -= 1
                if self.pending[key] == 0:
                    self._launch(key)
        self.release(param)

    def _launch(self, key: BucketKey) -> None:
        del self.pending[key]
        work, on_done = self.reduce_bucket(key)
        self.in_flight.append((work, on_done))
        limit = MAX_IN_FLIGHT if self.overlap_comm else 0
        while self.in_flight and (len(self.in_flight) > limit or self.in_flight[0][0].is_completed()):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        work, on_done = self.in_flight.popleft()
        work.wait()
        on_done()

    @torch.no_grad()
    def finish(self) -> None:
        """Reduces buckets left incomplete by unused parameters and waits for every reduction."""
        if self.reducing:
            for key in sorted(self.pending):
                self._launch(key)
        while self.in_flight:
            self._retire_oldest()
        self.active = False
