"""The interface every stage's parameter holder gives the engine (FlatParams for stages 0-2,
Stage3Params for stage 3), so that the engine never asks which stage it runs.

A holder owns the model's trainable parameters: their flat buffers, this rank's chunks of them (what the
optimizer updates), the gradient reduction during backward and the all-gather after the step, each
stage's gather beside its reduce, as FSDP2's FSDPParamGroup keeps them.
"""
from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from typing import Callable, Collection, Iterator

import torch
from torch import nn

from hf_zero.runtime.device import LatestCopy, host_memory_empty
from hf_zero.settings.config import ZeroConfig
from hf_zero.zero.partition import FlatParamBuffer, ParamSlice
from hf_zero.zero.reducer import GradientReducer
from hf_zero.zero.update_files import UpdateFiles


def fp32_start_empty(config: ZeroConfig, compute: torch.device) -> Callable[[int], torch.Tensor]:
    """Allocates the fp32 start values of this rank's chunks (the masters' first values) next to the masters.
    With the optimizer offloaded that is host memory, so that `initialize` never holds fp32 states on the device,
    the memory ZeRO-Offload exists to save (4 bytes a parameter / Nd more)."""
    if config.offload_optimizer != "none":
        return host_memory_empty
    return lambda numel: torch.empty(numel, dtype=torch.float32, device=compute)


class ParamHolder(ABC):
    # Every flat buffer, in the order the gradient reducer's bucket keys (flat index, bucket) count them.
    flats: list[FlatParamBuffer]
    grads: GradientReducer
    # param_chunks[g][k]: the compute-dtype elements of chunk k of param group g that this rank updates.
    param_chunks: list[list[torch.Tensor]]
    # Stage 0: every rank holds and updates everything; nothing is partitioned.
    replicated: bool
    # Stages 0-1 keep whole gradients and reduce once per optimizer step; stages 2-3 reduce every backward.
    reduces_every_backward: bool
    # Stages 0-2: every rank holds every parameter whole, as trained; stage 3 gathers them on use.
    holds_whole_params: bool
    fp32_init: list[list[torch.Tensor]] | None
    # Copies to the device that still read param_chunks (stage 3, shards in host memory); None where none do.
    chunks_lent: LatestCopy | None = None

    def grad_chunks(self) -> list[list[torch.Tensor]]:
        """The reduced gradient of each param chunk, same layout."""
        return [[self.grads.owned_grad(fi, bi) for fi, bi in keys] for keys in self.chunk_keys()]

    @abstractmethod
    def chunk_keys(self) -> list[list[tuple[int, int]]]:
        """(flat buffer, bucket) of each param chunk, same layout."""

    def flats_by_group(self) -> list[list[FlatParamBuffer]]:
        """The flat buffers of each optimizer param group."""
        return [list({fi: self.flats[fi] for fi, _ in keys}.values()) for keys in self.chunk_keys()]

    def owned_ranges(self) -> list[list[tuple[FlatParamBuffer, int, int]]]:
        """For each param chunk, its flat buffer and the element range [lo, hi) of it, same layout."""
        return [[(self.flats[fi], *self.flats[fi].buckets[bi].owned_range(self.shard)) for fi, bi in keys]
                for keys in self.chunk_keys()]

    def chunk_ranges_of(self, params: set[nn.Parameter]) -> list[list[list[tuple[int, int]]]]:
        """For each param chunk, the element ranges [lo, hi) of it that hold `params`, same layout."""
        return [[[(p.range_lo, p.range_lo + p.param_hi - p.param_lo) for p in flat.pieces_between(lo, hi)
                  if p.slice.param in params] for flat, lo, hi in chunks] for chunks in self.owned_ranges()]

    @property
    @abstractmethod
    def shard(self) -> int:
        """Which chunk of every bucket this rank owns."""

    def take_fp32_init(self) -> list[list[torch.Tensor]] | None:
        """The fp32 start of each param chunk (mixed precision: the masters' initial values), handed over once."""
        fp32_init, self.fp32_init = self.fp32_init, None
        return fp32_init

    def slices(self) -> Iterator[ParamSlice]:
        return (s for flat in self.flats for s in flat.slices)

    @functools.cached_property
    def managed(self) -> dict[int, ParamSlice]:
        """The slice of every trained parameter the holder owns, by the parameter's id (the rest of the model,
        frozen parameters but those in `frozen`, and buffers, stays as it is on every rank)."""
        return {id(s.param): s for s in self.slices()}

    @functools.cached_property
    def frozen(self) -> dict[int, ParamSlice]:
        """The slice of every frozen parameter the holder partitions too, by the parameter's id (stage 3: a LoRA
        base); gathered with the trained ones, never stepped nor reduced."""
        return {}

    def frozen_chunks(self) -> list[tuple[FlatParamBuffer, int, int, torch.Tensor]]:
        """Each flat buffer of `frozen` weights, the element range [lo, hi) of it this rank holds, and the chunk
        holding them (for checkpoints)."""
        return []

    def begin_backward(self, last_micro_batch: bool) -> None:
        self.grads.begin(reduce=self.reduces_every_backward or last_micro_batch)

    def end_backward(self) -> None:
        self.grads.finish()

    @abstractmethod
    def after_step(self) -> None:
        """Shares the updated chunks with the other ranks (the all-gather that follows the update)."""

    @abstractmethod
    def gathered(self, only: Collection[int] | None = None) -> contextlib.AbstractContextManager:
        """Every parameter whole for the duration (read-only use: inspection, tests, export); with `only` (ids of
        parameters), at least those (stage 3: the units holding them)."""

    @contextlib.contextmanager
    def units_kept_gathered(self) -> Iterator[None]:
        """For a loop of forwards whose weights do not change (evaluation, generation): what a forward gathers stays
        gathered inside (stage 3); whole parameters need nothing."""
        yield

    def keeps_every_unit(self) -> bool:
        """Whether no forward inside units_kept_gathered gathers, whatever each rank's inputs make it use, so that
        ranks need not step together there (generate's synced_gpus): true of whole parameters."""
        return True

    @abstractmethod
    def parts(self) -> Iterator[list[ParamSlice]]:
        """The groups of slices gathered_one_at_a_time yields (stage 3: a unit's), without gathering them."""

    @abstractmethod
    def gathered_one_at_a_time(self) -> Iterator[list[ParamSlice]]:
        """The parameters, whole, a group of slices at a time (stage 3: a unit), freed after each."""

    @abstractmethod
    def held_bytes(self) -> int:
        """Parameter memory this rank holds between steps."""

    def check_bound(self) -> None:
        """Raises when the model's parameters no longer view the holder's buffers."""

    def attach(self, backend: UpdateFiles) -> None:
        """Called once the update backend exists: with NVMe states, the reduced gradients of stages 2-3 go to
        its files (and stage 3 reads its shards from there when the parameters live there too)."""
        files = backend.gradient_files()
        if files is not None:
            self.grads.write_to(files, self.chunk_keys())

    def reset(self) -> None:
        """After the masters were set from a checkpoint: free what is gathered and share the new values."""
        self.after_step()
