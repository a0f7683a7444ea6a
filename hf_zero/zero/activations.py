"""ZeRO-R activation checkpointing (paper sections 4.2, 6.1 and 8): P_a, P_a+cpu and M_D.

Each transformer block is checkpointed (torch.utils.checkpoint, reentrant form): its forward runs
without keeping intermediates, and only its input is saved, to be recomputed from in backward. With
tensor parallelism that input is replicated on every rank of the tp group. The block input is
saved through `torch.autograd.graph.saved_tensors_hooks`, which is where this file acts:

- partition_activations (P_a): a rank keeps only its 1/tp slice of each saved checkpoint; backward
  all-gathers it over the tp group just before the block is recomputed (the paper's extra
  all-gather of seq x hidden x batch elements per block, section 8);
- cpu_checkpointing (P_a+cpu): the kept slice, or the whole checkpoint when tp is 1, goes to host
  memory (pinned when there is a GPU) and comes back for recomputation, the next block's prefetched
  while the current one recomputes;
- M_D: the kept checkpoints of a step are copied into one preallocated contiguous buffer instead of
  one allocation each; the buffer is sized by the first step and reused while no checkpoint is live.

The reentrant checkpoint saves its inputs through `ctx.save_for_backward`, so the hooks see exactly
the checkpoints; recomputation in backward runs outside them and saves as usual.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import (
    DONE,
    Copy,
    copy_to_host,
    host_empty,
    on_copy_stream,
    to_device,
    to_host,
)

logger = logging.getLogger("hf_zero")


@dataclass
class SavedCheckpoint:
    """One saved tensor as held between forward and backward."""
    kept: torch.Tensor     # all of it, or this rank's slice of it flattened (P_a)
    shape: torch.Size
    device: torch.device   # where the block computes (and the tensor returns to)
    partitioned: bool
    offloaded: bool        # kept in host memory (P_a+cpu)
    prefetched: Any = None  # (its copy, or its all-gather's work; the tensor it brings) started ahead of use


class CheckpointStore:
    """Holds the block-input checkpoints of the steps in flight: partitioned across the tp group,
    in host memory, in one contiguous buffer, as configured."""

    def __init__(self, tp_comm: Communicator | None, partition: bool, cpu: bool, contiguous: bool = True) -> None:
        """`tp_comm`: the tensor-parallel group (None without tensor parallelism: nothing to partition)."""
        self.tp_comm, self.cpu, self.contiguous = tp_comm, cpu, contiguous
        self.partition = partition and tp_comm is not None and tp_comm.world_size > 1
        if partition and not self.partition:
            logger.warning("partition_activations: tensor parallel size is 1, so no rank holds a copy of another's "
                           "activation checkpoints and there is nothing to partition; checkpoints are kept whole")
        self.buffer: torch.Tensor | None = None  # M_D: this step's checkpoints, back to back
        self.buffer_used = 0
        self.step_numel = 0  # what the current step has kept so far (sizes the buffer for the next)
        self.kept_dtype: torch.dtype | None = None  # of the checkpoints (the buffer's dtype)
        self.compute_device: torch.device | None = None
        self.live: list[SavedCheckpoint] = []  # packed and not yet unpacked, in forward order
        # Bytes of kept checkpoints, now and at most, on the compute device and in host memory (offloaded).
        # Counted by where the store put them, so that a CPU-only run measures what a GPU run would.
        self.held_bytes = {"device": 0, "host": 0}
        self.peak_held_bytes = {"device": 0, "host": 0}
        self.compiled_call: Callable[..., Any] | None = None  # compile_with
        self.compiling = False  # compiling_checkpoints

    # ---- saved-tensor hooks ------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> SavedCheckpoint | torch.Tensor:
        if not tensor.is_floating_point():  # ids and masks: tiny, kept as they are
            return tensor
        if not self.live:  # a new step: the buffer's contents are no longer needed
            self._start_step()
        flat = tensor.detach().reshape(-1)
        partitioned = self.partition
        if partitioned:
            n = self.tp_comm.world_size
            chunk = -(-flat.numel() // n)
            flat = torch.nn.functional.pad(flat, (0, chunk * n - flat.numel()))[self.tp_comm.rank * chunk:][:chunk]
        kept = self._place(flat)
        saved = SavedCheckpoint(kept, tensor.shape, tensor.device, partitioned, offloaded=self.cpu)
        self.live.append(saved)
        self._count(saved, +1)
        return saved

    def unpack(self, saved: SavedCheckpoint | torch.Tensor) -> torch.Tensor:
        if not isinstance(saved, SavedCheckpoint):
            return saved
        index = next(i for i, s in enumerate(self.live) if s is saved)
        if index > 0:  # backward runs blocks in reverse: bring the previous one's checkpoint in meanwhile
            self._start_fetch(self.live[index - 1])
        self._start_fetch(saved)
        arrival, whole = saved.prefetched
        if isinstance(arrival, Copy):
            arrival.ready()  # the recomputation reads it on the compute stream
        else:
            arrival.wait()
        self.live.pop(index)
        self._count(saved, -1)
        return whole[:saved.shape.numel()].view(saved.shape)

    # ---- internals -----------------------------------------------------------------------------
    def _start_step(self) -> None:
        if self.contiguous and self.step_numel and (self.buffer is None or self.buffer.numel() < self.step_numel):
            self.buffer = host_empty(self.step_numel, self.kept_dtype) if self.cpu else \
                torch.empty(self.step_numel, dtype=self.kept_dtype, device=self.compute_device)
        self.buffer_used = self.step_numel = 0

    def _place(self, flat: torch.Tensor) -> torch.Tensor:
        """Copies what is kept into the step's buffer (M_D) or a tensor of its own (first step, or a
        step longer than the first)."""
        self.kept_dtype, self.compute_device = flat.dtype, flat.device
        self.step_numel += flat.numel()
        fits = self.buffer is not None and self.buffer.dtype == flat.dtype and \
            self.buffer_used + flat.numel() <= self.buffer.numel()
        if fits:
            kept = self.buffer[self.buffer_used:self.buffer_used + flat.numel()]
            self.buffer_used += flat.numel()
            if self.cpu:
                copy_to_host(kept, flat, "an offloaded activation checkpoint", overlap=True)
                return kept
            return kept.copy_(flat)
        if self.cpu:
            return to_host(flat, "an offloaded activation checkpoint", overlap=True)[0]
        return flat.clone()

    def _start_fetch(self, saved: SavedCheckpoint) -> None:
        """Starts bringing a checkpoint back: host to device, then the all-gather of its slices."""
        if saved.prefetched is not None:
            return
        kept, copy = to_device(saved.kept, saved.device, "an offloaded activation checkpoint", overlap=True) \
            if saved.offloaded else (saved.kept, DONE)
        if not saved.partitioned:
            saved.prefetched = (copy, kept)
            return
        whole = torch.empty(kept.numel() * self.tp_comm.world_size, dtype=kept.dtype, device=saved.device)
        # On the copy stream, after the copy there and the compute that wrote `kept` and allocated `whole`, not
        # holding up the recomputation; `unpack` makes the compute stream wait on it.
        with on_copy_stream(saved.device):
            saved.prefetched = (self.tp_comm.all_gather_(whole, kept, async_op=True), whole)

    def _count(self, saved: SavedCheckpoint, sign: int) -> None:
        where = "host" if saved.offloaded else "device"
        self.held_bytes[where] += sign * saved.kept.numel() * saved.kept.element_size()
        self.peak_held_bytes[where] = max(self.peak_held_bytes[where], self.held_bytes[where])

    def reset_peaks(self) -> None:
        self.peak_held_bytes = dict(self.held_bytes)

    def compile_with(self, compile: Callable[[Callable], Callable]) -> None:
        """--torch_compile: what a checkpoint taken inside `compiling_checkpoints` runs (the block's forward, which
        transformers hands the checkpoint function) runs compiled, inside the checkpoint and its saved-tensor hooks,
        whose entry dynamo cannot trace."""
        self.compiled_call = compile(_call)

    @contextlib.contextmanager
    def compiling_checkpoints(self) -> Iterator[None]:
        """Around a block the engine compiles (hf_zero/engine/compile.py); a block it leaves eager (one holding hooks
        dynamo must not trace) is checkpointed eager."""
        self.compiling = True
        try:
            yield
        finally:
            self.compiling = False

    def checkpoint(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """torch.utils.checkpoint with this store holding the saved inputs; the signature transformers'
        gradient checkpointing calls (`gradient_checkpointing_func`)."""
        kwargs.pop("use_reentrant", None)
        if self.compiling:
            function = functools.partial(self.compiled_call, function)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return checkpoint(function, *args, use_reentrant=True, **kwargs)


def _call(function: Callable, *args: Any) -> Any:
    """One function for every block's checkpointed forward, so that dynamo compiles it once for all of them."""
    return function(*args)


def check_supports_checkpointing(model: torch.nn.Module) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"partition_activations / cpu_checkpointing checkpoint each transformer block; "
                         f"{type(model).__name__} does not support gradient checkpointing. Use a transformers "
                         f"model whose blocks support it, or leave both settings off")


def apply_activation_checkpointing(model: torch.nn.Module, store: CheckpointStore) -> None:
    """Checkpoints every transformer block of a transformers model through `store`, with the model's
    own gradient-checkpointing hook (the one the Trainer's --gradient_checkpointing turns on)."""
    check_supports_checkpointing(model)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=store.checkpoint)
