"""Stages 0 and 1: every rank keeps the whole gradient.

Each parameter's `.grad` is a view into one flat gradient buffer per param group, so autograd
accumulates micro-batches in place (M_D: no per-parameter gradient tensors). Only the backward
before the optimizer step reduces, bucket by bucket as the buckets fill, overlapping the rest of
that backward: stage 0 all-reduces (plain data parallelism), stage 1 reduce-scatters in place, so
this rank's chunk of the buffer ends up holding the averaged gradient of the elements it updates.
"""
from __future__ import annotations

import torch
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.zero.partition import FlatParamBuffer, local, local_grad, wrap_like
from hf_zero.zero.reducer import BucketKey, GradientReducer


class ReplicatedGradients(GradientReducer):
    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool,
                 partitioned: bool) -> None:
        super().__init__(flat_params, comm, overlap_comm)
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

    def reduce_bucket(self, key: BucketKey):
        fi, bi = key
        flat, bucket = self.flat_params[fi], self.flat_params[fi].buckets[bi]
        bucket_grad = self.flat_grads[fi][bucket.start:bucket.end]
        bucket_grad.div_(self.comm.world_size)  # average as DDP does; dividing first keeps fp16 in range
        if self.partitioned:
            owned = flat.owned_chunk(bucket, self.shard, self.flat_grads[fi])
            work = self.comm.reduce_scatter_(owned, bucket_grad, async_op=True)
        else:
            work = self.comm.all_reduce_(bucket_grad, async_op=True)
        return work, lambda: None

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
