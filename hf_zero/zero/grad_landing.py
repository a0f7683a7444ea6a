"""Where this rank's reduced gradient chunks land at stages 2-3: a strategy chosen once from offload_optimizer
(`landing_for`), as the update backend (hf_zero/optim/update.py) is for where the optimizer states live. A landing
owns the gradient shards, one per flat buffer (M_D), and says how a bucket's reduced chunk gets into them.

DeviceShard: the grad shards take memory only from the moment their first reduced chunk lands until the step has
used them (`zero_grad` gives it back, as torch's set_to_none does): a model built shard by shard at stage 3 does not
pay for its gradients while it is constructed or evaluated, and during a forward and most of a backward a rank holds
only the shards of the units backward has reached. At stage 3 that is what leaves room for the root's backward, the
first to come, where the gathered vocabulary weight and its whole gradient meet.

HostShard (offload_optimizer cpu): the grad shards are pinned host memory, kept for good as DeepSpeed keeps its
pinned gradient buffer: each reduced chunk goes straight into its place by an asynchronous copy on the communication
stream, and the host waits once, at the step (`allocate`). A chunk that already holds this window's earlier
micro-batches comes to the device, is added there, and goes back: no host pass per micro-batch, no zero fill per
step. With a delayed update the shards are double: the update of step i reads one set on the host while the
backward of step i+1 lands in the other.

NvmeFiles (offload_optimizer nvme): the shards take no memory at all: each landed chunk is added into the NVMe files
(`write_to`) by an I/O thread while backward goes on, one write in flight.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable

import torch

from hf_zero.runtime.device import (
    Copy,
    LatestCopy,
    copy_to_host,
    host_buffers_for_good,
    to_device,
    to_host,
)
from hf_zero.runtime.trace import span
from hf_zero.zero.partition import FlatParamBuffer, allocate_storage, release_storage
from hf_zero.zero.reducer import BucketKey, BucketReduction
from hf_zero.zero.update_files import GradientFiles

Launch = Callable[[], Any]  # issues a bucket's reduce-scatter (on the communication stream) and returns its work


class GradLanding(ABC):
    """This rank's gradient shards and how a bucket's reduced chunk lands in them. `measure(key, values)` takes a
    landed chunk's gradient, as accumulated so far, into the gradient norm; `recycle(bucket)` gives a bucket buffer
    back to the reducer."""

    # Whether the reducer measures each chunk for the gradient norm as it lands (NVMe: the files measure their own).
    measured_as_landed = True
    # Whether a delayed update gets a second set of shards to read while the next backward lands in the first.
    double_buffers = False

    def __init__(self, flat_params: list[FlatParamBuffer], dtype: torch.dtype,
                 measure: Callable[[BucketKey, torch.Tensor], None], recycle: Callable[[torch.Tensor], None],
                 double_buffered: bool = False) -> None:
        self.flat_params, self.dtype = flat_params, dtype
        self.measure, self.recycle = measure, recycle
        numels = [sum(b.chunk_numel for b in flat.buckets) for flat in flat_params]
        with span("grad_shards"):
            self.shard_sets = [self._new_shards(numels)
                               for _ in range(2 if double_buffered and self.double_buffers else 1)]
        self._use_shards(0)

    @abstractmethod
    def _new_shards(self, numels: list[int]) -> list[torch.Tensor]:
        """One gradient shard per flat buffer, of `numels[i]` elements."""

    def _use_shards(self, index: int) -> None:
        """Each bucket's owned chunk becomes a view into set `index` of the grad shards."""
        self.shard_set = index
        self.grad_shards = self.shard_sets[index]
        self.owned_grads: dict[BucketKey, torch.Tensor] = {}
        for fi, flat in enumerate(self.flat_params):
            offset = 0
            for b in flat.buckets:
                self.owned_grads[(fi, b.index)] = self.grad_shards[fi][offset:offset + b.chunk_numel]
                offset += b.chunk_numel

    @abstractmethod
    def reduction(self, key: BucketKey, owned: torch.Tensor, bucket: torch.Tensor, launch: Launch) -> BucketReduction:
        """How bucket `key` (its buffer `bucket`, whose chunk `owned` this rank owns) is reduced by `launch` and
        lands."""

    def allocate(self) -> None:
        """Every grad shard has its memory and this window's values (zeros where no chunk has come): the step and the
        norm read them."""

    def hand_over(self) -> bool:
        """A delayed update takes the gradient shards as they are: the next backward lands in the other set. False
        when there is no other set (the update must copy what it keeps)."""
        return False

    def finish(self) -> None:
        """The end of backward: every chunk has landed."""

    @abstractmethod
    def zero_grad(self) -> None:
        """The next window's gradients start from zero."""

    def held_bytes(self) -> int:
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for shards in self.shard_sets for g in shards}
        return sum(storages.values())


def _without_memory(shards: list[torch.Tensor]) -> None:
    """torch.empty touched no pages; the views, taken before the storage is released, keep the storage object, so
    they see it once allocated."""
    for shard in shards:
        release_storage(shard)


class DeviceShard(GradLanding):
    """The grad shards on the device, holding memory from a window's first landed chunk until `zero_grad`."""

    def __init__(self, flat_params: list[FlatParamBuffer], dtype: torch.dtype,
                 measure: Callable[[BucketKey, torch.Tensor], None], recycle: Callable[[torch.Tensor], None],
                 double_buffered: bool = False) -> None:
        super().__init__(flat_params, dtype, measure, recycle, double_buffered)
        _without_memory(self.grad_shards)

    def _new_shards(self, numels: list[int]) -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=self.dtype, device=flat.data.device)
                for flat, numel in zip(self.flat_params, numels)]

    def reduction(self, key: BucketKey, owned: torch.Tensor, bucket: torch.Tensor, launch: Launch) -> BucketReduction:
        self._grad_shard(key[0])
        return BucketReduction(launch, lambda: self._add_to_shard(key, owned), lambda: self.recycle(bucket))

    def _add_to_shard(self, key: BucketKey, owned: torch.Tensor) -> None:
        """Lands a reduction on the device: this rank's chunk is added into its grad shard, and measured."""
        shard_chunk = self.owned_grads[key]
        shard_chunk.add_(owned)
        self.measure(key, shard_chunk)

    def allocate(self) -> None:
        for fi in range(len(self.grad_shards)):
            self._grad_shard(fi)

    def _grad_shard(self, fi: int) -> torch.Tensor:
        """Flat buffer `fi`'s grad shard, given zeroed memory first if it has none (on the compute stream:
        a chunk's reduction adds into it on the communication stream, after it)."""
        grad_shard = self.grad_shards[fi]
        if allocate_storage(grad_shard):
            grad_shard.zero_()
        return grad_shard

    def zero_grad(self) -> None:
        _without_memory(self.grad_shards)


class HostShard(GradLanding):
    """offload_optimizer cpu: the grad shards in pinned host memory for good, written by asynchronous copies."""

    double_buffers = True

    def __init__(self, flat_params: list[FlatParamBuffer], dtype: torch.dtype,
                 measure: Callable[[BucketKey, torch.Tensor], None], recycle: Callable[[torch.Tensor], None],
                 double_buffered: bool = False) -> None:
        super().__init__(flat_params, dtype, measure, recycle, double_buffered)
        # The copies of reduced chunks into the pinned shards, and the chunks written since the step last took the
        # shards (a chunk not among them holds an older window's values).
        self.landings = LatestCopy()
        self.landed: set[BucketKey] = set()

    def _new_shards(self, numels: list[int]) -> list[torch.Tensor]:
        return host_buffers_for_good(numels, self.dtype)

    def reduction(self, key: BucketKey, owned: torch.Tensor, bucket: torch.Tensor, launch: Launch) -> BucketReduction:
        return BucketReduction(launch, lambda: self._land_in_pinned_shard(key, owned), lambda: self.recycle(bucket))

    def _land_in_pinned_shard(self, key: BucketKey, owned: torch.Tensor) -> None:
        """On the communication stream: this rank's reduced chunk, plus what its place in the pinned shard holds from
        this window's earlier micro-batches (brought to the device and added there), is measured and copied into that
        place, asynchronously. The bucket goes back once the compute stream has waited on the reduction, which comes
        after the copy on this stream."""
        shard_chunk = self.owned_grads[key]
        name = f"the reduced gradient chunk of bucket {key}"
        if key in self.landed:
            earlier, _ = to_device(shard_chunk, owned.device, name)
            owned.add_(earlier)
        self.landed.add(key)
        self.measure(key, owned)
        self.landings.add(copy_to_host(shard_chunk, owned, name))

    def allocate(self) -> None:
        """The host waits here for the copies in flight, once a step."""
        self.landings.wait()
        for key, owned in self.owned_grads.items():
            if key not in self.landed:  # nothing came in this window: the chunk holds an older one's values
                owned.zero_()
                self.landed.add(key)

    def hand_over(self) -> bool:
        if len(self.shard_sets) == 1:
            return False
        self.allocate()
        self._use_shards(1 - self.shard_set)
        self.landed.clear()
        return True

    def zero_grad(self) -> None:
        self.landed.clear()  # pinned for good: the next window's first landings overwrite them


class NvmeFiles(GradLanding):
    """offload_optimizer nvme: the grad shards never take memory; each reduced chunk is added into the files."""

    measured_as_landed = False

    def __init__(self, flat_params: list[FlatParamBuffer], dtype: torch.dtype,
                 measure: Callable[[BucketKey, torch.Tensor], None], recycle: Callable[[torch.Tensor], None],
                 double_buffered: bool = False) -> None:
        super().__init__(flat_params, dtype, measure, recycle, double_buffered)
        # Where landed chunks go (write_to), the (param group, chunk) of each bucket there, the last reduced chunk on
        # its way to the host with its copy and bucket, and the write in flight with the bucket it reads.
        self.files: GradientFiles | None = None
        self.file_chunk: dict[BucketKey, tuple[int, int]] = {}
        self.in_transit: tuple[torch.Tensor, Copy, BucketKey, torch.Tensor] | None = None
        self.writing: tuple[Future, torch.Tensor | None] | None = None

    def _new_shards(self, numels: list[int]) -> list[torch.Tensor]:
        # Shapes only: the chunks' views say which elements each bucket's gradient is, and no value is ever in them.
        return [torch.empty(numel, dtype=self.dtype, device="meta") for numel in numels]

    def held_bytes(self) -> int:
        return 0

    def write_to(self, files: GradientFiles, chunk_keys: list[list[BucketKey]]) -> None:
        """From now on the reduced chunks go to `files`; `chunk_keys[g][k]`: the bucket of its chunk k of param group
        g."""
        self.files = files
        self.file_chunk = {key: (g, k) for g, keys in enumerate(chunk_keys) for k, key in enumerate(keys)}

    def reduction(self, key: BucketKey, owned: torch.Tensor, bucket: torch.Tensor, launch: Launch) -> BucketReduction:
        # The bucket goes back once its chunk has landed in host memory (_add_landed).
        return BucketReduction(launch, lambda: self._land_in_host_memory(key, owned, bucket))

    def _land_in_host_memory(self, key: BucketKey, owned: torch.Tensor, bucket: torch.Tensor) -> None:
        """This rank's reduced chunk goes to the host without blocking the backward hook (a non-blocking copy into
        pinned memory); it is added into the files when the next chunk comes, or at the end of backward, once its
        copy has landed. The bucket stays lent to the copy until then."""
        host, copy = to_host(owned, f"the reduced gradient chunk of bucket {key}")
        if self.in_transit:
            self._add_landed()
        self.in_transit = (host, copy, key, bucket)

    def _add_landed(self) -> None:
        host, copy, key, bucket = self.in_transit
        self.in_transit = None
        copy.wait()
        self._wait_for_write()
        write = self.files.accumulate_grad(*self.file_chunk[key], host)
        if host.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr():
            self.writing = (write, bucket)  # the chunk is still in its bucket (host memory): lent to the write
        else:
            self.writing = (write, None)
            self.recycle(bucket)

    def _wait_for_write(self) -> None:
        """The gradient write in flight has finished (its error raised here); a bucket it read goes back."""
        if self.writing is not None:
            write, bucket = self.writing
            self.writing = None
            write.result()
            if bucket is not None:
                self.recycle(bucket)

    def finish(self) -> None:
        if self.in_transit:
            self._add_landed()
        self._wait_for_write()

    def zero_grad(self) -> None:
        if self.files is not None:
            self.files.clear_grads()


def landing_for(offload_optimizer: str) -> type[GradLanding]:
    """The one place that maps offload_optimizer to where the reduced gradients land."""
    return {"none": DeviceShard, "cpu": HostShard, "nvme": NvmeFiles}[offload_optimizer]
