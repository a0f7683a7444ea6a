"""Stage 3's gradients: stage 2's bucketed reduce-scatter with one bucket per unit and param group, each
unit's launched at its post-backward, and the uses of a tied weight handed in apart (shared_weights.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
from hf_zero.zero.grad_landing import GradLanding
from hf_zero.zero.partition import Piece, local_grad
from hf_zero.zero.reducer import BucketKey
from hf_zero.zero.stage2 import PartitionedGradients

if TYPE_CHECKING:
    from hf_zero.zero.stage3.unit import Unit


class Stage3Gradients(PartitionedGradients):
    """Stage 2's bucketed reduce-scatter with one bucket per unit and param group. A unit is freed as soon as
    the last of its parameters has its gradient, before that gradient is copied into the bucket: the node
    that computed it was the last to read the unit's weights, and the root's last gradient (a tied
    vocabulary embedding) would otherwise hold the gathered weights, the gradient and the bucket at once.

    A unit's buckets launch at its post-backward (_PostBackward), not when they are complete: a rank whose
    forward skipped part of the unit (an expert no token was routed to, a branch not taken) gets no gradient
    for those parameters and its buckets would complete only at the end of backward, after all-gathers of the
    units that follow, while on the other ranks they launch before those (rank 0's reduce-scatter would meet
    rank 1's all-gather: a hang, or wrong weights if their sizes agree). The post-backward is a point every
    rank reaches in the same place among its gathers; there a parameter without a gradient adds zeros, and a
    unit whose parameters some ranks left unused is freed. A unit used n times in a forward (a layer shared by
    several positions) has n post-backwards, and reduces at the last. A unit with a use none of whose inputs
    requires grad (nothing marks that use's end), the root and the persistent unit launch at the end of backward,
    in launch order."""

    def __init__(self, units: list[Unit], position: dict[nn.Parameter, int], comm: Communicator, overlap_comm: bool,
                 reduce_dtype: torch.dtype, landing: type[GradLanding], double_buffered: bool) -> None:
        """`units` as Stage3Params holds them, their flat buffers in that order; `position`: see GradientReducer."""
        super().__init__([f for u in units for f in u.trained_flats], comm, overlap_comm, position, reduce_dtype,
                         reuse_buffers=False, landing=landing, double_buffered=double_buffered, max_in_flight=1)
        self.units = units
        self.unit_of_flat = [u for u in units for _ in u.trained_flats]
        self.unit_of_param = {s.param: unit for unit in units for flat in unit.trained_flats for s in flat.slices}
        self.params_waiting: dict[int, int] = {}  # per unit: its parameters whose gradient has not come yet
        self.unit_keys = {id(u): [key for key in self.launch_order if self.unit_of_flat[key[0]] is u] for u in units}
        # Per unit: its forwards since the last backward whose post-backward has not run yet (_PostBackward), and
        # the units a forward ran with no input that requires grad, whose backward's end nothing marks.
        self.post_backwards: dict[int, int] = {}
        self.unmarked: set[int] = set()
        self.kept_contributions: set[BucketKey] = set()  # buckets whose early pieces hold a tied use's gradient
        # Tied weights whose first use in this forward gives its gradient as rows (take_rows), at the end of
        # backward: a gradient from any other use before that is one more contribution.
        self.rows_to_come: set[nn.Parameter] = set()

    def begin(self, reduce: bool) -> None:
        super().begin(reduce)
        self.kept_contributions.clear()  # left by a backward that raised
        # A unit with frozen weights reads them after its trained parameters took their gradients (the input's
        # gradient through a LoRA base layer): it is freed at its post-backward instead.
        self.params_waiting = {id(u): sum(len(f.slices) for f in u.flats) for u in self.units
                               if not u.frozen_flats}

    def bucket_ready(self) -> None:
        """A complete bucket waits for its unit's post-backward."""

    def reduced_when(self, key: BucketKey) -> str:
        unit = self.unit_of_flat[key[0]]
        return f"at the end of the backward of {unit.title}"

    def bucket_name(self, key: BucketKey) -> str:
        unit = self.unit_of_flat[key[0]]
        return f"the gradients of {unit.title}" + (f" (flat buffer {key[0]})" if len(unit.trained_flats) > 1 else "")

    def expect_post_backward(self, unit: Unit, marked: bool) -> None:
        """A forward of the unit marked its post-backward (schedule.py's _PostBackward), or had no input to mark
        it on (`marked` False): then the unit is reduced at the end of backward, as its gradients from that use
        may come after every marked one's post-backward (a layer that runs first on the model's inputs and
        again later)."""
        if marked:
            self.post_backwards[id(unit)] = self.post_backwards.get(id(unit), 0) + 1
        else:
            self.unmarked.add(id(unit))

    def post_backwards_to_come(self, unit: Unit) -> int:
        return self.post_backwards.get(id(unit), 0)

    @torch.no_grad()
    def post_backward(self, unit: Unit) -> None:
        """The unit's backward is over on this rank: its buckets are reduced now, the same point among the
        collectives on every rank, with zeros for its parameters no gradient reached here."""
        to_come = self.post_backwards.pop(id(unit), 0) - 1
        if to_come > 0:  # an earlier use's backward is still to run
            self.post_backwards[id(unit)] = to_come
            return
        if id(unit) in self.unmarked:
            return
        self.check_in_backward()
        unit.free()
        if self.reducing:
            for key in self.unit_keys[id(unit)]:
                if key not in self.launched:
                    self.launch(key)

    @torch.no_grad()
    def finish(self) -> None:
        super().finish()
        self.post_backwards.clear()  # left by a forward whose backward never came
        self.unmarked.clear()

    def accumulate(self, param: nn.Parameter) -> None:
        unit = self.unit_of_param[param]
        if id(unit) not in self.params_waiting:
            return
        self.params_waiting[id(unit)] -= 1
        if self.params_waiting[id(unit)] == 0:
            unit.free()

    # ---- a tied weight's uses, handed in apart (shared_weights.py) ------------------------------
    @torch.no_grad()
    def contribute(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """One use's gradient of a parameter the model reads more than once per forward (a tied weight: see
        Stage3Params._split_tied_uses), added into the parameter's buckets, or kept as it came until
        `open_buckets` (no copy beside it while the weights it was computed from are still gathered). The
        buckets still go out in their turn, once the parameter's own gradient (its first use's) has come."""
        self.check_in_backward()
        self.got_grad.add(param)
        for key, piece in self.param_pieces[param]:
            if key in self.launched:
                raise RuntimeError(f"a gradient of a tied weight ({tuple(param.shape)}) came after its bucket was "
                                   f"reduced: a later use in the forward reached backward after the first one. "
                                   f"ZeRO stage 3 expects the first use of a tied weight to get its gradient last")
            if key in self.bucket_buffers:
                self._add_to_bucket(key, piece, grad)
            else:
                part = grad.reshape(-1)[piece.param_lo:piece.param_hi]
                self.early_pieces.setdefault(key, []).append((piece.range_lo, part.to(self.dtype)))
                self.kept_contributions.add(key)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # every use handed its gradient over apart (take_rows, contribute): none left
            return
        if param in self.rows_to_come:
            self.contribute(param, local_grad(param))
            self.release(param)
            return
        super()._on_grad_ready(param)

    @torch.no_grad()
    def take_rows(self, param: nn.Parameter, rows: torch.Tensor, row_grads: torch.Tensor) -> None:
        """The gradient of a tied weight's first use, an embedding lookup (Stage3Params._split_tied_uses), as the
        rows its tokens picked: `row_grads[i]` is the gradient of row `rows[i]`, the rest is zero (a row may come
        again, with zeros).
        Added into the parameter's bucket, after the other uses' contributions as a dense gradient would be;
        then the parameter's gradient has come."""
        self.check_in_backward()
        self.rows_to_come.discard(param)
        assert self.reducing, "rows are taken at stage 3, which reduces every backward"

        def write(key: BucketKey, piece: Piece) -> None:
            whole = piece.slice  # the parameter may be freed already: its slice knows its shape
            assert piece.param_lo == 0 and piece.param_hi == whole.numel, "stage 3: one bucket per parameter"
            region = self._buffer(key)[piece.range_lo:piece.range_lo + whole.numel].view(whole.shape)
            region.index_add_(0, rows, row_grads.to(self.dtype))  # a row's other slots add zeros: exact

        self._take_in(param, write)

    def open_buckets(self) -> None:
        """Opens the buckets that hold contributions kept as they came, taking them in (once the root's weights
        are freed, the tied head's gradient moves into its bucket)."""
        for key in self.kept_contributions:
            if key in self.early_pieces:  # else its bucket has opened already
                self._buffer(key)
        self.kept_contributions.clear()
