"""Stage3Params, the stage-3 parameter holder: cuts the model into units, lays this rank's chunk of each into
one shard per param group, fills them from a built model or unit by unit while it is constructed
(construct.py, pretrained.py), and gathers everything for reading. Its hooks are in schedule.py and
shared_weights.py."""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Collection, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import LatestCopy, host_buffers_for_good, host_memory_empty
from hf_zero.runtime.memory import budget_of_every_rank
from hf_zero.settings.config import ZeroConfig
from hf_zero.zero.construct import leave_meta, refuse_unfilled, staged_on_host
from hf_zero.zero.grad_landing import landing_for
from hf_zero.zero.holder import ParamHolder, fp32_start_empty
from hf_zero.zero.partition import (
    FlatParamBuffer,
    ParamSlice,
    model_order,
    partitioned_frozen,
    release_storage,
)
from hf_zero.zero.reducer import StepPhase
from hf_zero.zero.stage3.discovery import (
    find_unit_modules,
    refuse_layer_drop,
    units_using_each_param,
)
from hf_zero.zero.stage3.gradients import Stage3Gradients
from hf_zero.zero.stage3.schedule import ExecutionOrder, Schedule
from hf_zero.zero.stage3.shared_weights import SharedWeights
from hf_zero.zero.stage3.unit import Unit
from hf_zero.zero.update_files import ShardReader, UpdateFiles
from hf_zero.zero.zeropp import QuantizedReduceScatter, consecutive_ranks

logger = logging.getLogger("hf_zero")
PERSISTENT = "<persistent>"  # the unit of parameters below param_persistence_threshold, gathered for good
# This rank's chunk of a flat buffer, and where its fp32 start values go in `fp32_init` (param group, chunk).
Chunk = tuple[torch.Tensor, "tuple[int, int] | None"]


class Stage3Params(Schedule, SharedWeights, ParamHolder):
    """The stage-3 parameter holder (holder.py): owns the units, their shards and the hooks that gather
    and free them around each use. Its gather is Unit.gather, its reduce Stage3Gradients, below."""

    replicated, reduces_every_backward, holds_whole_params = False, True, False

    def __init__(self, model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], dtype: torch.dtype,
                 comm: Communicator, config: ZeroConfig, init_from: Any = None,
                 device: torch.device | None = None) -> None:
        """`init_from` (hf_zero/zero/construct.py) fills a model built on meta, on `device`. With offload the
        parameter shards (offload_param) and gradient shards (offload_optimizer) live in host memory."""
        self.comm, self.prefetch_numel = comm, config.prefetch_bucket_size
        self.offload_param = config.offload_param
        self.reader: ShardReader | None = None
        self.reshard_root_after_forward = config.reshard_root_after_forward
        self.generation_max_live_parameters = config.generation_max_live_parameters
        # Inside units_kept_gathered (generate(), an evaluation loop): the elements the units kept gathered may still
        # take (None: outside), and those units.
        self.keep_budget: int | None = None
        self.kept_gathered: set[int] = set()
        self.keep_limit_said = False
        self.trim_host_heap = config.trim_host_heap
        self.units = self._cut_into_units(model, groups, dtype, config, device)
        self.flats = [f for u in self.units for f in u.trained_flats]
        self.chunks_lent = LatestCopy() if self.offload_param != "none" else None
        secondary = consecutive_ranks(comm, config.hpz_partition_size) if config.hpz_partition_size > 1 else None
        for unit in self.units:
            unit.shards_lent = self.chunks_lent
            # Persistent parameters are gathered once a step and kept: they stay exact.
            if not unit.persistent:
                unit.quantize_block = config.quantization_block_size if config.quantized_weights else None
                unit.secondary = secondary
        if init_from is not None:  # before anything (the gradient hooks) attaches to the parameters
            leave_meta((s.param for unit in self.units for flat in unit.flats for s in flat.slices), device)
        for s in (s for unit in self.units for flat in unit.flats for s in flat.slices
                  if not isinstance(s.param, DTensor)):
            s.param.hf_zero_numel = s.numel  # its size when gathered, for counts (a DTensor knows its own)
        chunk_of = self._allocate_shards(len(groups), dtype, config)
        if init_from is not None:
            self._fill_shards(model, init_from, chunk_of)
        else:
            self._shard_built_units(chunk_of)
        # After the parameters are bound to the units' buffers, which may give a DTensor a new wrapper of the
        # compute dtype (partition.set_data): the gradient hooks attach to the wrapper the model keeps.
        self.position = model_order(model)
        self.grads = Stage3Gradients(self.units, self.position, comm, config.overlap_comm,
                                     config.torch_reduce_dtype, landing=landing_for(config.offload_optimizer),
                                     double_buffered=config.delayed_param_update)
        if config.quantized_gradients and comm.world_size > comm.ranks_per_node:
            self.grads.reduce_scatter = QuantizedReduceScatter(comm, config.quantized_gradients_bits,
                                                               config.quantization_block_size)
        elif config.quantized_gradients and comm.rank == 0:
            # As DeepSpeed does: on one node qgZ would lose the precision and save no network bytes.
            logger.warning("quantized_gradients (ZeRO++ qgZ) is off: all %d ranks are on one node (ranks_per_node "
                           "%d), where its quantization would lose precision and save no inter-node bytes; the "
                           "gradients are reduced exactly by the plain reduce-scatter", comm.world_size,
                           comm.ranks_per_node)
        # The order units ran in, each forward's and each backward's, recorded again every pass; prefetch follows
        # the last pass's until the running pass leaves it.
        self.forward, self.backward = ExecutionOrder(), ExecutionOrder()
        self._install_hooks(model)

    def _cut_into_units(self, model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], dtype: torch.dtype,
                        config: ZeroConfig, device: torch.device | None) -> list[Unit]:
        """One unit per block module, one for the root (the rest), one for the persistent small parameters;
        each holds one flat buffer per param group it has parameters of, and one of its frozen weights (a LoRA
        base: partitioned too, as DeepSpeed's stage 3 does, and gathered with the unit, since its forward and its
        backward read them; no optimizer state and no gradient)."""
        group_of = {id(p): g for g, named in enumerate(groups) for _, p in named}
        refuse_layer_drop(model)
        unit_modules = find_unit_modules(model, config.unit_module_classes)
        users = units_using_each_param(model, [name for name, _ in unit_modules])
        members: dict[str, list[tuple[str, nn.Parameter]]] = {"": [], PERSISTENT: []}
        shared: dict[str, str] = {}
        for name, p in model.named_parameters():
            if id(p) in group_of or partitioned_frozen(p):
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
                by_group.setdefault(group_of.get(id(p)), []).append((n, p))  # None: frozen
            gs = sorted(g for g in by_group if g is not None) + [None] * (None in by_group)
            flats = [FlatParamBuffer(by_group[g], self.comm.world_size, dtype, device=device) for g in gs]
            if flats:
                units.append(Unit(uname, modules[uname], flats, gs, self.comm, persistent=uname == PERSISTENT))
        return units

    def _allocate_shards(self, num_groups: int, dtype: torch.dtype, config: ZeroConfig) -> dict[int, Chunk]:
        """This rank's chunk of every unit, laid into one contiguous shard per param group (M_D); the frozen
        weights' chunks in one more shard, in the compute dtype. In lower precision `fp32_init` gets a place per
        chunk for its fp32 start values (the masters' start), given memory as its unit is cut (`_cut`). Returns
        where each flat buffer's chunk goes."""
        rank, device = self.comm.rank, self.units[0].flats[0].data.device
        self._fp32_start_empty = fp32_start_empty(config, device)
        trained = [(flat, unit) for unit in self.units for flat in unit.trained_flats]  # in self.flats' order
        sizes = [0] * num_groups
        for flat, unit in trained:
            sizes[unit.group_of(flat)] += flat.buckets[0].chunk_numel
        self.param_shards = [self._new_param_shard(n, dtype, device) for n in sizes]
        frozen = [flat for unit in self.units for flat in unit.frozen_flats]
        self.frozen_shard = self._new_param_shard(sum(f.buckets[0].chunk_numel for f in frozen), dtype, device,
                                                  frozen=True)
        chunk_of: dict[int, Chunk] = {}
        chunk_id: dict[int, tuple[int, int]] = {}  # (param group, chunk) of each trained flat buffer
        at = 0
        for flat in frozen:
            lo, hi = flat.buckets[0].owned_range(rank)
            chunk_of[id(flat)] = (self.frozen_shard[at:at + hi - lo], None)
            at += hi - lo
        self.param_chunks: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        self.chunk_flats: list[list[int]] = [[] for _ in range(num_groups)]  # flat index of each chunk
        offsets = [0] * num_groups
        for fi, (flat, unit) in enumerate(trained):
            g = unit.group_of(flat)
            lo, hi = flat.buckets[0].owned_range(rank)
            chunk = self.param_shards[g][offsets[g]:offsets[g] + hi - lo]
            offsets[g] += hi - lo
            chunk_id[id(flat)] = (g, len(self.param_chunks[g]))
            self.param_chunks[g].append(chunk)
            self.chunk_flats[g].append(fi)
            chunk_of[id(flat)] = (chunk, None if dtype == torch.float32 else chunk_id[id(flat)])
        self.fp32_init = None if dtype == torch.float32 else [[None] * len(chunks) for chunks in self.param_chunks]
        for unit in self.units:
            for flat in unit.flats:
                unit.shards.append(chunk_of[id(flat)][0])
                unit.shard_ids.append(chunk_id.get(id(flat)))
        return chunk_of

    def _cut(self, unit: Unit, chunk_of: dict[int, Chunk]) -> None:
        """Copies this rank's chunk of each of the unit's flat buffers into its shard (and fp32 start)."""
        for flat in unit.flats:
            chunk, start = chunk_of[id(flat)]
            lo, hi = flat.buckets[0].owned_range(self.comm.rank)
            if start is None:
                flat.read_params(lo, hi, chunk)
                continue
            # Memory for the fp32 start values as each unit is cut, not for all at once: beside a model built
            # whole, the units not yet cut still hold theirs (4 bytes a parameter / Nd more at the peak).
            g, k = start
            fp32 = self.fp32_init[g][k] = self._fp32_start_empty(hi - lo)
            flat.read_params(lo, hi, fp32)
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
        closed: set[int] = set()

        def open_unit(unit: Unit) -> list[torch.Tensor]:
            staging.update({id(f): staged_on_host(f) for f in unit.flats})
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
            closed.add(id(unit))

        init_from.fill(model, self.units, open_unit, close_unit, self.comm.rank)
        refuse_unfilled(init_from, self.units, closed)

    def _new_param_shard(self, numel: int, dtype: torch.dtype, device: torch.device,
                         frozen: bool = False) -> torch.Tensor:
        """With offload_param nvme the frozen weights' shard stays in host memory: the optimizer writes the files
        the units read their trained chunks from, and it has no state for frozen weights."""
        if self.offload_param == "none":
            return torch.zeros(numel, dtype=dtype, device=device)
        if self.offload_param == "nvme" and not frozen:
            # Only staged until `read_shards_from` gives it back, and no device copy reads it after: pinned
            # memory could not be given back in place (a pinned storage cannot be resized).
            return host_memory_empty(numel, dtype, zeroed=True)
        return host_buffers_for_good([numel], dtype)[0].zero_()

    @property
    def shard(self) -> int:
        return self.comm.rank

    def chunk_keys(self) -> list[list[tuple[int, int]]]:
        return [[(fi, 0) for fi in flats] for flats in self.chunk_flats]

    def attach(self, backend: UpdateFiles) -> None:
        super().attach(backend)
        reader = backend.param_reader()
        if reader is not None:
            self.read_shards_from(reader)

    def read_shards_from(self, reader: ShardReader) -> None:
        """offload_param nvme: from now on units read their chunks from the files (the optimizer wrote
        them there), and the shards' host memory is given back. The optimizer and the units keep the chunks'
        tensors as placeholders; their storage is empty, so reading one fails loudly. Frozen chunks stay."""
        for unit in self.units:
            unit.reader = reader
        for shard in self.param_shards:
            release_storage(shard)
        self.param_shards = []
        self.reader = reader

    @contextlib.contextmanager
    def gathered(self, only: Collection[int] | None = None) -> Iterator[None]:
        """Every unit, or those holding the parameters `only` names, gathered for the duration (read-only use:
        inspection, tests, export)."""
        units = [unit for unit, slices in zip(self.units, self.parts())
                 if only is None or any(id(s.param) in only for s in slices)]
        for unit in units:
            unit.gather()
            if self.reader is not None:  # read buffers go back at once: the pool stays one unit deep
                unit.wait()
        for unit in units:
            unit.wait()
        try:
            yield
        finally:
            for unit in units:
                unit.free()

    def keeps_every_unit(self) -> bool:
        """Whether units_kept_gathered (generate(), an evaluation loop) keeps every unit, gathered on entry (they fit
        within keep_limit()): then no forward inside gathers, whatever the number of tokens each rank generates, and
        ranks need not step together (synced_gpus)."""
        if self.keep_budget is not None:  # inside: every unit was gathered on entry and kept where all fit
            return len(self.kept_gathered) == len(self._keepable())
        return sum(u.numel for u in self._keepable()) <= self.keep_limit()

    def _keepable(self) -> list[Unit]:
        return [u for u in self.units if not u.is_root and not u.persistent]

    def keep_limit(self) -> int:
        """The parameter elements units_kept_gathered may keep gathered: generation_max_live_parameters where set,
        else the memory budget every rank agrees on (memory.budget_of_every_rank: each kept unit is a gather fewer,
        so all must keep the same), and with offloaded parameters no more than a training step holds gathered
        besides the unit in use (the largest unit and prefetch_bucket_size): a model offloaded because it does not
        fit is never held whole. Said once in the log, with how many units that keeps."""
        keepable = self._keepable()
        if self.generation_max_live_parameters is not None:
            limit, why = self.generation_max_live_parameters, "generation_max_live_parameters"
        else:
            budget, why = budget_of_every_rank(self.units[0].flats[0].data.device, self.comm)
            limit = budget // max((u.nbytes // max(u.numel, 1) for u in keepable), default=1)
            training_holds = max((u.numel for u in keepable), default=0) + self.prefetch_numel
            if self.offload_param != "none" and training_holds < limit:
                limit, why = training_holds, (f"offload_param {self.offload_param}: what a training step holds "
                                              f"gathered, the largest unit and prefetch_bucket_size")
        if not self.keep_limit_said:
            self.keep_limit_said = True
            self._say_what_is_kept(keepable, limit, why)
        return limit

    @staticmethod
    def _say_what_is_kept(keepable: list[Unit], limit: int, why: str) -> None:
        kept, total = 0, 0
        for unit in keepable:  # as _keep_gathered fills the budget when the forwards use the units in model order
            if total + unit.numel <= limit:
                kept, total = kept + 1, total + unit.numel
        logger.info("stage 3 keeps %d of %d units gathered in generate() and evaluation loops (%s elements; budget %s "
                    "elements: %s)", kept, len(keepable), f"{total:,}", f"{limit:,}", why)

    def _free_all_but_root(self) -> None:
        """Frees every unit but the root, and but those kept gathered (units_kept_gathered)."""
        for unit in self.units:
            if not unit.is_root and id(unit) not in self.kept_gathered:
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
                unit.refresh()

    @property
    def in_backward(self) -> bool:
        """Between engine.backward's start and the end of its pass: forwards then are recomputations."""
        return self.grads.phase is StepPhase.BACKWARD

    def begin_backward(self, last_micro_batch: bool) -> None:
        super().begin_backward(last_micro_batch)
        self.backward.begin()

    def end_backward(self) -> None:
        super().end_backward()
        self.free_all()

    def reset(self) -> None:
        self.free_all()
        self.after_step()

    @functools.cached_property
    def frozen(self) -> dict[int, ParamSlice]:
        return {id(s.param): s for unit in self.units for flat in unit.frozen_flats for s in flat.slices}

    def frozen_chunks(self) -> list[tuple[FlatParamBuffer, int, int, torch.Tensor]]:
        return [(flat, *flat.buckets[0].owned_range(self.comm.rank), shard) for unit in self.units
                for flat, shard in zip(unit.frozen_flats, unit.shards[len(unit.trained_flats):])]

    def parts(self) -> Iterator[list[ParamSlice]]:
        for unit in self.units:
            yield [s for flat in unit.flats for s in flat.slices]

    def gathered_one_at_a_time(self) -> Iterator[list[ParamSlice]]:
        for unit, slices in zip(self.units, self.parts()):
            was_gathered = unit.gathered
            unit.gather()
            unit.wait()
            yield slices
            if not was_gathered:
                unit.free()

    def held_bytes(self) -> int:
        gathered = sum(f.padded_numel * f.data.element_size() for u in self.units if u.persistent for f in u.flats)
        pool = self.reader.pool_bytes() if self.reader is not None else 0
        shards = [*self.param_shards, self.frozen_shard]
        return gathered + pool + sum(s.numel() * s.element_size() for s in shards)
