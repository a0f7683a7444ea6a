"""Stage 2 (P_os+g): gradients partitioned.

No rank keeps a whole gradient. During every backward each parameter's gradient is copied into the
fixed-size buffer of its bucket (C_B) and dropped; when a bucket is full it is reduce-scattered in
place, asynchronously, while backward goes on, and this rank's chunk lands in its gradient shard, the one
preallocated buffer per param group that holds this rank's gradients across accumulation steps (M_D): on the device,
in pinned host memory or in NVMe files, as offload_optimizer says (grad_landing.py). Stage 3 reuses this path with
one bucket per unit (stage3/gradients.py).

The gradient norm is taken where the gradients are, as they land: each reduced chunk's fp64 sum of squares,
as accumulated so far, goes into its slot of one device vector on the communication stream (`square_sums`), so
the step reads one number (one host synchronisation) and never walks the shards again.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
from hf_zero.zero.grad_landing import DeviceShard, GradLanding, NvmeFiles
from hf_zero.zero.partition import FlatParamBuffer, Piece, local_grad
from hf_zero.zero.reducer import (
    MAX_IN_FLIGHT,
    BucketKey,
    BucketReduction,
    GradientReducer,
)
from hf_zero.zero.update_files import GradientFiles

EARLY_SHARE = 16  # a bucket takes memory once its pieces would fill 1/EARLY_SHARE of it (see write_piece)


class PartitionedGradients(GradientReducer):
    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool,
                 position: dict[nn.Parameter, int], reduce_dtype: torch.dtype, reuse_buffers: bool = True,
                 landing: type[GradLanding] = DeviceShard, double_buffered: bool = False,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """Buckets are reduced, and micro-batches accumulated into the gradient shards, in `reduce_dtype`.
        `landing`: where the reduced chunks land (grad_landing.landing_for(offload_optimizer)). `double_buffered` (a
        delayed update): two sets of shards, where the landing keeps them in host memory."""
        super().__init__(flat_params, comm, overlap_comm, position, max_in_flight)
        # Stage 2's buckets share one size, so reduced buffers are kept for the next bucket (M_D).
        # Stage 3's buckets are units of many sizes: keeping one of each (the root's is vocabulary
        # sized) would hold memory for good, so there the allocator gets them back.
        self.reuse_buffers = reuse_buffers
        self.shard = comm.rank
        # How a bucket's sum reaches its owners (ZeRO++ qgZ replaces it at stage 3): (output, input) -> work.
        self.reduce_scatter: Callable[[torch.Tensor, torch.Tensor], Any] = \
            lambda output, input: comm.reduce_scatter_(output, input, async_op=True)
        self.dtype = reduce_dtype
        # The gradient norm as the chunks land: the fp64 sum of squares of each chunk's gradient as accumulated
        # so far, one slot per chunk in chunk order, on the buckets' device, and how a chunk is measured into its
        # slot (measure_with).
        device = flat_params[0].data.device if flat_params else comm.device
        self.square_sums = torch.zeros(len(self.expected), dtype=torch.float64, device=device)
        self.measure: Callable[[BucketKey, torch.Tensor], None] | None = None
        self.bucket_buffers: dict[BucketKey, torch.Tensor] = {}
        self.early_pieces: dict[BucketKey, list[tuple[int, torch.Tensor]]] = {}  # (offset, gradient) before a buffer
        self.spare_buffers: dict[int, list[torch.Tensor]] = {}
        self.peak_buffer_bytes = 0
        self.landing = landing(flat_params, reduce_dtype, self._measured, self._recycle, double_buffered)

    @property
    def shard_sets(self) -> list[list[torch.Tensor]]:
        """The sets of gradient shards (two for a delayed update with the shards in host memory)."""
        return self.landing.shard_sets

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """The gradient shards the next backward lands in, one per flat buffer."""
        return self.landing.grad_shards

    def hand_over(self) -> bool:
        return self.landing.hand_over()

    def measure_with(self, chunk_keys: list[list[BucketKey]],
                     square_sum: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        """How each bucket's reduced chunk is measured for the gradient norm: `square_sum(g, k, values)`, the
        optimizer's (which knows tensor parallelism's replicas), for the chunk k of param group g that
        `chunk_keys[g][k]` names."""
        slots = [(key, g, k) for g, keys in enumerate(chunk_keys) for k, key in enumerate(keys)]
        chunk_of = {key: (slot, g, k) for slot, (key, g, k) in enumerate(slots)}

        def measure(key: BucketKey, values: torch.Tensor) -> None:
            slot, g, k = chunk_of[key]
            self.square_sums[slot].copy_(square_sum(g, k, values))

        self.measure = measure

    def measured_square_sum(self) -> torch.Tensor | None:
        """The fp64 sum of squares of the gradient shards as the last backward left them, summed over the chunks in
        chunk order, on the device (None with NVMe states, whose files keep their own, and before `measure_with`)."""
        if not self.landing.measured_as_landed or self.measure is None:
            return None
        return self.square_sums.sum()

    def _measured(self, key: BucketKey, values: torch.Tensor) -> None:
        """Bucket `key`'s reduced chunk, as accumulated so far, measured into its slot of `square_sums`."""
        if self.measure is not None:
            self.measure(key, values)

    def write_to(self, grad_files: GradientFiles, chunk_keys: list[list[BucketKey]]) -> None:
        """From now on the reduced chunks go to `grad_files` (NVMe states); `chunk_keys[g][k]`: the bucket of its
        chunk k of param group g. The grad shards never take memory."""
        assert isinstance(self.landing, NvmeFiles), "only gradients landing in NVMe files are written to them"
        self.landing.write_to(grad_files, chunk_keys)

    def allocate(self) -> None:
        self.landing.allocate()

    def begin(self, reduce: bool) -> None:
        self.early_pieces.clear()  # left by a backward that raised
        self.square_sums.zero_()  # every chunk is measured again as this backward lands it
        super().begin(reduce)

    def _buffer(self, key: BucketKey) -> torch.Tensor:
        buf = self.bucket_buffers.get(key)
        if buf is None:
            numel = self.flat_params[key[0]].buckets[key[1]].numel
            spares = self.spare_buffers.get(numel)
            if spares:
                buf = spares.pop().zero_()
            else:
                buf = torch.zeros(numel, dtype=self.dtype, device=self.flat_params[key[0]].data.device)
                self.comm.ledger.hold("bytes of gradient buckets", buf.numel() * buf.element_size())
            for lo, grad in self.early_pieces.pop(key, []):
                buf[lo:lo + grad.numel()].add_(grad)
            self.bucket_buffers[key] = buf
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes())
        return buf

    def buffer_bytes(self) -> int:
        live = list(self.bucket_buffers.values()) + [b for v in self.spare_buffers.values() for b in v]
        return sum(b.numel() * b.element_size() for b in live)

    def write_piece(self, key: BucketKey, piece: Piece, param: nn.Parameter) -> None:
        self._add_to_bucket(key, piece, local_grad(param))

    def _add_to_bucket(self, key: BucketKey, piece: Piece, grad: torch.Tensor) -> None:
        """Adds `piece` of a parameter's gradient `grad` into its bucket."""
        grad = grad.reshape(-1)
        if piece.param_hi - piece.param_lo < grad.numel():  # the parameter spans buckets
            grad = grad[piece.param_lo:piece.param_hi]
        n = grad.numel()
        if key not in self.bucket_buffers:
            # A bucket's first small pieces are kept aside until its pieces would fill 1/EARLY_SHARE of it: a
            # stage-3 root whose final norm's gradient comes first and its tied embedding's last would
            # otherwise hold its whole bucket through backward.
            early = self.early_pieces.setdefault(key, [])
            numel = self.flat_params[key[0]].buckets[key[1]].numel
            if n + sum(g.numel() for _, g in early) <= numel // EARLY_SHARE:
                early.append((piece.range_lo, grad.to(self.dtype, copy=True)))
                return
        self._buffer(key)[piece.range_lo:piece.range_lo + n].add_(grad)

    def release(self, param: nn.Parameter) -> None:
        param.grad = None

    def reduce_bucket(self, key: BucketKey) -> BucketReduction:
        buf = self._buffer(key)
        del self.bucket_buffers[key]
        bucket = self.flat_params[key[0]].buckets[key[1]]
        owned = buf[self.shard * bucket.chunk_numel:(self.shard + 1) * bucket.chunk_numel]

        def launch():
            buf.div_(self.comm.world_size)  # average as DDP does; dividing first keeps fp16 in range
            return self.reduce_scatter(owned, buf)

        return self.landing.reduction(key, owned, buf, launch)

    def _recycle(self, buf: torch.Tensor) -> None:
        if self.reuse_buffers:
            self.spare_buffers.setdefault(buf.numel(), []).append(buf)
        else:
            self.comm.ledger.hold("bytes of gradient buckets", -buf.numel() * buf.element_size())

    @torch.no_grad()
    def finish(self) -> None:
        super().finish()
        self.landing.finish()

    def owned_grad(self, fi: int, bi: int) -> torch.Tensor:
        return self.landing.owned_grads[(fi, bi)]

    def zero_grad(self) -> None:
        self.square_sums.zero_()
        self.landing.zero_grad()

    def held_bytes(self) -> int:
        return self.landing.held_bytes()
