"""A partitioned model's weights made whole on every rank: its fp32 masters gathered, the trained weights a part at a
time (stage 3: a unit), and the files save_pretrained writes, written as the parts arrive (export.py), so that no
rank holds more than its shard and one unit. Every rank of the model's data-parallel group must call each."""
from __future__ import annotations

import os
from typing import Iterator

import torch

from hf_zero.checkpoint import export
from hf_zero.checkpoint.layout import PartitionedModel
from hf_zero.zero.partition import ParamSlice


@torch.no_grad()
def gathered_masters(model: PartitionedModel) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master weights, whole, on every rank (with tensor parallelism: this rank's
    local parts)."""
    return masters_of(model, list(model.holder.slices()))


@torch.no_grad()
def masters_of(model: PartitionedModel, slices: list[ParamSlice]) -> dict[str, torch.Tensor]:
    """Each rank fills the elements of `slices` it owns (the others hold zeros), and one all-reduce per
    parameter makes them whole everywhere."""
    masters = {s.name: torch.zeros(s.numel) for s in slices}
    for g, chunks in enumerate(model.holder.owned_ranges()):
        for k, (flat, lo, hi) in enumerate(chunks):
            pieces = [piece for piece in flat.pieces_between(lo, hi) if piece.slice.name in masters]
            if not pieces:
                continue
            master, _ = model.backend.chunk_state(g, k)
            for piece in pieces:
                n = piece.param_hi - piece.param_lo
                masters[piece.slice.name][piece.param_lo:piece.param_hi] = \
                    master.detach()[piece.range_lo:piece.range_lo + n].float().cpu()
    for s in slices:
        values = masters[s.name]
        if not model.holder.replicated:  # each element is owned by one rank; the others hold zeros
            values = values.to(model.comm.device)
            model.comm.all_reduce_(values)
        masters[s.name] = values.cpu().view(s.shape)
    return masters


def weights_one_part_at_a_time(model: PartitionedModel, frozen: bool) -> Iterator[dict[str, torch.Tensor]]:
    """The trained parameters, whole, by slice name, a part at a time (stage 3: a unit), on every rank: in mixed
    precision their fp32 masters, as the stock Trainer's fp32 model under --bf16 holds them; else the parameters
    themselves (valid until the next part is gathered). With `frozen`, also the frozen weights the holder
    partitions (stage 3), as the model holds them."""
    holder, mixed = model.holder, model.mixed_precision
    managed = holder.managed
    frozen = frozen and bool(holder.frozen)
    for slices in holder.parts() if mixed and not frozen else holder.gathered_one_at_a_time():
        trained = [s for s in slices if id(s.param) in managed]
        weights = masters_of(model, trained) if mixed else {s.name: s.param.data for s in trained}
        if frozen:
            weights |= {s.name: s.param.data for s in slices if id(s.param) not in managed}
        yield weights


@torch.no_grad()
def trainable_weights(model: PartitionedModel) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole on every rank, a unit at a time: what a PEFT adapter saves (a few MB),
    never the whole model at once. In mixed precision these are the fp32 masters, as the stock Trainer saves
    its fp32 weights under --bf16; else the parameters themselves."""
    return {name: w.clone() for part in weights_one_part_at_a_time(model, frozen=False) for name, w in part.items()}


def save_weights(model: PartitionedModel, folder: str | os.PathLike, write: bool,
                 max_shard_size: int | str = export.SAVE_PRETRAINED_MAX_SHARD_SIZE) -> None:
    """The model's weights as save_pretrained writes them (model.safetensors, or shards and an index),
    gathered a part at a time (stage 3: a unit) and written as they arrive. The rank with `write` writes.
    In mixed precision the file holds fp32, as the stock Trainer's under --bf16 or --fp16 (its model stays
    fp32 under autocast): the trained parameters are their masters; frozen weights and floating buffers,
    which have none, are written from their compute-dtype values."""
    weights = export.weights_to_save(model.module)
    held = model.holder.managed | model.holder.frozen
    save_name = {id(t): name for name, t in weights.items()}
    mixed = model.mixed_precision

    def saved_dtype(t: torch.Tensor) -> torch.dtype:
        return torch.float32 if mixed and t.is_floating_point() else t.dtype

    planned = {name: export.meta_like(held[id(t)].shape if id(t) in held else t.shape, saved_dtype(t))
               for name, t in weights.items()}
    name_of_slice = {s.name: save_name[id(s.param)] for s in held.values() if id(s.param) in save_name}

    def arrivals() -> Iterator[dict[str, torch.Tensor]]:
        for part in weights_one_part_at_a_time(model, frozen=True):
            yield {name_of_slice[name]: w.to(saved_dtype(w)) for name, w in part.items() if name in name_of_slice}
        yield {name: t.to(saved_dtype(t)) for name, t in weights.items() if id(t) not in held}  # buffers, frozen

    error = export.write_as_they_arrive(folder, model.module, planned, arrivals(), write, max_shard_size)

    def raise_error() -> None:
        if error is not None:
            raise error

    model.comm.agree(raise_error, f"writing the weights to {folder}")
