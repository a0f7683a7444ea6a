"""What a checkpoint knows of how an engine partitions its model (`ShardLayout`), and the parts of an engine
it reads that from (`PartitionedModel`).

Tensors are addressed by parameter name and element offset, never by flat-buffer position: the layout lists, for
each of this rank's chunks, the pieces of parameters it holds under the names they are stored by. With tensor
parallelism a parameter split across the tp group is stored as one tensor per tp rank (`<name>@tp<r>`, the local
part); parameters every tp rank holds whole are written by tp rank 0 alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hf_zero.checkpoint.export import weights_to_save
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.dtypes import SAFETENSORS_DTYPES
from hf_zero.runtime.tensor_parallel import split_of
from hf_zero.settings.config import DTYPES
from hf_zero.zero.partition import FlatParamBuffer, ParamSlice, is_tp_replicated, partitioned_frozen

if TYPE_CHECKING:
    from hf_zero.optim.update import UpdateBackend
    from hf_zero.zero.holder import ParamHolder


@dataclass(frozen=True)
class PartitionedModel:
    """The parts of a ZeRO engine that checkpoints and weight exports read: the model, the stage's parameter
    holder, the update backend holding this rank's masters and optimizer states, and the ranks they agree over.
    The engine builds it; nothing here knows the engine."""

    module: nn.Module
    holder: ParamHolder
    backend: UpdateBackend
    comm: Communicator               # the data-parallel group, over which the holder partitions the model
    world_comm: Communicator         # every rank holding part of the model's state: comm, times tp with a mesh
    tp_comm: Communicator | None
    zero_stage: int
    dtype: str                       # the compute dtype's name, as the settings give it ("fp32", "bf16", "fp16")

    @property
    def mixed_precision(self) -> bool:
        """Whether the parameters compute in another dtype than their fp32 masters."""
        return DTYPES[self.dtype] != torch.float32


@dataclass(frozen=True)
class StoredPiece:
    """The part of one parameter inside one of this rank's chunks, under the name it is stored by."""

    name: str       # the parameter's name, or for a part split across the tp group, `<name>@tp<r>`
    param_lo: int   # first element of the piece within the (local part of the) parameter
    param_hi: int
    chunk_lo: int   # where the piece starts within the chunk
    written: bool   # whether this rank stores it (a piece every tp rank holds is stored by tp rank 0 alone)


@dataclass(frozen=True)
class FrozenPiece:
    """Elements [lo, hi) of a frozen weight as this rank holds them (stage 3: inside its chunk of a unit's frozen
    weights; stages 0-2: the whole weight), viewed where the engine keeps them."""

    name: str
    lo: int
    hi: int
    values: torch.Tensor
    written: bool   # whether this rank stores it (at stages 0-2, where every rank holds it whole, rank 0 alone)


@dataclass(frozen=True)
class ShardLayout:
    """What a checkpoint needs to know of how an engine partitions its model, and nothing of the engine:
    the engine's parts are described by `layout_of`, and saving and loading work from this."""

    zero_stage: int
    dtype: str
    chunk_numels: list[list[int]]              # [group][chunk]: this rank's chunks, in the optimizer's order
    pieces: list[list[list[StoredPiece]]]      # [group][chunk]: the parameter pieces in each
    writes_states: bool                        # False where another rank writes the same states (stage 0)
    parameters: dict[str, dict[str, Any]]      # stored name -> shape and param group, every tp rank's
    tensor_parallel: dict[str, Any]            # tp size, and how each split parameter's parts make it whole
    weights: list[list[str]]                   # [name save_pretrained writes, key of the stored tensor]
    module_state: dict[str, torch.Tensor]      # buffers and frozen tp parts, replicated on every rank
    frozen: dict[str, dict[str, Any]]          # frozen weight -> shape and dtype
    frozen_pieces: list[FrozenPiece]           # what this rank holds of them


def tp_part_name(name: str, tp_rank: int) -> str:
    return f"{name}@tp{tp_rank}"


def layout_of(model: PartitionedModel) -> ShardLayout:
    """How `model` is partitioned, for checkpoints (with tensor parallelism every rank must call it)."""
    holder = model.holder
    return describe_layout(model.module, holder.flats_by_group(), holder.owned_ranges(), holder.frozen_chunks(),
                           model.zero_stage, model.dtype, model.world_comm.rank, model.tp_comm)


def describe_layout(module: nn.Module, flats_by_group: list[list[FlatParamBuffer]],
                    owned_ranges: list[list[tuple[FlatParamBuffer, int, int]]],
                    frozen_chunks: list[tuple[FlatParamBuffer, int, int, torch.Tensor]], zero_stage: int, dtype: str,
                    rank: int, tp_comm: Communicator | None) -> ShardLayout:
    """The layout of an engine's partition. `frozen_chunks`: the flat buffers of frozen weights the engine
    partitions (stage 3), each with the element range [lo, hi) this rank holds and the chunk holding it. With
    tensor parallelism every rank must call it (the parameter table holds every tp rank's parts, gathered over
    the tp group)."""
    def stored_name(s: ParamSlice) -> str:
        return s.name if tp_comm is None or is_tp_replicated(s.param) else tp_part_name(s.name, tp_comm.rank)

    slices = [(g, s) for g, flats in enumerate(flats_by_group) for flat in flats for s in flat.slices]
    pieces = [[[StoredPiece(stored_name(p.slice), p.param_lo, p.param_hi, p.range_lo,
                            tp_comm is None or tp_comm.rank == 0 or not is_tp_replicated(p.slice.param))
                for p in flat.pieces_between(lo, hi)] for flat, lo, hi in chunks] for chunks in owned_ranges]
    parameters = {stored_name(s): {"shape": list(s.shape), "group": g} for g, s in slices}
    tensor_parallel: dict[str, Any] = {"size": 1, "split": {}}
    if tp_comm is not None:
        parameters = {name: entry for part in tp_comm.all_gather_object(parameters) for name, entry in part.items()}
        tensor_parallel = {"size": tp_comm.world_size,
                           "split": {s.name: split_of(s.param) for _, s in slices if not is_tp_replicated(s.param)}}
    frozen_pieces = [FrozenPiece(p.slice.name, p.param_lo, p.param_hi,
                                 chunk[p.range_lo:p.range_lo + p.param_hi - p.param_lo], True)
                     for flat, lo, hi, chunk in frozen_chunks for p in flat.pieces_between(lo, hi)]
    frozen_slices = {id(s.param): s for flat, *_ in frozen_chunks for s in flat.slices}
    frozen = {s.name: {"shape": list(s.shape), "dtype": SAFETENSORS_DTYPES[s.param.dtype]}
              for s in frozen_slices.values()}
    stored_as = {id(s.param): f"master/{s.name}" for _, s in slices} | {i: f"frozen/{s.name}"
                                                                         for i, s in frozen_slices.items()}
    for name, p in module.named_parameters():
        if partitioned_frozen(p) and id(p) not in frozen_slices:  # held whole on every rank (stages 0-2)
            frozen[name] = {"shape": list(p.shape), "dtype": SAFETENSORS_DTYPES[p.dtype]}
            frozen_pieces.append(FrozenPiece(name, 0, p.numel(), p.data.view(-1), rank == 0))
            stored_as[id(p)] = f"frozen/{name}"
    weights = [[name, stored_as.get(id(t), f"module/{name}")] for name, t in weights_to_save(module).items()]
    module_state = {name: t for name, t in module.state_dict(keep_vars=True).items() if id(t) not in stored_as}
    return ShardLayout(zero_stage, dtype, [[hi - lo for _, lo, hi in chunks] for chunks in owned_ranges], pieces,
                       zero_stage >= 1 or rank == 0, parameters, tensor_parallel, weights, module_state, frozen,
                       frozen_pieces)
