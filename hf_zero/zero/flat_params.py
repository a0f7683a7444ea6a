"""Stages 0-2: every rank holds the whole parameters, in one flat buffer per param group.

`FlatParams` is the parameter holder of these stages (holder.py): the buffers, cut into buckets whose
chunk r rank r updates, the gradient reduction, and after the step the all-gather that gives every rank
the updated chunks, bucket by bucket in place.

The reduction: stages 0 and 1 keep the whole gradient (`ReplicatedGradients`, below). Each parameter's
`.grad` is a view into one flat gradient buffer per param group, so autograd accumulates micro-batches in
place (M_D: no per-parameter gradient tensors). Only the backward before the optimizer step reduces,
bucket by bucket as the buckets fill, overlapping the rest of that backward: stage 0 all-reduces (plain
data parallelism), stage 1 reduce-scatters in place, so this rank's chunk of the buffer ends up holding
the averaged gradient of the elements it updates. Stage 2 reduce-scatters every backward into a gradient
shard and keeps no whole gradient (stage2.py, which stage 3 shares).
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.memory import budget_of_every_rank
from hf_zero.runtime.trace import spanned
from hf_zero.settings.config import ZeroConfig
from hf_zero.zero.grad_landing import landing_for
from hf_zero.zero.holder import ParamHolder, fp32_start_empty
from hf_zero.zero.partition import (
    Bucket,
    FlatParamBuffer,
    ParamSlice,
    local,
    local_grad,
    wrap_like,
)
from hf_zero.zero.reducer import BucketKey, BucketReduction, GradientReducer
from hf_zero.zero.stage2 import PartitionedGradients

MOST_BUCKETS = 10_000  # buckets a memory budget may cut a param group into


class FlatParams(ParamHolder):
    """The parameters of stages 0-2, grouped by optimizer param group, in reverse model order (backward
    produces the last layers' gradients first, so buckets fill in turn)."""

    holds_whole_params = True

    def __init__(self, groups: list[list[tuple[str, nn.Parameter]]], stage: int, dtype: torch.dtype,
                 comm: Communicator, config: ZeroConfig, position: dict[nn.Parameter, int]) -> None:
        self.comm, self.replicated = comm, stage == 0
        self.reduces_every_backward = stage == 2
        # Bucket sizes left to the engine fit in the memory budget every rank agrees on (they cut the collectives):
        # in the dtype gradients are reduced in, the larger of the two.
        sized_by_memory = config.reduce_bucket_size is None or config.allgather_bucket_size is None
        device = next(p for named in groups for _, p in named).device
        budget = budget_of_every_rank(device, comm)[0] if sized_by_memory else 0
        # At least 1/MOST_BUCKETS of the parameters: a nearly full device (a model that will not fit) would leave a
        # budget of a few elements, and 175B parameters cut into billions of buckets hang before running out of memory.
        least = -(-sum(p.numel() for named in groups for _, p in named) // MOST_BUCKETS)
        budget_numel = max(least * 3, budget // max(dtype.itemsize, config.torch_reduce_dtype.itemsize))
        self.allgather_bucket_size = config.allgather_numel(budget_numel)
        # One flat buffer per param group that has parameters (the Trainer's no-decay group is empty under LoRA).
        self.flats = [FlatParamBuffer(list(reversed(named)), 1 if self.replicated else comm.world_size, dtype,
                                      config.bucket_numel(comm.world_size, budget_numel)) for named in groups if named]
        flat_of_group = iter(range(len(self.flats)))
        self.flat_of_group = [next(flat_of_group) if named else None for named in groups]
        fp32_empty = fp32_start_empty(config, self.flats[0].data.device)
        self.fp32_init = None if dtype == torch.float32 else self._per_group(
            lambda fi, b: self._read_fp32(self.flats[fi], b, fp32_empty))
        for flat in self.flats:
            flat.pack_and_bind()
        if stage == 2:
            self.grads = PartitionedGradients(self.flats, comm, config.overlap_comm, position,
                                              config.torch_reduce_dtype, landing=landing_for(config.offload_optimizer),
                                              double_buffered=config.delayed_param_update)
        else:
            self.grads = ReplicatedGradients(self.flats, comm, config.overlap_comm, position, config.torch_reduce_dtype,
                                             partitioned=stage == 1)
        self.param_chunks = self._per_group(lambda fi, b: self.flats[fi].owned_chunk(b, self.shard))

    def _per_group(self, each: Callable[[int, Bucket], Any]) -> list[list[Any]]:
        """each(flat index, bucket) for the buckets of each param group's flat buffer; none for an empty group."""
        return [[] if fi is None else [each(fi, b) for b in self.flats[fi].buckets] for fi in self.flat_of_group]

    @property
    def shard(self) -> int:
        return 0 if self.replicated else self.comm.rank

    def _read_fp32(self, flat: FlatParamBuffer, bucket: Bucket, empty: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of a bucket, in fp32 where `empty` allocates, read from the parameters before they are
        cast."""
        lo, hi = bucket.owned_range(self.shard)
        values = empty(hi - lo)
        flat.read_params(lo, hi, values)
        return values

    def chunk_keys(self) -> list[list[BucketKey]]:
        return self._per_group(lambda fi, b: (fi, b.index))

    @spanned("all_gather_parameters")
    def after_step(self) -> None:
        """All-gathers every bucket in place: buckets grouped into launches of up to allgather_bucket_size
        elements (at least one bucket each), at most allgather_bucket_size elements in flight."""
        if self.replicated:
            return
        in_flight: deque[tuple[Any, int]] = deque()
        numel_in_flight = 0
        for group in self._all_gather_groups():
            outputs = [flat.data[b.start:b.end] for flat, b in group]
            work = self.comm.all_gather_coalesced_(outputs, [flat.owned_chunk(b, self.shard) for flat, b in group],
                                                   async_op=True)
            numel = sum(b.numel for _, b in group)
            in_flight.append((work, numel))
            numel_in_flight += numel
            while numel_in_flight > self.allgather_bucket_size and len(in_flight) > 1:
                done, n = in_flight.popleft()
                done.wait()
                numel_in_flight -= n
        for work, _ in in_flight:
            work.wait()

    def _all_gather_groups(self) -> list[list[tuple[FlatParamBuffer, Bucket]]]:
        groups: list[list[tuple[FlatParamBuffer, Bucket]]] = [[]]
        numel = 0
        for flat in self.flats:
            for b in flat.buckets:
                if groups[-1] and numel + b.numel > self.allgather_bucket_size:
                    groups.append([])
                    numel = 0
                groups[-1].append((flat, b))
                numel += b.numel
        return groups

    @contextlib.contextmanager
    def gathered(self, only: Collection[int] | None = None) -> Iterator[None]:
        yield  # every rank holds every parameter whole

    def parts(self) -> Iterator[list[ParamSlice]]:
        yield list(self.slices())

    def gathered_one_at_a_time(self) -> Iterator[list[ParamSlice]]:
        yield from self.parts()

    def held_bytes(self) -> int:
        return sum(flat.data.numel() * flat.data.element_size() for flat in self.flats)

    def check_bound(self) -> None:
        moved = [name for flat in self.flats for name in flat.moved_params()]
        if moved:
            raise RuntimeError(
                f"parameters {moved[:3]}{' ...' if len(moved) > 3 else ''} no longer live in the engine's flat "
                f"buffers: model.to(...), model.half() or `param.data = ...` was called after hf_zero.initialize. "
                f"Move or cast the model before initialize; after it, the engine owns the parameters' storage")


class ReplicatedGradients(GradientReducer):
    """Stages 0-1: the whole gradient in one flat buffer per param group, reduced at the step's last backward.
    The buffer holds the parameters' dtype (it is their `.grad`), so micro-batches accumulate in it; with a
    wider `reduce_dtype` each bucket is reduced through a copy in that dtype."""

    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool,
                 position: dict[nn.Parameter, int], reduce_dtype: torch.dtype, partitioned: bool) -> None:
        super().__init__(flat_params, comm, overlap_comm, position)
        self.reduce_dtype = reduce_dtype
        self.partitioned = partitioned
        self.shard = comm.rank if partitioned else 0
        self.flat_grads = [torch.zeros_like(flat.data) for flat in flat_params]
        self.grad_views: dict[nn.Parameter, torch.Tensor] = {}
        for flat, flat_grad in zip(flat_params, self.flat_grads):
            for s in flat.slices:
                self.grad_views[s.param] = flat.view_of(s, flat_grad)
                s.param.grad = wrap_like(s.param, self.grad_views[s.param])

    def accumulate(self, param: nn.Parameter) -> None:
        view = self.grad_views[param]
        if local(param.grad).data_ptr() != view.data_ptr():
            # Someone replaced .grad (e.g. zero_grad(set_to_none=True)): fold it back into the buffer.
            view.add_(local_grad(param))
            param.grad = wrap_like(param, view)

    def reduce_bucket(self, key: BucketKey) -> BucketReduction:
        fi, bi = key
        bucket = self.flat_params[fi].buckets[bi]
        bucket_grad = self.flat_grads[fi][bucket.start:bucket.end]
        if self.partitioned:
            lo, hi = bucket.owned_range(self.shard)
            owned = slice(lo - bucket.start, hi - bucket.start)
        else:
            owned = slice(None)
        reduced = bucket_grad  # replaced by a copy in the wider reduce_dtype, made on the communication stream

        def launch():
            nonlocal reduced
            reduced = bucket_grad.to(self.reduce_dtype)  # bucket_grad itself when the dtypes agree
            reduced.div_(self.comm.world_size)  # average as DDP does; dividing first keeps fp16 in range
            if self.partitioned:
                return self.comm.reduce_scatter_(reduced[owned], reduced, async_op=True)
            return self.comm.all_reduce_(reduced, async_op=True)

        def land() -> None:
            if reduced is not bucket_grad:
                bucket_grad[owned].copy_(reduced[owned])

        return BucketReduction(launch, land)

    def owned_grad(self, fi: int, bi: int) -> torch.Tensor:
        flat = self.flat_params[fi]
        return flat.owned_chunk(flat.buckets[bi], self.shard, self.flat_grads[fi])

    def zero_grad(self) -> None:
        for g in self.flat_grads:
            g.zero_()
        for param, view in self.grad_views.items():
            param.grad = wrap_like(param, view)

    def held_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.flat_grads)
