"""Bucket readiness during backward: the part of gradient reduction every stage shares.

Each parameter gets a post-accumulate-grad hook. When the last gradient of a bucket has arrived the
bucket is reduced at once, asynchronously when `overlap_comm` is on, so the collective overlaps the
rest of the backward pass. Buckets that some parameter never reached (unused parameters) are
reduced in `finish`, in bucket order, which is the same on every rank.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.zero.partition import FlatParamBuffer, Piece

BucketKey = tuple[int, int]  # (flat buffer index, bucket index)


class GradientReducer:
    """Calls `accumulate(param)` for every gradient and `reduce_bucket(key)` once per complete bucket."""

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
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.param_pieces]

    def accumulate(self, param: nn.Parameter) -> None:
        raise NotImplementedError

    def reduce_bucket(self, key: BucketKey) -> tuple[object, Callable[[], None]]:
        """Launches the bucket's collective; returns its work handle and what to run once it is done."""
        raise NotImplementedError

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
        if not self.reducing:
            return
        for key, _ in self.param_pieces[param]:
            self.pending[key] -= 1
            if self.pending[key] == 0:
                self._launch(key)

    def _launch(self, key: BucketKey) -> None:
        del self.pending[key]
        work, on_done = self.reduce_bucket(key)
        if self.overlap_comm:
            self.in_flight.append((work, on_done))
        else:
            work.wait()
            on_done()

    @torch.no_grad()
    def finish(self) -> None:
        """Reduces buckets left incomplete by unused parameters and waits for every reduction."""
        if self.reducing:
            for key in sorted(self.pending):
                self._launch(key)
        while self.in_flight:
            work, on_done = self.in_flight.popleft()
            work.wait()
            on_done()
        self.active = False

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
