"""A stage-3 unit: the parameters of one module in one flat buffer per param group, all-gathered as one
(exactly, quantized under qwZ, or inside the node from hpZ's secondary partition) and freed after use."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_zero.ops.quantize import dequantize_senders, quantize
from hf_zero.runtime.comm import Communicator, issued_for
from hf_zero.runtime.device import Copy, LatestCopy, on_copy_stream, to_device
from hf_zero.zero.partition import FlatParamBuffer, set_data

if TYPE_CHECKING:
    from hf_zero.optim.nvme import ParamReader


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
        self.reader: ParamReader | None = None  # offload_param nvme: the chunks are read from files
        # The reader's buffers lent until the all-gathers finish, each with its copy to the device.
        self.reading: list[tuple[torch.Tensor, Copy]] = []
        # offload_param: each gather copies the shards from host memory to the device first, and the latest
        # copy is kept here until the update writes the shards; None when the shards are on the device.
        self.shards_lent: LatestCopy | None = None
        self.copies: list[Copy] = []  # this gather's copies to the device, one per flat buffer
        # Storage is released at once: holding every unit's buffer while sharding would hold a second
        # whole copy of the model; `adopt_params` fills and frees them one unit at a time.
        for flat in flats:
            flat.release_storage()
        self.gathered = False
        self.works: list = []
        self.empty = torch.empty(0, dtype=flats[0].data.dtype, device=flats[0].data.device)
        # After free_early: each parameter's shape over one NaN (no memory), until free() or the next gather.
        self.placeholders = False
        # ZeRO++ qwZ: the quantization block size when training gathers go quantized (None: they do not), and
        # a quantized gather's received values and scales per flat buffer, dequantized once it has landed.
        self.quantize_block: int | None = None
        self.landing: list[tuple[FlatParamBuffer, torch.Tensor, torch.Tensor]] = []
        # ZeRO++ hpZ: the ranks of this node a secondary partition is spread over (None: off), and this rank's
        # part of each gathered buffer, kept from a forward until the optimizer step changes the weights.
        self.secondary: Communicator | None = None
        self.secondary_parts: list[torch.Tensor] = []

    @property
    def title(self) -> str:
        """The unit as messages name it: by its module's name, the root (named '') as the root unit."""
        return f"unit {self.name!r}" if self.name else "the root unit"

    def gather(self, purpose: str = "read") -> None:
        """Starts the all-gather of every flat buffer of the unit (asynchronously), for a "forward", a
        "backward" or a "read" (export, inspection). Under ZeRO++ a forward or backward gather goes
        quantized (qwZ), or inside the node from the secondary partition (hpZ) once a forward kept one; a read
        is always exact and from the primary shards."""
        if self.gathered:
            return
        self._tally(+1)
        for flat in self.flats:
            flat.allocate_storage()
        with issued_for(f"the {purpose} gather of {self.title}"):
            self._start_gather(purpose)
        for flat in self.flats:
            for s in flat.slices:
                set_data(s.param, flat.view_of(s))
        self.gathered, self.placeholders = True, False

    def _start_gather(self, purpose: str) -> None:
        if purpose != "read" and self.secondary_parts:
            self.works.append(self._gather_exact(self.secondary, self.secondary_parts))
        else:
            shards = [self._shard_on_device(i) for i in range(len(self.flats))]
            if purpose != "read" and self.quantize_block is not None:  # never with offload_param (config.py)
                self.works.append(self._gather_quantized(shards))
            else:
                # With the shards in host memory the gather follows their copies on the copy stream (stream order:
                # no wait), so that neither holds up the compute queued meanwhile (on one stream, PCIe time would
                # add to every step). The compute stream waits on the gather's handle (`wait`) before reading.
                with on_copy_stream(self.flats[0].data.device) if self.copies else contextlib.nullcontext():
                    self.works.append(self._gather_exact(self.comm, shards))

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
            self.copies.append(copy)
            if buffer is not None:
                self.reading.append((buffer, copy))
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
        size, index = self.secondary.world_size, self.secondary.rank
        for flat in self.flats:
            n = flat.padded_numel // size
            self.secondary_parts.append(flat.data[index * n:(index + 1) * n].clone())
        self.comm.ledger.hold("bytes of secondary partitions", self.nbytes // size)

    def drop_secondary(self) -> None:
        """The secondary partition goes when the weights change (the optimizer step, a checkpoint's load)."""
        if self.secondary_parts:
            self.wait()  # a gather may still read the parts
            self.secondary_parts.clear()
            self.comm.ledger.hold("bytes of secondary partitions", -(self.nbytes // self.secondary.world_size))

    def _gather_quantized(self, shards: list[torch.Tensor]) -> Any:
        """qwZ: each rank sends its chunk as int8 values with an fp32 scale per block (a quarter of fp32's
        bytes, half of bf16's); `wait` dequantizes every rank's part into the buffers."""
        outputs, inputs, world = [], [], self.comm.world_size
        for flat, shard in zip(self.flats, shards):
            packed = quantize(shard, 8, self.quantize_block)
            # Values and scales in one byte buffer per rank: one dtype in every call, as every backend takes it
            # (gloo's grouped all-gather of int8 and fp32 tensors together delivered garbage).
            sent = torch.cat([packed.values.view(torch.uint8), packed.scales.view(torch.uint8)])
            received = torch.empty(world * sent.numel(), dtype=torch.uint8, device=shard.device)
            outputs.append(received)
            inputs.append(sent)
            self.landing.append((flat, received, packed.values.numel()))
        return self.comm.all_gather_coalesced_(outputs, inputs, async_op=True)

    @torch.no_grad()
    def _dequantize_landed(self) -> None:
        for flat, received, values_numel in self.landing:
            each_rank = received.view(self.comm.world_size, -1)
            values = each_rank[:, :values_numel].view(torch.int8)
            scales = each_rank[:, values_numel:].contiguous().view(torch.float32)  # fp32 alignment: a small copy
            with torch.autograd._unsafe_preserve_version_counter(flat.data):
                dequantize_senders(values, scales, self.comm.world_size, 8, self.quantize_block,
                                   flat.buckets[0].chunk_numel, flat.data)
        self.landing.clear()

    def wait(self) -> None:
        """The stream the caller queues on (the compute stream) waits for the unit's gather: its buffers may be
        read there, and given back to the allocator, from then on."""
        for work in self.works:
            work.wait()
        self.works.clear()
        if self.landing:
            self._dequantize_landed()
        if self.reader is not None:  # a read buffer is refilled only after its copy to the device has landed
            for buffer, copy in self.reading:
                self.reader.release(buffer, copy)
        elif self.copies:
            self.shards_lent.add(self.copies[-1])
        self.reading.clear()
        self.copies.clear()

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
        self.gathered = True
        if not self.persistent:
            self._release_buffers()

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
        if self.placeholders:
            self._set_params(lambda s: self.empty)
            self.placeholders = False
        if self.persistent or not self.gathered:
            return
        self._tally(-1)
        self._release_buffers()

    def free_early(self) -> None:
        """Frees the buffers while gradients of the unit's parameters are still to come. Autograd checks each
        gradient against its parameter's shape when it arrives, so until then each parameter keeps its shape
        over a single NaN: no memory, and a stray read shows as NaN instead of passing for a weight."""
        if self.persistent or not self.gathered:
            return
        self.free()
        nan = torch.full((1,), float("nan"), dtype=self.empty.dtype, device=self.empty.device)
        self._set_params(lambda s: nan.expand(s.shape))
        self.placeholders = True

    def _set_params(self, data) -> None:
        for flat in self.flats:
            for s in flat.slices:
                set_data(s.param, data(s))

    def _release_buffers(self) -> None:
        self.wait()
        self._set_params(lambda s: self.empty)
        for flat in self.flats:
            flat.release_storage(f"the release of {self.title}'s gathered buffer")
        self.gathered = False
