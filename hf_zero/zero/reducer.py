"""Bucket readiness during backward: the part of gradient reduction every stage shares.

Each parameter gets a post-accumulate-grad hook. When the last gradient of a bucket has arrived the
bucket is ready, and ready buckets are reduced in one launch order that every rank shares, asynchronously
when `overlap_comm` is on, so the collectives overlap the rest of the backward pass. Launching in the
order buckets happen to become ready would not do: a parameter used on some ranks only (a mixture of
experts, a conditional branch) completes its bucket during backward there and only in `finish` elsewhere,
and the ranks' collectives would then pair up different buckets (a mismatch abort, a hang, or silently
wrong sums when sizes agree). A ready bucket waits for those before it in the order; whatever is left at
the end of backward is launched in `finish`, in the same order, its missing pieces zeros (a parameter no
gradient reached on this rank adds nothing to the average).

That one order is enough at stages 1-2, whose backward issues no other collective. Stage 3's backward also
all-gathers units, so there the position of each reduction among the gathers must be the same on every rank
too: its buckets launch at points every rank reaches, not when they happen to be complete (Stage3Gradients).

The order is the expected order of readiness: backward produces gradients roughly in the reverse of the
order the model registers its parameters, so a bucket is ready about when its earliest-registered parameter's
gradient arrives, and buckets launch latest-registered first, whatever param group they belong to.

Reductions run on the communication stream (`hf_zero.runtime.device.CommStream`: a CUDA stream of their own on a
GPU), so backward's compute never waits on a collective. At most `max_in_flight` reductions keep their
buffers (MAX_IN_FLIGHT, one at stage 3): each holds a bucket buffer (stages 2-3), and letting them pile up
until the end of backward would hold a whole gradient's worth of buffers, which is exactly the memory
stage 2 exists to save (C_B: bounded buffers whatever the model size). Beyond that the compute stream
waits on the oldest before its buffer goes back to be reused. Stage 3's buckets are whole units, so it
keeps one in flight, as FSDP2 does: the next unit's backward still overlaps it.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator, issued_for
from hf_zero.runtime.device import CommStream, Reduction
from hf_zero.runtime.trace import span
from hf_zero.zero.partition import FlatParamBuffer, Piece

BucketKey = tuple[int, int]  # (flat buffer index, bucket index)
MAX_IN_FLIGHT = 2


def _nothing() -> None:
    pass


class StepPhase(enum.Enum):
    """Where a step stands for the gradients (FSDP2's TrainingState): `begin` and `finish` move it, and a move
    PHASE_MOVES does not allow raises."""
    IDLE = "idle"  # no backward running: forwards, evaluation, the optimizer step
    BACKWARD = "backward"  # gradients arriving, buckets reduced as they complete where this backward reduces
    FINISHING = "finishing"  # backward has returned: the buckets left are launched and every reduction waited on


PHASE_MOVES = {
    StepPhase.IDLE: {StepPhase.BACKWARD},
    StepPhase.BACKWARD: {StepPhase.FINISHING},
    StepPhase.FINISHING: {StepPhase.IDLE},
}


@dataclass(frozen=True)
class BucketReduction:
    """How one bucket is reduced: on the communication stream, `launch` issues its collective and `land`
    (device work only) takes this rank's result in once it is done; `release` is the host's bookkeeping
    (the bucket buffer goes back for reuse) once the compute stream has waited on it."""
    launch: Callable[[], Any]
    land: Callable[[], None] = _nothing
    release: Callable[[], None] = _nothing


class GradientReducer:
    """For each gradient: `accumulate(param)`, then per bucket piece `write_piece` (launching
    `reduce_bucket(key)` as soon as a bucket is complete), then `release(param)`."""

    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool,
                 position: dict[nn.Parameter, int], max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """`position`: each parameter's place in the model's registration order (the launch order's basis)."""
        self.max_in_flight = max_in_flight
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
        self.got_grad: set[nn.Parameter] = set()  # since the last take_unused(): unused ones are not stepped
        first = {key: min((position[piece.slice.param] for piece in flat_params[key[0]].pieces[key[1]]), default=-1)
                 for key in self.expected}
        self.launch_order = sorted(self.expected, key=lambda key: (-first[key], key))
        self.launch_rank = {key: i for i, key in enumerate(self.launch_order)}
        for pieces in self.param_pieces.values():
            pieces.sort(key=lambda key_piece: self.launch_rank[key_piece[0]])
        self.pending: dict[BucketKey, int] = {}
        self.ready: set[BucketKey] = set()
        self.launched: set[BucketKey] = set()  # in this backward
        self.next_in_order = 0  # launch_order[:next_in_order] are launched
        self.comm_stream = CommStream(comm.device)
        self.in_flight: deque[tuple[Reduction, Callable[[], None]]] = deque()
        self.phase = StepPhase.IDLE
        self.reducing = False  # whether this backward's buckets are reduced (else its gradients accumulate)
        for p in self.param_pieces:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def accumulate(self, param: nn.Parameter) -> None:
        """Takes the parameter's gradient in as a whole (stages 0-1)."""

    def write_piece(self, key: BucketKey, piece: Piece, param: nn.Parameter) -> None:
        """Copies one piece of the gradient into its bucket (stages 2-3)."""

    def release(self, param: nn.Parameter) -> None:
        """Called once the gradient has been taken in."""

    def reduce_bucket(self, key: BucketKey) -> BucketReduction:
        """Takes the complete bucket off backward's hands and says how to reduce it."""
        raise NotImplementedError

    def allocate(self) -> None:
        """Makes sure the gradient storage exists (stages 2-3 allocate it at the first backward)."""

    def buffer_bytes(self) -> int:
        """Communication buffers held now (stages 2-3: bucket buffers, C_B)."""
        return 0

    def measure_with(self, chunk_keys: list[list[BucketKey]],
                     square_sum: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        """How the gradients would be measured as they land (stages 2-3); stages 0-1 are measured at the step."""

    def measured_square_sum(self) -> torch.Tensor | None:
        """The fp64 sum of squares of the reduced gradients, measured as they landed, or None (measure them)."""
        return None

    def hand_over(self) -> bool:
        """Whether a delayed update may keep the gradients as they are, the next backward writing elsewhere."""
        return False

    def begin(self, reduce: bool) -> None:
        """Called before each backward; `reduce` says whether this backward's buckets are reduced."""
        self._move(StepPhase.BACKWARD)
        self.reducing = reduce
        self.pending = dict(self.expected)
        self.ready.clear()
        self.launched.clear()
        self.next_in_order = 0

    def check_in_backward(self) -> None:
        """Raises when a gradient arrives outside engine.backward()."""
        if self.phase is StepPhase.IDLE:
            raise RuntimeError("a gradient arrived outside engine.backward(); call engine.backward(loss) "
                               "instead of loss.backward() so that ZeRO can reduce it")

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self.check_in_backward()
        self._take_in(param, lambda key, piece: self.write_piece(key, piece, param))
        self.release(param)

    def _take_in(self, param: nn.Parameter, write: Callable[[BucketKey, Piece], None]) -> None:
        """The parameter's gradient has come: `write` puts each piece into its bucket."""
        self.got_grad.add(param)
        self.accumulate(param)
        if self.reducing:
            # Piece by piece in launch order, so that a parameter spanning many buckets never opens them all
            # at once.
            for key, piece in self.param_pieces[param]:
                self._check_not_launched(key, param)
                write(key, piece)
                self.pending[key] -= 1
                if self.pending[key] == 0:
                    self.ready.add(key)
                    self.bucket_ready()

    def bucket_ready(self) -> None:
        """A bucket is complete: launches the ready buckets that are next in launch order (stages 1-2)."""
        order = self.launch_order
        while self.next_in_order < len(order) and order[self.next_in_order] in self.ready:
            self.launch(order[self.next_in_order])
            self.next_in_order += 1

    def _check_not_launched(self, key: BucketKey, param: nn.Parameter) -> None:
        if key in self.launched:
            raise RuntimeError(f"a gradient of a parameter of shape {tuple(param.shape)} came after its bucket "
                               f"was reduced ({self.reduced_when(key)}): it was read again outside the module that "
                               f"holds it, whose backward had ended")

    def reduced_when(self, key: BucketKey) -> str:
        """Says when bucket `key` is reduced, for errors."""
        return "once every gradient in it had come"

    def bucket_name(self, key: BucketKey) -> str:
        """What bucket `key` holds, the same on every rank: its reduction's collectives say so (comm.issued_for)."""
        return f"gradient bucket {key[1]} of flat buffer {key[0]}"

    def take_unused(self) -> list[nn.Parameter]:
        """The parameters no gradient reached on this rank since the last call (one optimizer step's window)."""
        unused = [p for p in self.param_pieces if p not in self.got_grad]
        self.got_grad.clear()
        return unused

    def launch(self, key: BucketKey) -> None:
        """Reduces bucket `key` now; the pieces no gradient reached on this rank add zeros."""
        self.launched.add(key)
        bucket, name = self.reduce_bucket(key), self.bucket_name(key)

        def launch_named() -> Any:  # the collective may be issued later, at a wait (simulation "late")
            with issued_for(f"the reduction of {name}"), span("reduce", name):
                return bucket.launch()

        self.in_flight.append((self.comm_stream.submit(launch_named, bucket.land), bucket.release))
        limit = self.max_in_flight if self.overlap_comm else 0
        while self.in_flight and (len(self.in_flight) > limit or self.comm_stream.done(self.in_flight[0][0])):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        reduction, release = self.in_flight.popleft()
        self.comm_stream.wait(reduction)
        release()

    @torch.no_grad()
    def finish(self) -> None:
        """Reduces buckets left incomplete by unused parameters and waits for every reduction. A reduction that
        raises leaves the step idle all the same."""
        self._move(StepPhase.FINISHING)
        try:
            if self.reducing:
                for key in self.launch_order:
                    if key not in self.launched:
                        self.launch(key)
            self.comm_stream.join()  # the one wait of the compute stream on every reduction left
            for _, release in self.in_flight:
                release()
            self.in_flight.clear()
        finally:
            self._move(StepPhase.IDLE)

    def _move(self, to: StepPhase) -> None:
        if to not in PHASE_MOVES[self.phase]:
            raise AssertionError(f"the gradient reducer cannot go from {self.phase.value} to {to.value}")
        self.phase = to
