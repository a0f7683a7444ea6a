"""Stage 3 (P_os+g+p): parameters partitioned.

Between uses each rank holds only its shard of every parameter. The model is cut into units (a
transformer block by default, plus the root for whatever lies outside the blocks); a unit's full
parameters are all-gathered just before its forward and again before its backward, and freed right
after each. While one unit computes, the next ones in execution order are gathered asynchronously:
always the next one, then more up to `prefetch_bucket_size` elements ahead. Parameters smaller than
`param_persistence_threshold` go to one persistent unit that stays gathered and is refreshed by one
all-gather after each step.

Freeing resizes the gathered buffer's storage to zero instead of dropping the tensor, so the views
of it that autograd saved for backward (e.g. a weight's transpose) see the re-gathered values,
and each parameter's `.data` is swapped to an empty tensor so that reading a freed parameter fails
loudly instead of returning stale or uninitialised memory.

ZeRO++ lives here too (settings in config.py, the node groups and qgZ's reduction in zeropp.py): a gather for
a forward or backward may go quantized (qwZ, `_gather_quantized`), and once a forward kept a secondary partition
every later one until the optimizer step comes from inside the node (hpZ, `keep_secondary`); qgZ replaces the
reducer's reduce-scatter (on more than one node).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves, tree_map

from hf_zero.comm import Communicator, rank as global_rank
from hf_zero.config import ZeroConfig
from hf_zero.device import Copy, LatestCopy, host_empty, host_memory_empty, on_copy_stream, to_device
from hf_zero.host_memory import HeapTrimmer
from hf_zero.ops.quantize import dequantize_senders, quantize
from hf_zero.zero.holder import ParamHolder, fp32_start_empty
from hf_zero.zero.partition import FlatParamBuffer, ParamSlice, model_order, release_storage, set_data, wrap_like
from hf_zero.zero.reducer import BucketKey
from hf_zero.zero.stage2 import PartitionedGradients
from hf_zero.zero.zeropp import QuantizedReduceScatter, consecutive_ranks

if TYPE_CHECKING:
    from hf_zero.offload.nvme import ParamReader

logger = logging.getLogger("hf_zero")
PERSISTENT = "<persistent>"  # the unit of parameters below param_persistence_threshold, gathered for good
Chunk = tuple[torch.Tensor, "torch.Tensor | None"]  # this rank's chunk of a flat buffer, and its fp32 start


class ExecutionOrder:
    """The units one pass (a forward, or a backward) visits, against the order of the last pass of its kind."""

    def __init__(self) -> None:
        self.expected: list[Unit] = []
        self.seen: list[Unit] = []
        self.on_track = True  # every unit so far came where `expected` has it

    def begin(self) -> None:
        """A new pass: the one before it (if it visited any unit) is what this one is expected to do."""
        if self.seen:
            self.expected, self.seen = self.seen, []
        self.on_track = True

    def visit(self, unit: Unit) -> Iterator[Unit]:
        """Records `unit` as the next to run (a unit visited twice in a row counts once: a recomputation
        following its backward's gather) and returns the units expected after it: none once the pass has left
        the expected order."""
        if self.seen and self.seen[-1] is unit:
            return iter(())
        position = len(self.seen)
        self.seen.append(unit)
        self.on_track = self.on_track and position < len(self.expected) and self.expected[position] is unit
        return (self.expected[i] for i in range(position + 1, len(self.expected) if self.on_track else 0))


class Unit:
    """The parameters of one module, one flat buffer per optimizer param group, gathered as one."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParamBuffer], groups: list[int],
                 comm: Communicator, persistent: bool = False) -> None:
        self.name, self.module, self.flats, self.groups = name, module, flats, groups
        self.comm, self.persistent = comm, persistent
        self.numel = sum(f.padded_numel for f in flats)
        self.nbytes = sum(f.padded_numel * f.data.element_size() for f in flats)  # gathered
        self.shards: list[torch.Tensor] = []  # this rank's chunk of each flat buffer (set by Stage3Params)
        self.shard_ids: list[tuple[int, int]] = []  # (param group, chunk) of each, in the optimizer's order
        self.reader: ParamReader | None = None  # offload_param nvme: the chunks are read from files
        self.reading: list[torch.Tensor] = []  # the reader's buffers lent until the all-gathers finish
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
        if purpose != "read" and self.secondary_parts:
            self.works.append(self._gather_exact(self.secondary, self.secondary_parts))
        else:
            shards = [self._shard_on_device(i) for i in range(len(self.flats))]
            if purpose != "read" and self.quantize_block is not None:  # never with offload_param (config.py)
                self.works.append(self._gather_quantized(shards))
            else:
                # With the shards in host memory the gather follows their copies on the copy stream, so that
                # neither holds up the compute queued meanwhile (on one stream, PCIe time would add to every step).
                with on_copy_stream(self.flats[0].data.device) if self.copies else contextlib.nullcontext():
                    for copy in self.copies:
                        copy.ready()
                    self.works.append(self._gather_exact(self.comm, shards))
        for flat in self.flats:
            for s in flat.slices:
                set_data(s.param, flat.view_of(s))
        self.gathered, self.placeholders = True, False

    def _shard_on_device(self, i: int) -> torch.Tensor:
        shard = self.shards[i] if self.reader is None else self._read(i)
        if self.shards_lent is not None:
            shard, copy = to_device(shard, self.flats[i].data.device, f"the host shard of unit {self.name!r}",
                                    overlap=True)
            self.copies.append(copy)
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

    def _read(self, i: int) -> torch.Tensor:
        chunk, buffer = self.reader.read(*self.shard_ids[i])
        self.reading.append(buffer)
        return chunk

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

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        if self.landing:
            self._dequantize_landed()
        if self.reader is not None:  # a read buffer is refilled only after its copy to the device has landed
            for buffer, copy in zip(self.reading, self.copies):
                self.reader.release(buffer, copy)
        elif self.copies:
            self.shards_lent.add(self.copies[-1])
        self.reading.clear()
        self.copies.clear()

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
            flat.release_storage()
        self.gathered = False


def find_unit_modules(model: nn.Module, class_names: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The outermost modules to gather as units: the classes `unit_module_classes` names (the user's word wins),
    else the model's `_no_split_modules` (transformers' block classes), else the children of its ModuleLists.
    Says once which it chose (rank 0's log). A class list that matches nothing is refused when it is the user's;
    a model's own falls back to the ModuleList children, with a warning, or is refused when there are none:
    one unit holding the whole model would keep every rank holding all of it, the memory stage 3 exists to
    save. A model with neither is one unit, with a warning."""
    present = lambda: sorted({type(m).__name__ for m in model.modules()})  # noqa: E731
    if class_names:
        units = _outermost(model, lambda m: type(m).__name__ in class_names)
        if not units:
            raise ValueError(f"unit_module_classes {class_names} match no module of the model; its module "
                             f"classes are {present()}")
        _say_units(model, units, f"unit_module_classes {class_names}")
        return units
    declared = list(getattr(model, "_no_split_modules", None) or [])
    if declared:
        units = _outermost(model, lambda m: type(m).__name__ in declared)
        if units:
            _say_units(model, units, "its _no_split_modules")
            return units
    in_lists = {id(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}
    units = _outermost(model, lambda m: id(m) in in_lists)
    if declared and not units:
        raise ValueError(f"stage 3 cannot cut {type(model).__name__} into blocks: its _no_split_modules {declared} "
                         f"match none of its modules and it holds no ModuleList. Name its block classes with "
                         f"unit_module_classes (--zero_unit_module_classes); its module classes are {present()}")
    if declared:
        _on_rank0(logging.WARNING, "%s's _no_split_modules %s match none of its modules: stage 3 gathers the "
                  "children of its ModuleLists one at a time instead; name the block classes with unit_module_classes "
                  "(--zero_unit_module_classes) to choose", type(model).__name__, declared)
    if not units:
        _on_rank0(logging.WARNING, "%s has no blocks stage 3 can gather one at a time (no _no_split_modules, no "
                  "ModuleList): it is one unit, and every rank holds all of it while it computes. Name its block "
                  "classes with unit_module_classes (--zero_unit_module_classes) to cut it", type(model).__name__)
    else:
        _say_units(model, units, "the children of its ModuleLists")
    return units


def refuse_layer_drop(model: nn.Module) -> None:
    """LayerDrop (BART's, Whisper's, wav2vec2's `*layerdrop` settings) skips whole layers at random, drawn on
    each rank: a layer one rank runs and another skips is a unit all-gathered on one rank only, whose collective
    would pair with another one (a hang, or wrong weights). Refused before any work, naming the setting."""
    config = getattr(model, "config", None)
    dropping = {name: value for name, value in vars(config).items()
                if name.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0} if config else {}
    if dropping:
        settings = ", ".join(f"{name}={value}" for name, value in sorted(dropping.items()))
        raise ValueError(f"ZeRO stage 3 cannot train {type(model).__name__} with LayerDrop ({settings}): each rank "
                         f"draws the layers it skips, and a layer gathered on some ranks only would leave the others "
                         f"waiting. Set {' and '.join(f'config.{name} = 0' for name in sorted(dropping))} before "
                         f"training, or use zero_stage 2 (--zero_stage 2), which trains with it")


def _outermost(model: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is not model and wanted(module) and not any(name.startswith(u + ".") for u, _ in units):
            units.append((name, module))
    return units


def _say_units(model: nn.Module, units: list[tuple[str, nn.Module]], chosen_by: str) -> None:
    classes = sorted({type(m).__name__ for _, m in units})
    _on_rank0(logging.INFO, "stage 3 cuts %s into %d units of %s (chosen by %s) and a root unit of the rest",
              type(model).__name__, len(units), ", ".join(classes), chosen_by)


def _on_rank0(level: int, message: str, *args: Any) -> None:
    """Logs once for the whole job: every rank cuts the same model the same way."""
    if global_rank() == 0:
        logger.log(level, message, *args)


def units_using_each_param(model: nn.Module, unit_names: list[str]) -> dict[int, set[str]]:
    """For each parameter, the units holding a module that holds it: a tied weight (BERT's decoder and word
    embeddings) or one module shared by two blocks has several. '' is the root: a module in no unit."""
    users: dict[int, set[str]] = {}
    units = set(unit_names)

    def visit(module: nn.Module, name: str, unit: str) -> None:  # every path to a module, shared ones too
        unit = name if name in units else unit
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(unit)
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{name}.{child_name}" if name else child_name, unit)

    visit(model, "", "")
    return users


class Stage3Params(ParamHolder):
    """The stage-3 parameter holder (holder.py): owns the units, their shards and the hooks that gather
    and free them around each use. Its gather is Unit.gather, its reduce Stage3Gradients, below."""

    replicated, reduces_every_backward = False, True

    def __init__(self, model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], dtype: torch.dtype,
                 comm: Communicator, config: ZeroConfig, init_from: Any = None,
                 device: torch.device | None = None) -> None:
        """`init_from` (hf_zero/construct.py) fills a model built on meta, on `device`. With offload the
        parameter shards (offload_param) and gradient shards (offload_optimizer) live in host memory."""
        self.comm, self.prefetch_numel = comm, config.prefetch_bucket_size
        self.offload_param = config.offload_param
        self.reader: ParamReader | None = None
        self.reshard_root_after_forward = config.reshard_root_after_forward
        self.trim_host_heap = config.trim_host_heap
        self.units = self._cut_into_units(model, groups, dtype, config, device)
        self.flats = [f for u in self.units for f in u.flats]
        self.chunks_lent = LatestCopy() if self.offload_param != "none" else None
        secondary = consecutive_ranks(comm, config.hpz_partition_size) if config.hpz_partition_size > 1 else None
        for unit in self.units:
            unit.shards_lent = self.chunks_lent
            # Persistent parameters are gathered once a step and kept: they stay exact.
            if not unit.persistent:
                unit.quantize_block = config.quantization_block_size if config.quantized_weights else None
                unit.secondary = secondary
        if init_from is not None:  # before anything (the gradient hooks) attaches to the parameters
            self._leave_meta(device)
        for s in (s for flat in self.flats for s in flat.slices if not isinstance(s.param, DTensor)):
            s.param.hf_zero_numel = s.numel  # its size when gathered, for counts (a DTensor knows its own)
        self.unit_of_flat = [u for u in self.units for _ in u.flats]
        self.position = model_order(model)
        self.grads = Stage3Gradients(self, comm, config.overlap_comm, config.torch_reduce_dtype,
                                     offloaded=config.offload_optimizer != "none")
        if config.quantized_gradients and comm.world_size > comm.ranks_per_node:
            self.grads.reduce_scatter = QuantizedReduceScatter(comm, config.quantized_gradients_bits,
                                                               config.quantization_block_size)
        elif config.quantized_gradients and comm.rank == 0:
            # As DeepSpeed does: on one node qgZ would lose the precision and save no network bytes.
            logger.warning("quantized_gradients (ZeRO++ qgZ) is off: all %d ranks are on one node (ranks_per_node "
                           "%d), where its quantization would lose precision and save no inter-node bytes; the "
                           "gradients are reduced exactly by the plain reduce-scatter", comm.world_size,
                           comm.ranks_per_node)
        chunk_of, fp32_chunks = self._allocate_shards(len(groups), dtype, config)
        if init_from is not None:
            self._fill_shards(model, init_from, chunk_of)
        else:
            self._shard_built_units(chunk_of)
        self.fp32_init = None if dtype == torch.float32 else fp32_chunks
        # The order units ran in, each forward's and each backward's, recorded again every pass; prefetch follows
        # the last pass's until the running pass leaves it.
        self.forward, self.backward = ExecutionOrder(), ExecutionOrder()
        self.in_backward = False  # between engine.backward's start and end: forwards then are recomputations
        self._install_hooks(model)

    def _cut_into_units(self, model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], dtype: torch.dtype,
                        config: ZeroConfig, device: torch.device | None) -> list[Unit]:
        """One unit per block module, one for the root (the rest), one for the persistent small parameters;
        each holds one flat buffer per param group it has parameters of."""
        group_of = {id(p): g for g, named in enumerate(groups) for _, p in named}
        refuse_layer_drop(model)
        unit_modules = find_unit_modules(model, config.unit_module_classes)
        users = units_using_each_param(model, [name for name, _ in unit_modules])
        members: dict[str, list[tuple[str, nn.Parameter]]] = {"": [], PERSISTENT: []}
        shared: dict[str, str] = {}
        for name, p in model.named_parameters():
            if id(p) in group_of:
                used_by = users[id(p)]
                if p.numel() < config.param_persistence_threshold:
                    key = PERSISTENT
                else:  # a weight several units use lives in their common ancestor: the root, gathered around them
                    key = next(iter(used_by)) if len(used_by) == 1 else ""
                if len(used_by) > 1:
                    shared[name] = (f"{'persistent' if key == PERSISTENT else 'root'} unit (used by "
                                    f"{', '.join(repr(u) if u else 'the root' for u in sorted(used_by))})")
                members.setdefault(key, []).append((name, p))
        self.comm.ledger.shared_weights = shared
        # The root is freed once backward has read back what the forward saved of it (_count_root_saves_in),
        # unless a block reads one of its weights (a layer shared by blocks, read again by a block's
        # recomputation in backward, where no saved tensor says so) or its parameters are DTensors (whose saved
        # tensors are wrappers without the storage to recognise).
        self.root_frees_early = bool(members[""]) and not any(
            unit != "" or isinstance(p, DTensor) for _, p in members[""] for unit in users[id(p)])
        modules = dict(unit_modules) | {"": model, PERSISTENT: model}
        units = []
        for uname, named in members.items():
            by_group: dict[int, list[tuple[str, nn.Parameter]]] = {}
            for n, p in named:
                by_group.setdefault(group_of[id(p)], []).append((n, p))
            gs = sorted(by_group)
            flats = [FlatParamBuffer(by_group[g], self.comm.world_size, dtype, device=device) for g in gs]
            if flats:
                units.append(Unit(uname, modules[uname], flats, gs, self.comm, persistent=uname == PERSISTENT))
        return units

    def _allocate_shards(self, num_groups: int, dtype: torch.dtype, config: ZeroConfig
                         ) -> tuple[dict[int, Chunk], list[list[torch.Tensor]]]:
        """This rank's chunk of every unit, laid into one contiguous shard per param group (M_D), and in
        lower precision a buffer per chunk for its fp32 start values (the masters' start). Returns where each
        flat buffer's chunk goes, and the fp32 buffers by param group."""
        rank, device = self.comm.rank, self.flats[0].data.device
        fp32_empty = fp32_start_empty(config, device)
        sizes = [0] * num_groups
        for flat, unit in zip(self.flats, self.unit_of_flat):
            sizes[unit.group_of(flat)] += flat.buckets[0].chunk_numel
        self.param_shards = [self._new_param_shard(n, dtype, device) for n in sizes]
        self.param_chunks: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        self.chunk_flats: list[list[int]] = [[] for _ in range(num_groups)]  # flat index of each chunk
        fp32_chunks: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        chunk_of: dict[int, Chunk] = {}
        offsets = [0] * num_groups
        for fi, (flat, unit) in enumerate(zip(self.flats, self.unit_of_flat)):
            g = unit.group_of(flat)
            lo, hi = flat.buckets[0].owned_range(rank)
            chunk = self.param_shards[g][offsets[g]:offsets[g] + hi - lo]
            offsets[g] += hi - lo
            fp32 = None if dtype == torch.float32 else fp32_empty(hi - lo)
            if fp32 is not None:
                fp32_chunks[g].append(fp32)
            unit.shard_ids.append((g, len(self.param_chunks[g])))
            self.param_chunks[g].append(chunk)
            self.chunk_flats[g].append(fi)
            unit.shards.append(chunk)
            chunk_of[id(flat)] = (chunk, fp32)
        return chunk_of, fp32_chunks

    def _cut(self, unit: Unit, chunk_of: dict[int, Chunk]) -> None:
        """Copies this rank's chunk of each of the unit's flat buffers into its shard (and fp32 start)."""
        for flat in unit.flats:
            chunk, fp32 = chunk_of[id(flat)]
            lo, hi = flat.buckets[0].owned_range(self.comm.rank)
            flat.read_params(lo, hi, chunk if fp32 is None else fp32)
            if fp32 is not None:
                chunk.copy_(fp32)

    def _shard_built_units(self, chunk_of: dict[int, Chunk]) -> None:
        """A model that has its values: each unit gives this rank its chunk, then frees its buffer."""
        for unit in self.units:
            self._cut(unit, chunk_of)
            unit.adopt_params()

    def _fill_shards(self, model: nn.Module, init_from: Any, chunk_of: dict[int, Chunk]) -> None:
        """A model without values yet: one unit at a time gets memory, is filled by `init_from` (in fp32),
        gives up its chunk and is freed, so no rank holds more than its shard and one unit."""
        staging: dict[int, torch.Tensor] = {}

        def open_unit(unit: Unit) -> list[torch.Tensor]:
            staging.update({id(f): self._stage(f) for f in unit.flats})
            return [staging[id(f)] for f in unit.flats]

        def close_unit(unit: Unit) -> None:
            self._cut(unit, chunk_of)
            for flat in unit.flats:
                staged = staging.pop(id(flat))
                if unit.persistent:  # stays gathered: its values move into its own compute-dtype buffer
                    flat.allocate_storage()
                    flat.data.copy_(staged)
                    flat.bind()
            unit.built()

        init_from.fill(model, self.units, open_unit, close_unit, self.comm.rank)

    def _new_param_shard(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.offload_param == "none":
            return torch.zeros(numel, dtype=dtype, device=device)
        if self.offload_param == "nvme":
            # Only staged until `read_shards_from` gives it back, and no device copy reads it after: pinned
            # memory could not be given back in place (a pinned storage cannot be resized).
            return host_memory_empty(numel, dtype, zeroed=True)
        return host_empty(numel, dtype).zero_()

    @property
    def shard(self) -> int:
        return self.comm.rank

    def chunk_keys(self) -> list[list[tuple[int, int]]]:
        return [[(fi, 0) for fi in flats] for flats in self.chunk_flats]

    def attach(self, backend: Any) -> None:
        super().attach(backend)
        reader = backend.param_reader()
        if reader is not None:
            self.read_shards_from(reader)

    def read_shards_from(self, reader: ParamReader) -> None:
        """offload_param nvme: from now on units read their chunks from the files (the optimizer wrote
        them there), and the shards' host memory is given back. The optimizer keeps the chunks' tensors as
        placeholders; their storage is empty, so reading one fails loudly."""
        for unit in self.units:
            unit.reader, unit.shards = reader, []
        for shard in self.param_shards:
            release_storage(shard)
        self.param_shards = []
        self.reader = reader

    def _leave_meta(self, device: torch.device) -> None:
        """Turns each meta parameter into an empty one on `device`, keeping the Parameter object (the
        optimizer and tied modules hold it): `.data =` cannot change a tensor's device type, nor the device a
        DTensor reports (it is fixed when the wrapper is made), so a DTensor becomes a new one of empty parts."""
        for flat in self.flats:
            for s in flat.slices:
                if s.param.is_meta:
                    empty = wrap_like(s.param, torch.empty(0, dtype=s.param.dtype, device=device))
                    torch.utils.swap_tensors(s.param, nn.Parameter(empty, s.param.requires_grad))

    @staticmethod
    def _stage(flat: FlatParamBuffer) -> torch.Tensor:
        """An fp32 host buffer the unit's parameters view while `init_from` fills them (init and checkpoints
        are fp32; filling a bf16 buffer directly would lose the masters' precision). In host memory, so that a
        seeded init draws from the CPU generator: the same values as a build on CPU, and the accelerator's
        generator left as it was."""
        buffer = host_memory_empty(flat.padded_numel, zeroed=True)
        for s in flat.slices:
            set_data(s.param, flat.view_of(s, buffer))
        return buffer

    # ---- hooks -------------------------------------------------------------------------------
    def _install_hooks(self, model: nn.Module) -> None:
        # First of the model's hooks: the root's gather (its unit's pre-forward hook) is the new pass's first visit.
        model.register_forward_pre_hook(lambda m, a: None if self.in_backward else self.forward.begin())
        self.root = next((u for u in self.units if u.is_root), None)
        self.root_saves_waiting = 0  # tensors of the root's buffers the forward saved and backward has not read
        self.tied_read: set[int] = set()  # tied root weights read by this forward (see _split_tied_uses)
        self.read_through: dict[tuple[int, str], nn.Parameter] = {}  # (module, name) reading through a split
        self.reading_rows: dict[int, _EmbeddingRows] = {}  # embedding modules in a forward reading rows
        self.trim_heap = HeapTrimmer() if self.trim_host_heap else None  # see host_memory.py
        if self.root is not None and self.root_frees_early:
            self._count_root_saves_in(model)
            self._split_tied_uses(model)
        for unit in self.units:
            if not unit.persistent:
                unit.module.register_forward_pre_hook(lambda m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs),
                                                      with_kwargs=True)
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
        # Units prefetched for a forward that then took another path are freed when the model returns.
        model.register_forward_hook(lambda m, a, out: self._free_all_but_root())
        if callable(getattr(model, "generate", None)):
            self._gather_root_around(model, "generate")

    def _count_root_saves_in(self, model: nn.Module) -> None:
        """The root (embeddings and head: in a language model, a vocabulary-sized tied weight) is used first in
        backward and, in GPT-2 and its kind, not again, yet it would stay gathered until its last gradient
        comes at the very end. So during the model's forward each tensor autograd saves is looked at; those
        that view the root's buffers are counted, and once backward has read all of them back the root is
        freed (free_early), at the next unit's backward gather. Reading one back after that gathers the
        root again first (its storage is refilled in place), so a model that does use it later gets its
        weights."""
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

        def enter(module: nn.Module, args: Any) -> None:
            if not self.in_backward:  # a new forward: the saves of one without a backward went with its graph
                self.root_saves_waiting = 0
                self.tied_read.clear()
                self.grads.rows_to_come.clear()
            context.__enter__()

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(lambda m, a, out: context.__exit__(None, None, None), always_call=True)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (self.root.gathered and tensor.layout == torch.strided and not isinstance(tensor, DTensor)
                and any(tensor.untyped_storage().data_ptr() == f.data.untyped_storage().data_ptr()
                        for f in self.root.flats)):
            self.root_saves_waiting += 1
            return _RootSaved(tensor)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _RootSaved):
            return saved
        if not self.root.gathered:  # freed early yet read again
            self._fetch(self.root, backward=True)
        self.root_saves_waiting -= 1
        return saved.tensor

    def _split_tied_uses(self, model: nn.Module) -> None:
        """A root weight that several modules hold (a language model's vocabulary embedding and its head) gets
        a gradient from each. Autograd sums a leaf's gradients before any hook sees them: the head's, the first
        of backward, waits through the whole backward and is then summed out of place with the embedding's,
        three vocabulary-sized tensors at the end. Instead, in a forward that backward follows, the first
        module to read the weight reads the parameter itself and each later one reads it through _TiedUse,
        whose backward hands that use's gradient to the reducer (PartitionedGradients.contribute): kept as it
        came while the root is gathered, moved into the parameter's bucket once the root is freed. Then the
        end of backward holds the bucket and the embedding's gradient, not three. No collective is added:
        the bucket goes out in its turn, which every rank shares. The parameter's own gradient (its .grad,
        and hooks on it) is then only its first use's, so a parameter with a hook registered on it is not
        split.

        When that first use is an embedding lookup (nn.Embedding, the first module of a language model), its
        backward would make one more dense vocabulary-sized gradient, zero outside the rows the batch's
        tokens picked, just to add it into the bucket. It reads the weight through _EmbeddingRows instead,
        whose backward gives only those rows (PartitionedGradients.take_rows), summed by torch's own
        embedding backward in the same order: the bucket gets the same values, and the end of backward
        holds the bucket and a few rows."""
        root_params = {id(s.param) for flat in self.root.flats for s in flat.slices}
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in root_params:
                    holders.setdefault(id(p), []).append((module, name))
        for slots in holders.values():
            if len(slots) > 1:
                for module, name in slots:
                    module.register_forward_pre_hook(lambda m, a, n=name: self._read_tied(m, n))
                    module.register_forward_hook(lambda m, a, out, n=name: self._end_tied_read(m, n),
                                                 always_call=True)

    def _read_tied(self, module: nn.Module, name: str) -> None:
        param = module._parameters[name]
        # A hook registered on the parameter (a mask on some rows) is to see its whole gradient: not split then.
        if self.in_backward or param._backward_hooks or not (torch.is_grad_enabled() and param.requires_grad):
            return
        if id(param) not in self.tied_read:
            self.tied_read.add(id(param))
            if isinstance(module, nn.Embedding) and name == "weight" and module.max_norm is None \
                    and not module.sparse:
                rows = _EmbeddingRows(param, self.grads)
                rows.__enter__()
                self.grads.rows_to_come.add(param)
                self.reading_rows[id(module)] = rows
            return
        self.read_through[(id(module), name)] = param
        # Not setattr: a module's parameter slot takes only a Parameter. The forward hook puts it back.
        module._parameters[name] = _TiedUse.apply(param, self.grads)

    def _end_tied_read(self, module: nn.Module, name: str) -> None:
        rows = self.reading_rows.pop(id(module), None)
        if rows is not None:
            rows.__exit__(None, None, None)
        param = self.read_through.pop((id(module), name), None)
        if param is not None:
            module._parameters[name] = param

    def _gather_root_around(self, model: nn.Module, method: str) -> None:
        """Runs model.<method> with the root unit gathered, as a forward would be. generate() calls parts
        of the model directly (an encoder-decoder's encoder), outside the root's forward hooks; FSDP2's
        register_fsdp_forward_method exists for the same reason."""
        root = next((u for u in self.units if u.is_root), None)
        if root is None:
            return
        original = getattr(model, method)

        @functools.wraps(original)
        def with_root_gathered(*args, **kwargs):
            self._fetch(root, backward=False)
            try:
                return original(*args, **kwargs)
            finally:
                self._free_all_but_root()
                root.free()

        setattr(model, method, with_root_gathered)

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # A forward inside backward is activation checkpointing recomputing the unit: its gradients come next,
        # so the units to prefetch are those that follow it in backward.
        self._fetch(unit, backward=self.in_backward)
        if unit.is_root or not torch.is_grad_enabled():
            return None
        # A recomputation inside backward whose forward already marked the unit's post-backward (non-reentrant
        # checkpointing, whose recomputed graph is never run backward) marks nothing; a reentrant one, whose
        # forward ran without autograd, marks it now.
        if self.in_backward and self.grads.post_backwards_to_come.get(id(unit), 0):
            return None
        inputs = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.requires_grad]
        if not inputs:  # nothing marks the end of its backward: reduced at the end of backward (finish)
            return None
        self.grads.post_backwards_to_come[id(unit)] = self.grads.post_backwards_to_come.get(id(unit), 0) + 1
        marked = iter(_PostBackward.apply(self.grads, unit, *inputs))
        return tree_map(lambda t: next(marked) if torch.is_tensor(t) and t.requires_grad else t, (args, kwargs))

    def _post_forward(self, unit: Unit, output) -> None:
        if self.in_backward:  # recomputed: its backward runs at once, and its reduction frees it (Stage3Gradients)
            return
        tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(tensors)
        if backward_follows:
            unit.keep_secondary()  # the root too: it stays gathered into this backward, not the next forward's
        if not (unit.is_root and backward_follows and not self.reshard_root_after_forward):
            unit.free()
        if backward_follows:
            register_multi_grad_hook(tensors, lambda grads, u=unit: self._fetch(u, backward=True), mode="any")

    def _fetch(self, unit: Unit, backward: bool) -> None:
        """Gathers `unit`, then starts gathering the units that ran after it in the last pass of the same kind,
        so that their all-gathers overlap this unit's compute: always the next one (a 7B block is larger than
        any sensible budget, and without it every all-gather would be exposed), then more up to
        `prefetch_bucket_size` elements in all. Once this pass has left the last one's order (a model whose
        order changes between steps), nothing more is prefetched in it: what was would be gathered for
        nothing, or too early and held. Every rank runs the same order, so every rank prefetches alike."""
        order, purpose = (self.backward, "backward") if backward else (self.forward, "forward")
        if backward and self.in_backward and self.trim_heap is not None:
            self.trim_heap()
        if backward and self.in_backward and unit is not self.root and self.root_frees_early \
                and self.root_saves_waiting <= 0:
            self.root.free_early()  # backward has read back all the forward saved of it
            self.grads.open_buckets()  # the tied head's gradient, kept until the root's weights went
        to_come = order.visit(unit)
        unit.gather(purpose)
        budget = self.prefetch_numel
        for i, next_unit in enumerate(to_come):
            if i > 0 and next_unit.numel > budget:
                break
            budget -= next_unit.numel
            next_unit.gather(purpose)
        unit.wait()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered for the duration (read-only use: inspection, tests, export)."""
        for unit in self.units:
            unit.gather()
            if self.reader is not None:  # read buffers go back at once: the pool stays one unit deep
                unit.wait()
        for unit in self.units:
            unit.wait()
        try:
            yield
        finally:
            self.free_all()

    def _free_all_but_root(self) -> None:
        for unit in self.units:
            if not unit.is_root:
                unit.free()

    def free_all(self) -> None:
        for unit in self.units:
            unit.free()

    def after_step(self) -> None:
        """Only the persistent parameters are replicated: refreshed from their updated shards. The rest are
        gathered on use: what is still gathered (the root, after a forward whose backward never came) and
        hpZ's secondary partitions hold the weights before the update, and go."""
        self.free_all()
        for unit in self.units:
            unit.drop_secondary()
        for unit in self.units:
            if unit.persistent:
                unit.gathered = False
                unit.gather()
                unit.wait()

    def begin_backward(self, last_micro_batch: bool) -> None:
        super().begin_backward(last_micro_batch)
        self.in_backward = True
        self.backward.begin()

    def end_backward(self) -> None:
        self.in_backward = False
        super().end_backward()
        self.free_all()

    def reset(self) -> None:
        self.free_all()
        self.after_step()

    def gathered_one_at_a_time(self) -> Iterator[list[ParamSlice]]:
        for unit in self.units:
            was_gathered = unit.gathered
            unit.gather()
            unit.wait()
            yield [s for flat in unit.flats for s in flat.slices]
            if not was_gathered:
                unit.free()

    def held_bytes(self) -> int:
        gathered = sum(f.padded_numel * f.data.element_size() for u in self.units if u.persistent for f in u.flats)
        pool = self.reader.pool_bytes() if self.reader is not None else 0
        return gathered + pool + sum(s.numel() * s.element_size() for s in self.param_shards)


class _PostBackward(torch.autograd.Function):
    """Applied to the inputs of a unit's forward that require grad, as they are (FSDP2's
    RegisterPostBackwardFunction): its backward runs once the unit's backward has given them their gradients,
    after the unit's parameters took theirs in (autograd runs a leaf's gradient accumulation before other work
    that is ready, and this node, made first in the unit's forward, after the rest of the unit's). That is the
    unit's post-backward (Stage3Gradients.post_backward), which every rank reaches whatever its forward used."""

    @staticmethod
    def forward(grads: Stage3Gradients, unit: Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.grads, ctx.unit = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.grads.post_backward(ctx.unit)
        return (None, None, *grads)


class _TiedUse(torch.autograd.Function):
    """A tied weight as one of its later uses in a forward reads it (Stage3Params._split_tied_uses): the same
    values, and in backward that use's gradient goes into the parameter's bucket instead of being summed with
    the others' first."""

    @staticmethod
    def forward(ctx: Any, param: nn.Parameter, grads: Stage3Gradients) -> torch.Tensor:
        ctx.param, ctx.grads = param, grads
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.grads.contribute(ctx.param, grad)
        return None, None


class _EmbeddingRows(TorchFunctionMode):
    """Entered around the forward of the embedding that reads a split tied weight first
    (Stage3Params._split_tied_uses): its lookup of that weight goes through _EmbeddingLookup."""

    def __init__(self, param: nn.Parameter, grads: Stage3Gradients) -> None:
        super().__init__()
        self.param, self.grads = param, grads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            call = dict(zip(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                             "sparse"), args)) | kwargs
            if call["weight"] is self.param and call.get("max_norm") is None and not call.get("sparse"):
                padding_idx = call.get("padding_idx")
                if padding_idx is None:
                    padding_idx = -1
                elif padding_idx < 0:
                    padding_idx += self.param.shape[0]
                # The weight goes in as a new leaf: autograd would otherwise hold the parameter's own
                # AccumulateGrad until this backward, the last, when the root is freed (a gradient another use
                # gave it directly would then come only there).
                return _EmbeddingLookup.apply(call["input"], self.param.detach().requires_grad_(), padding_idx,
                                              bool(call.get("scale_grad_by_freq")), self)
        return func(*args, **kwargs)


class _EmbeddingLookup(torch.autograd.Function):
    """torch.embedding whose backward hands the weight's gradient to the reducer as the rows the tokens
    picked (PartitionedGradients.take_rows). The rows are torch's own embedding backward with the tokens
    renumbered over the distinct ones: each row is summed in the same order as in the dense gradient."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool,
                reading: _EmbeddingRows) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.scale_grad_by_freq, ctx.reading = padding_idx, scale_grad_by_freq, reading
        return torch.embedding(weight, ids, padding_idx, scale_grad_by_freq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        (ids,) = ctx.saved_tensors
        rows, renumbered = torch.unique(ids, return_inverse=True)  # sorted: renumbering keeps the tokens' order
        padding = -1
        if ctx.padding_idx >= 0:
            at = int(torch.searchsorted(rows, ctx.padding_idx))
            padding = at if at < rows.numel() and int(rows[at]) == ctx.padding_idx else -1
        row_grads = torch.ops.aten.embedding_dense_backward(grad, renumbered, rows.numel(), padding,
                                                            ctx.scale_grad_by_freq)
        ctx.reading.grads.take_rows(ctx.reading.param, rows, row_grads)
        return None, None, None, None, None


class _RootSaved:
    """A tensor autograd saved that views the root unit's buffers (Stage3Params._pack)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


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
    several positions) has n post-backwards, and reduces at the last. Units without one (no forward input
    requires grad), the root and the persistent unit launch at the end of backward, in launch order."""

    def __init__(self, params: Stage3Params, comm: Communicator, overlap_comm: bool, reduce_dtype: torch.dtype,
                 offloaded: bool) -> None:
        super().__init__(params.flats, comm, overlap_comm, params.position, reduce_dtype, reuse_buffers=False,
                         offloaded=offloaded, max_in_flight=1)
        self.params = params
        self.unit_of_param = {s.param: unit for unit in params.units for flat in unit.flats for s in flat.slices}
        self.params_waiting: dict[int, int] = {}  # per unit: its parameters whose gradient has not come yet
        self.unit_keys = {id(u): [key for key in self.launch_order if params.unit_of_flat[key[0]] is u]
                          for u in params.units}
        # Per unit: its forwards since the last backward whose post-backward has not run yet (_PostBackward).
        self.post_backwards_to_come: dict[int, int] = {}

    def begin(self, reduce: bool) -> None:
        super().begin(reduce)
        self.params_waiting = {id(u): sum(len(f.slices) for f in u.flats) for u in self.params.units}

    def bucket_ready(self) -> None:
        """A complete bucket waits for its unit's post-backward."""

    def reduced_when(self, key: BucketKey) -> str:
        unit = self.params.unit_of_flat[key[0]]
        return f"at the end of the backward of unit {unit.name!r}"

    @torch.no_grad()
    def post_backward(self, unit: Unit) -> None:
        """The unit's backward is over on this rank: its buckets are reduced now, the same point among the
        collectives on every rank, with zeros for its parameters no gradient reached here."""
        to_come = self.post_backwards_to_come.pop(id(unit), 0) - 1
        if to_come > 0:  # a later use's backward is still to run
            self.post_backwards_to_come[id(unit)] = to_come
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
        self.post_backwards_to_come.clear()  # left by a forward whose backward never came

    def accumulate(self, param: nn.Parameter) -> None:
        unit = self.unit_of_param[param]
        self.params_waiting[id(unit)] -= 1
        if self.params_waiting[id(unit)] == 0:
            unit.free()
