"""Stage 3's gradients: stage 2's bucketed reduce-scatter with one bucket per unit and param group, each
unit's launched at its post-backward."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
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
                 reduce_dtype: torch.dtype, offload: str, double_buffered: bool) -> None:
        """`units` as Stage3Params holds them, their flat buffers in that order; `position`: see GradientReducer."""
        super().__init__([f for u in units for f in u.trained_flats], comm, overlap_comm, position, reduce_dtype,
                         reuse_buffers=False, offload=offload, double_buffered=double_buffered, max_in_flight=1)
        self.units = units
        self.unit_of_flat = [u for u in units for _ in u.trained_flats]
        self.unit_of_param = {s.param: unit for unit in units for flat in unit.trained_flats for s in flat.slices}
        self.params_waiting: dict[int, int] = {}  # per unit: its parameters whose gradient has not come yet
        self.unit_keys = {id(u): [key for key in self.launch_order if self.unit_of_flat[key[0]] is u] for u in units}
        # Per unit: its forwards since the last backward whose post-backward has not run yet (_PostBackward), and
        # the units a forward ran with no input that requires grad, whose backward's end nothing marks.
        self.post_backwards: dict[int, int] = {}
        self.unmarked: set[int] = set()

    def begin(self, reduce: bool) -> None:
        super().begin(reduce)
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
