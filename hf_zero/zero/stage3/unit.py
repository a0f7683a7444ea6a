"""A stage-3 unit: the parameters of one module in one flat buffer per param group, all-gathered as one
(exactly, quantized under qwZ, or inside the node from hpZ's secondary partition) and freed after use.

A unit's parameters are in one of the states of `UnitState` (FSDP2's ShardedState, with the gather in flight a state
of its own), and a move the table `MOVES` does not allow raises. hpZ's secondary partition lives beside that state:
kept from a forward until the optimizer step, it outlasts many gathers and frees."""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_zero.ops.quantize import dequantize_senders, quantize
from hf_zero.runtime.comm import Communicator, issued_for
from hf_zero.runtime.device import Copy, LatestCopy, on_copy_stream, to_device
from hf_zero.runtime.trace import span
from hf_zero.zero.partition import FlatParamBuffer, set_data
from hf_zero.zero.update_files import ShardReader


class UnitState(enum.Enum):
    SHARDED = "sharded"  # this rank's shards only; the parameters view an empty tensor
    FREED_EARLY = "freed early"  # sharded, each parameter keeping its shape over one NaN until its gradient comes
    GATHERING = "gathering"  # the buffers allocated and viewed, the all-gather in flight (`PendingGather`)
    GATHERED = "gathered"  # whole, readable on the compute stream


MOVES = {
    UnitState.SHARDED: {UnitState.GATHERING, UnitState.GATHERED},  # to GATHERED: its buffers filled when it is built
    UnitState.FREED_EARLY: {UnitState.GATHERING, UnitState.SHARDED},
    UnitState.GATHERING: {UnitState.GATHERED},  # a gather in flight is waited on before anything else
    UnitState.GATHERED: {UnitState.SHARDED, UnitState.FREED_EARLY, UnitState.GATHERING},  # GATHERING: `refresh`
}


@dataclass
class PendingGather:
    """What a gather in flight holds until `Unit.wait`: its collective, the copies of host shards to the device it
    follows, the NVMe read buffers those copies read, and under qwZ each flat buffer's received bytes (values and
    scales) with the number of value bytes among them."""
    work: Any = None
    copies: list[Copy] = field(default_factory=list)
    read_buffers: list[tuple[torch.Tensor, Copy]] = field(default_factory=list)
    quantized: list[tuple[FlatParamBuffer, torch.Tensor, int]] = field(default_factory=list)


class Unit:
    """The parameters of one module, one flat buffer per optimizer param group and one of its frozen weights,
    gathered as one."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParamBuffer], groups: list[int | None],
                 comm: Communicator, persistent: bool = False) -> None:
        """`groups`: each flat buffer's param group, None for the frozen weights' (last)."""
        self.name, self.module, self.flats, self.groups = name, module, flats, groups
        self.trained_flats = [flat for flat, g in zip(flats, groups) if g is not None]
        self.frozen_flats = flats[len(self.trained_flats):]  # the frozen weights' buffer comes last
        self.comm, self.persistent = comm, persistent
        self.numel = sum(f.padded_numel for f in flats)
        self.nbytes = sum(f.padded_numel * f.data.element_size() for f in flats)  # gathered
        self.shards: list[torch.Tensor] = []  # this rank's chunk of each flat buffer (set by Stage3Params)
        # (param group, chunk) of each, in the optimizer's order; None for the frozen weights' (no optimizer)
        self.shard_ids: list[tuple[int, int] | None] = []
        self.reader: ShardReader | None = None  # offload_param nvme: the chunks are read from files
        # offload_param: each gather copies the shards from host memory to the device first, and the latest
        # copy is kept here until the update writes the shards; None when the shards are on the device.
        self.shards_lent: LatestCopy | None = None
        # Storage is released at once: holding every unit's buffer while sharding would hold a second
        # whole copy of the model; `adopt_params` fills and frees them one unit at a time.
        for flat in flats:
            flat.release_storage()
        self.state = UnitState.SHARDED
        self.pending: PendingGather | None = None  # while GATHERING
        self.empty = torch.empty(0, dtype=flats[0].data.dtype, device=flats[0].data.device)
        # ZeRO++ qwZ: the quantization block size when training gathers go quantized (None: they do not).
        self.quantize_block: int | None = None
        # ZeRO++ hpZ: the ranks of this node a secondary partition is spread over (None: off), and this rank's
        # part of each gathered buffer, kept from a forward until the optimizer step changes the weights.
        self.secondary: Communicator | None = None
        self.secondary_parts: list[torch.Tensor] = []

    @property
    def title(self) -> str:
        """The unit as messages name it: by its module's name, the root (named '') as the root unit."""
        return f"unit {self.name!r}" if self.name else "the root unit"

    @property
    def gathered(self) -> bool:
        """Whether the parameters view the whole buffers (the gather may still be in flight: `wait`)."""
        return self.state in (UnitState.GATHERING, UnitState.GATHERED)

    def _move(self, to: UnitState) -> None:
        """The unit's parameters go from their state to `to`, which MOVES must allow."""
        if to not in MOVES[self.state]:
            raise AssertionError(f"{self.title} cannot go from {self.state.value} to {to.value}")
        self.state = to

    def gather(self, purpose: str = "read") -> None:
        """Starts the all-gather of every flat buffer of the unit (asynchronously), for a "forward", a
        "backward" or a "read" (export, inspection). Under ZeRO++ a forward or backward gather goes
        quantized (qwZ), or inside the node from the secondary partition (hpZ) once a forward kept one; a read
        is always exact and from the primary shards."""
        if not self.gathered:
            self._gather_into_buffers(purpose)

    def refresh(self) -> None:
        """The persistent unit, gathered for good, all-gathers its updated shards into its buffers in place."""
        assert self.persistent, f"{self.title} is gathered on use, not refreshed"
        self._gather_into_buffers("read")
        self.wait()

    def _gather_into_buffers(self, purpose: str) -> None:
        self._tally(+1)
        for flat in self.flats:
            flat.allocate_storage()
        self.pending = PendingGather()
        with issued_for(f"the {purpose} gather of {self.title}"), span("gather", self.title):
            self.pending.work = self._start_gather(purpose)
        for flat in self.flats:
            for s in flat.slices:
                set_data(s.param, flat.view_of(s))
        self._move(UnitState.GATHERING)

    def _start_gather(self, purpose: str) -> Any:
        if purpose != "read" and self.secondary_parts:
            return self._gather_exact(self.secondary, self.secondary_parts)
        shards = [self._shard_on_device(i) for i in range(len(self.flats))]
        if purpose != "read" and self.quantize_block is not None:  # never with offload_param (config.py)
            return self._gather_quantized(shards)
        # With the shards in host memory the gather follows their copies on the copy stream (stream order: no wait),
        # so that neither holds up the compute queued meanwhile (on one stream, PCIe time would add to every step).
        # The compute stream waits on the gather's handle (`wait`) before reading.
        with on_copy_stream(self.flats[0].data.device) if self.pending.copies else contextlib.nullcontext():
            return self._gather_exact(self.comm, shards)

    def _shard_on_device(self, i: int) -> torch.Tensor:
        """The unit's chunk of flat buffer `i` on the device. A trained chunk on NVMe (`reader`) is read into one
        of the reader's host buffers first; a frozen one has no file and stays in host memory."""
        buffer = None
        if self.reader is not None and self.shard_ids[i] is not None:
            shard, buffer = self.reader.read(*self.shard_ids[i])
        else:
            shard = self.shards[i]
        if self.shards_lent is not None:
            shard, copy = to_device(shard, self.flats[i].data.device, f"the host shard of {self.title}",
                                    overlap=True)
            self.pending.copies.append(copy)
            if buffer is not None:
                self.pending.read_buffers.append((buffer, copy))
        return shard

    def _gather_exact(self, comm: Communicator, parts: list[torch.Tensor]) -> Any:
        with contextlib.ExitStack() as unversioned:
            # Writing into the buffers must not bump the version autograd checks on saved views of them.
            for flat in self.flats:
                unversioned.enter_context(torch.autograd._unsafe_preserve_version_counter(flat.data))
            return comm.all_gather_coalesced_([flat.data for flat in self.flats], parts, async_op=True)

    def keep_secondary(self) -> None:
        """hpZ, after a forward whose backward follows: this rank keeps its 1/hpz of the gathered buffers, so
        that until the optimizer step (DeepSpeed's lifetime) the unit's gathers for the backward, for the
        recomputation of activation checkpointing and for the forwards of the next micro-batches come from
        the node's ranks only. Kept already: the weights have not changed since."""
        if self.secondary is None or self.secondary_parts:
            return
        self.wait()
        assert self.state is UnitState.GATHERED, f"{self.title} keeps a secondary partition of what it has not gathered"
        size, index = self.secondary.world_size, self.secondary.rank
        with span("keep_secondary", self.title):
            for flat in self.flats:
                n = flat.padded_numel // size
                self.secondary_parts.append(flat.data[index * n:(index + 1) * n].clone())
        self.comm.ledger.hold("bytes of secondary partitions", self.nbytes // size)

    def drop_secondary(self) -> None:
        """The secondary partition goes when the weights change (the optimizer step, a checkpoint's load), once the
        unit is sharded: no gather in flight reads the parts any more."""
        if self.secondary_parts:
            assert self.state is UnitState.SHARDED, \
                f"{self.title} drops its secondary partition while {self.state.value}"
            self.secondary_parts.clear()
            self.comm.ledger.hold("bytes of secondary partitions", -(self.nbytes // self.secondary.world_size))

    def _gather_quantized(self, shards: list[torch.Tensor]) -> Any:
        """qwZ: each rank sends its chunk as int8 values with an fp32 scale per block (a quarter of fp32's
        bytes, half of bf16's); `wait` dequantizes every rank's part into the buffers."""
        outputs, inputs, world = [], [], self.comm.world_size
        for flat, shard in zip(self.flats, shards):
            packed = quantize(shard, 8, self.quantize_block)
            # Values and scales in one byte buffer per rank: one dtype in every call, as every backend takes it
            # (gloo's grouped all-gather, which tests that take NCCL's call shapes still run, returned int8 and
            # fp32 tensors wrong).
            sent = torch.cat([packed.values.view(torch.uint8), packed.scales.view(torch.uint8)])
            received = torch.empty(world * sent.numel(), dtype=torch.uint8, device=shard.device)
            outputs.append(received)
            inputs.append(sent)
            self.pending.quantized.append((flat, received, packed.values.numel()))
        return self.comm.all_gather_coalesced_(outputs, inputs, async_op=True)

    @torch.no_grad()
    def _dequantize(self, quantized: list[tuple[FlatParamBuffer, torch.Tensor, int]]) -> None:
        for flat, received, values_numel in quantized:
            each_rank = received.view(self.comm.world_size, -1)
            values = each_rank[:, :values_numel].view(torch.int8)
            scales = each_rank[:, values_numel:].contiguous().view(torch.float32)  # fp32 alignment: a small copy
            with torch.autograd._unsafe_preserve_version_counter(flat.data):
                dequantize_senders(values, scales, self.comm.world_size, 8, self.quantize_block,
                                   flat.buckets[0].chunk_numel, flat.data)

    def wait(self) -> None:
        """The stream the caller queues on (the compute stream) waits for the unit's gather: its buffers may be
        read there, and given back to the allocator, from then on. Nothing to wait for unless GATHERING."""
        if self.state is not UnitState.GATHERING:
            return
        pending, self.pending = self.pending, None
        with span("wait_for_gather", self.title):
            pending.work.wait()
        if pending.quantized:
            self._dequantize(pending.quantized)
        if self.reader is not None:  # a read buffer is refilled only after its copy to the device has landed
            for buffer, copy in pending.read_buffers:
                self.reader.release(buffer, copy)
        elif pending.copies:
            self.shards_lent.add(pending.copies[-1])
        self._move(UnitState.GATHERED)

    @torch.no_grad()
    def adopt_params(self) -> None:
        """Moves the module's own parameter tensors into the unit's buffers, then frees them (once, at start)."""
        for flat in self.flats:
            flat.allocate_storage()
            flat.pack_and_bind()
        self.built()

    def built(self) -> None:
        """The unit's buffers hold its values (its chunk is cut): the persistent unit stays gathered, the
        others give their buffers back, without the ledger's tally (nothing was all-gathered)."""
        self._move(UnitState.GATHERED)
        if not self.persistent:
            self._release_buffers(UnitState.SHARDED)

    @property
    def is_root(self) -> bool:
        """The unit of the parameters outside every block (embeddings, final norm, head)."""
        return self.name == ""

    def group_of(self, flat: FlatParamBuffer) -> int:
        return self.groups[self.flats.index(flat)]

    def _tally(self, sign: int) -> None:
        """The ledger's count of unit all-gathers and of units (and their bytes) gathered at once."""
        if self.persistent:
            return
        ledger = self.comm.ledger
        if sign > 0:
            ledger.count("unit all-gathers")
        ledger.hold("units gathered", sign)
        ledger.hold("bytes of gathered units", sign * self.nbytes)

    def free(self) -> None:
        """Gives the gathered buffers back (the persistent unit keeps them), and a freed-early unit's placeholders."""
        if self.state is UnitState.FREED_EARLY:
            self._set_params(lambda s: self.empty)
            self._move(UnitState.SHARDED)
        if self.persistent or not self.gathered:
            return
        self._tally(-1)
        self._release_buffers(UnitState.SHARDED)

    def free_early(self) -> None:
        """Frees the buffers while gradients of the unit's parameters are still to come. Autograd checks each
        gradient against its parameter's shape when it arrives, so until then each parameter keeps its shape
        over a single NaN: no memory, and a stray read shows as NaN instead of passing for a weight."""
        if self.persistent or not self.gathered:
            return
        self._tally(-1)
        self._release_buffers(UnitState.FREED_EARLY)

    def _set_params(self, data) -> None:
        for flat in self.flats:
            for s in flat.slices:
                set_data(s.param, data(s))

    def _release_buffers(self, to: UnitState) -> None:
        """Waits for the gather, points the parameters at empty tensors (SHARDED) or NaN placeholders of their
        shapes (FREED_EARLY), and gives the buffers back."""
        self.wait()
        self._set_params(lambda s: self.empty)
        with span("release", self.title):
            for flat in self.flats:
                flat.release_storage(f"the release of {self.title}'s gathered buffer")
        if to is UnitState.FREED_EARLY:
            nan = torch.full((1,), float("nan"), dtype=self.empty.dtype, device=self.empty.device)
            self._set_params(lambda s: nan.expand(s.shape))
        self._move(to)
