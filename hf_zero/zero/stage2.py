"""Stage 2 (P_os+g): gradients partitioned.

No rank keeps a whole gradient. During every backward each parameter's gradient is copied into the
fixed-size buffer of its bucket (C_B) and dropped; when a bucket is full it is reduce-scattered in
place, asynchronously, while backward goes on, and this rank's chunk is added into `grad_shards`,
the one preallocated buffer per param group that holds this rank's gradients across accumulation
steps (M_D). Stage 3 reuses this path with one bucket per unit.

The gradient norm is taken where the gradients are, as they settle: each reduced chunk's fp64 sum of squares,
as accumulated so far, goes into its slot of one device vector on the communication stream (`square_sums`), so
the step reads one number (one host synchronisation) and never walks the shards again.

On the device, the grad shards take memory only from the moment their first reduced chunk lands until the step has
used them (`zero_grad` gives it back, as torch's set_to_none does): a model built shard by shard at
stage 3 does not pay for its gradients while it is constructed or evaluated, and during a forward and
most of a backward a rank holds only the shards of the units backward has reached. At stage 3 that
is what leaves room for the root's backward, the first to come, where the gathered vocabulary weight
and its whole gradient meet.

With the optimizer in host memory (offload_optimizer cpu) the grad shards are pinned host memory, kept for good
as DeepSpeed keeps its pinned gradient buffer: each reduced chunk goes straight into its place by an
asynchronous copy on the communication stream, and the host waits once, at the step (`allocate`). A chunk that
already holds this window's earlier micro-batches comes to the device, is added there, and goes back: no host
pass per micro-batch, no zero fill per step. With a delayed update the shards are double: the update of step i
reads one set on the host while the backward of step i+1 lands in the other.

With the optimizer states on NVMe the shards take no memory at all: each landed chunk is added into the NVMe
files (`write_to`) by an I/O thread while backward goes on, one write in flight.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import (
    LatestCopy,
    copy_to_host,
    host_buffers_for_good,
    host_memory_empty,
    to_device,
    to_host,
)
from hf_zero.zero.partition import (
    FlatParamBuffer,
    Piece,
    allocate_storage,
    local_grad,
    release_storage,
)
from hf_zero.zero.reducer import (
    MAX_IN_FLIGHT,
    BucketKey,
    BucketReduction,
    GradientReducer,
)

if TYPE_CHECKING:
    from hf_zero.optim.nvme import NvmeAdamStates


EARLY_SHARE = 16  # a bucket takes memory once its pieces would fill 1/EARLY_SHARE of it (see write_piece)


class PartitionedGradients(GradientReducer):
    def __init__(self, flat_params: list[FlatParamBuffer], comm: Communicator, overlap_comm: bool,
                 position: dict[nn.Parameter, int], reduce_dtype: torch.dtype, reuse_buffers: bool = True,
                 offload: str = "none", double_buffered: bool = False, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        """Buckets are reduced, and micro-batches accumulated into the gradient shards, in `reduce_dtype`.
        `offload` (offload_optimizer): "cpu" keeps the gradient shards in pinned host memory, next to the optimizer;
        "nvme" sends them to its files. `double_buffered` (a delayed update, offload cpu): two sets of shards."""
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
        self.offload = offload
        self.landing: tuple | None = None  # offload nvme: the last reduced chunk on its way to the host
        # offload cpu: the copies of reduced chunks into the pinned shards, and the chunks written since the step
        # last took the shards (a chunk not among them holds an older window's values).
        self.landings = LatestCopy()
        self.landed: set[BucketKey] = set()
        # Optimizer states on NVMe: where landed chunks go instead of grad_shards (NvmeAdamStates), the
        # (param group, chunk) of each bucket there, and the write in flight with the bucket it reads.
        self.grad_files: NvmeAdamStates | None = None
        self.file_chunk: dict[BucketKey, tuple[int, int]] = {}
        self.writing: tuple[Future, torch.Tensor | None] | None = None
        # The gradient norm as the chunks settle: the fp64 sum of squares of each chunk's gradient as accumulated
        # so far, one slot per chunk in chunk order, on the buckets' device, and how a chunk is measured into its
        # slot (measure_with).
        device = flat_params[0].data.device if flat_params else comm.device
        self.square_sums = torch.zeros(len(self.expected), dtype=torch.float64, device=device)
        self.measure: Callable[[BucketKey, torch.Tensor], None] | None = None
        self.shard_sets = [self._new_grad_shards() for _ in range(2 if double_buffered and offload == "cpu" else 1)]
        self._use_grad_shards(0)
        if offload != "cpu":
            # torch.empty touched no pages; the views, taken before the storage is released, keep the storage
            # object, so they see it once allocated.
            for shard in self.grad_shards:
                release_storage(shard)
        self.bucket_buffers: dict[BucketKey, torch.Tensor] = {}
        self.early_pieces: dict[BucketKey, list[tuple[int, torch.Tensor]]] = {}  # (offset, gradient) before a buffer
        self.kept_contributions: set[BucketKey] = set()  # buckets whose early pieces hold a tied use's gradient
        # Tied weights whose first use in this forward gives its gradient as rows (take_rows), at the end of
        # backward: a gradient from any other use before that is one more contribution.
        self.rows_to_come: set[nn.Parameter] = set()
        self.spare_buffers: dict[int, list[torch.Tensor]] = {}
        self.peak_buffer_bytes = 0

    def _new_grad_shards(self) -> list[torch.Tensor]:
        """One gradient shard per flat buffer: pinned host memory for good with offload cpu, else where the
        buckets are (released at once: it takes memory when its first chunk lands, `_grad_shard`)."""
        numels = [sum(b.chunk_numel for b in flat.buckets) for flat in self.flat_params]
        if self.offload == "cpu":
            return host_buffers_for_good(numels, self.dtype)
        return [host_memory_empty(numel, self.dtype) if self.offload == "nvme" else
                torch.empty(numel, dtype=self.dtype, device=flat.data.device)
                for flat, numel in zip(self.flat_params, numels)]

    def _use_grad_shards(self, index: int) -> None:
        """Each bucket's owned chunk becomes a view into set `index` of the grad shards."""
        self.shard_set = index
        self.grad_shards = self.shard_sets[index]
        self.owned_grads: dict[BucketKey, torch.Tensor] = {}
        for fi, flat in enumerate(self.flat_params):
            offset = 0
            for b in flat.buckets:
                self.owned_grads[(fi, b.index)] = self.grad_shards[fi][offset:offset + b.chunk_numel]
                offset += b.chunk_numel

    def hand_over(self) -> bool:
        """A delayed update takes the gradient shards as they are: the next backward lands in the other set.
        False when there is no other set (the update must copy what it keeps)."""
        if len(self.shard_sets) == 1:
            return False
        self.allocate()
        self._use_grad_shards(1 - self.shard_set)
        self.landed.clear()
        return True

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
        if self.grad_files is not None or self.measure is None:
            return None
        return self.square_sums.sum()

    def _measured(self, key: BucketKey, values: torch.Tensor) -> None:
        """Bucket `key`'s reduced chunk, as accumulated so far, measured into its slot of `square_sums`."""
        if self.measure is not None and self.grad_files is None:
            self.measure(key, values)

    def write_to(self, grad_files: NvmeAdamStates, chunk_keys: list[list[BucketKey]]) -> None:
        """From now on the reduced chunks go to `grad_files`; `chunk_keys[g][k]`: the bucket of its chunk k of
        param group g. The grad shards never take memory."""
        self.grad_files = grad_files
        self.file_chunk = {key: (g, k) for g, keys in enumerate(chunk_keys) for k, key in enumerate(keys)}

    def allocate(self) -> None:
        """Every grad shard has its memory and this window's values (zeros where no chunk has come): the step and
        the norm read them. With offload cpu the host waits here for the copies in flight, once a step."""
        if self.grad_files is not None:
            return
        if self.offload == "cpu":
            self.landings.wait()
            for key, owned in self.owned_grads.items():
                if key not in self.landed:  # nothing came in this window: the chunk holds an older one's values
                    owned.zero_()
                    self.landed.add(key)
            return
        for fi in range(len(self.grad_shards)):
            self._grad_shard(fi)

    def _grad_shard(self, fi: int) -> torch.Tensor:
        """Flat buffer `fi`'s grad shard, given zeroed memory first if it has none (on the compute stream:
        a chunk's reduction adds into it on the communication stream, after it)."""
        grad_shard = self.grad_shards[fi]
        if allocate_storage(grad_shard):
            grad_shard.zero_()
        return grad_shard

    def begin(self, reduce: bool) -> None:
        self.early_pieces.clear()  # left by a backward that raised
        self.kept_contributions.clear()
        self.square_sums.zero_()  # every chunk is measured again as this backward settles it
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

    @torch.no_grad()
    def contribute(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """One use's gradient of a parameter the model reads more than once per forward (a tied weight: see
        Stage3Params._split_tied_uses), added into the parameter's buckets, or kept as it came until
        `open_buckets` (no copy beside it while the weights it was computed from are still gathered). The
        buckets still go out in their turn, once the parameter's own gradient (its first use's) has come."""
        self.check_in_backward()
        self.got_grad.add(param)
        for key, piece in self.param_pieces[param]:
            if key in self.launched:
                raise RuntimeError(f"a gradient of a tied weight ({tuple(param.shape)}) came after its bucket was "
                                   f"reduced: a later use in the forward reached backward after the first one. "
                                   f"ZeRO stage 3 expects the first use of a tied weight to get its gradient last")
            if key in self.bucket_buffers:
                self._add_to_bucket(key, piece, grad)
            else:
                part = grad.reshape(-1)[piece.param_lo:piece.param_hi]
                self.early_pieces.setdefault(key, []).append((piece.range_lo, part.to(self.dtype)))
                self.kept_contributions.add(key)

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # every use handed its gradient over apart (take_rows, contribute): none left
            return
        if param in self.rows_to_come:
            self.contribute(param, local_grad(param))
            self.release(param)
            return
        super()._on_grad_ready(param)

    @torch.no_grad()
    def take_rows(self, param: nn.Parameter, rows: torch.Tensor, row_grads: torch.Tensor) -> None:
        """The gradient of a tied weight's first use, an embedding lookup (Stage3Params._split_tied_uses), as the
        rows its tokens picked: `row_grads[i]` is the gradient of row `rows[i]`, the rest is zero (a row may come
        again, with zeros).
        Added into the parameter's bucket, after the other uses' contributions as a dense gradient would be;
        then the parameter's gradient has come."""
        self.check_in_backward()
        self.rows_to_come.discard(param)
        assert self.reducing, "rows are taken at stage 3, which reduces every backward"

        def write(key: BucketKey, piece: Piece) -> None:
            whole = piece.slice  # the parameter may be freed already: its slice knows its shape
            assert piece.param_lo == 0 and piece.param_hi == whole.numel, "stage 3: one bucket per parameter"
            region = self._buffer(key)[piece.range_lo:piece.range_lo + whole.numel].view(whole.shape)
            region.index_add_(0, rows, row_grads.to(self.dtype))  # a row's other slots add zeros: exact

        self._take_in(param, write)

    def open_buckets(self) -> None:
        """Opens the buckets that hold contributions kept as they came, taking them in (stage 3: once the
        root's weights are freed, the tied head's gradient moves into its bucket)."""
        for key in self.kept_contributions:
            if key in self.early_pieces:  # else its bucket has opened already
                self._buffer(key)
        self.kept_contributions.clear()

    def _add_to_bucket(self, key: BucketKey, piece: Piece, grad: torch.Tensor) -> None:
        """Adds `piece` of a parameter's gradient `grad` into its bucket."""
        grad = grad.reshape(-1)[piece.param_lo:piece.param_hi]
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

        if self.offload == "cpu":
            return BucketReduction(launch, lambda: self._land_in_pinned_shard(key, owned), lambda: self._recycle(buf))
        if self.offload == "nvme":  # the bucket goes back once its chunk has landed in host memory (_add_landed)
            return BucketReduction(launch, lambda: self._land_in_host_memory(key, owned, buf))
        self._grad_shard(key[0])
        return BucketReduction(launch, lambda: self._add_to_shard(key, owned), lambda: self._recycle(buf))

    def _add_to_shard(self, key: BucketKey, owned: torch.Tensor) -> None:
        """Settles a reduction on the device: this rank's chunk is added into its grad shard, and measured."""
        shard_chunk = self.owned_grad(*key)
        shard_chunk.add_(owned)
        self._measured(key, shard_chunk)

    def _land_in_pinned_shard(self, key: BucketKey, owned: torch.Tensor) -> None:
        """offload cpu, settling a reduction on the communication stream: this rank's reduced chunk, plus what its
        place in the pinned shard holds from this window's earlier micro-batches (brought to the device and added
        there), is measured and copied into that place, asynchronously. The bucket goes back once the compute
        stream has waited on the reduction, which comes after the copy on this stream."""
        shard_chunk = self.owned_grad(*key)
        name = f"the reduced gradient chunk of bucket {key}"
        if key in self.landed:
            earlier, _ = to_device(shard_chunk, owned.device, name)
            owned.add_(earlier)
        self.landed.add(key)
        self._measured(key, owned)
        self.landings.add(copy_to_host(shard_chunk, owned, name))

    def _land_in_host_memory(self, key: BucketKey, owned: torch.Tensor, buf: torch.Tensor) -> None:
        """offload nvme: this rank's reduced chunk goes to the host without blocking the backward hook (a
        non-blocking copy into pinned memory); it is added into the NVMe files when the next chunk comes,
        or at the end of backward, once its copy has landed. The bucket stays lent to the copy until then."""
        host, copy = to_host(owned, f"the reduced gradient chunk of bucket {key}")
        if self.landing:
            self._add_landed()
        self.landing = (host, copy, key, buf)

    def _add_landed(self) -> None:
        host, copy, key, buf = self.landing
        self.landing = None
        copy.wait()
        self._wait_for_write()
        write = self.grad_files.accumulate_grad(*self.file_chunk[key], host)
        if host.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            self.writing = (write, buf)  # the chunk is still in its bucket (host memory): lent to the write
        else:
            self.writing = (write, None)
            self._recycle(buf)

    def _wait_for_write(self) -> None:
        """The gradient write in flight has finished (its error raised here); a bucket it read goes back."""
        if self.writing is not None:
            write, buf = self.writing
            self.writing = None
            write.result()
            if buf is not None:
                self._recycle(buf)

    def _recycle(self, buf: torch.Tensor) -> None:
        if self.reuse_buffers:
            self.spare_buffers.setdefault(buf.numel(), []).append(buf)
        else:
            self.comm.ledger.hold("bytes of gradient buckets", -buf.numel() * buf.element_size())

    @torch.no_grad()
    def finish(self) -> None:
        super().finish()
        if self.landing:
            self._add_landed()
        self._wait_for_write()

    def owned_grad(self, fi: int, bi: int) -> torch.Tensor:
        return self.owned_grads[(fi, bi)]

    def zero_grad(self) -> None:
        self.square_sums.zero_()
        if self.grad_files is not None:
            self.grad_files.clear_grads()
        if self.offload == "cpu":  # pinned for good: the next window's first landings overwrite them
            self.landed.clear()
            return
        for grad_shard in self.grad_shards:
            release_storage(grad_shard)

    def held_bytes(self) -> int:
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for shards in self.shard_sets for g in shards}
        return sum(storages.values())
