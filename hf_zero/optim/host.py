"""The optimizer step on the host (ZeRO-Offload, sections 3-4 and 5.1).

Each rank keeps its fp32 master shard and the optimizer states in host memory and updates them
there; gradients arrive from the device already reduced and partitioned, and the updated parameters
go back in the compute dtype. For Adam and AdamW (torch's, or hf_zero.ops.CPUAdam) the update is the
C++ kernel: it reads the compute-dtype gradient and writes the compute-dtype parameter in the same
pass over memory. The states stay in torch's format in `optimizer.state`, so the scheduler, the
checkpoints and `optimizer.state_dict()` see an ordinary Adam. Other optimizers run their own step()
on the host masters.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from hf_zero.ops import CPUAdam, adam_step_with_state, cpu_adam_kernel
from hf_zero.optim.update import UpdateBackend
from hf_zero.runtime.device import (
    DONE,
    HOST,
    LatestCopy,
    copy_to_device,
    host_buffers_for_good,
    host_memory_empty,
    timeline,
)
from hf_zero.runtime.trace import spanned
from hf_zero.settings.environment import cpu_adam_threads

logger = logging.getLogger("hf_zero")


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's (OpenMP's) threads for the calling thread, for the duration: the C++ Adam's parallel_for and the
    fallback's fused AdamW split their work over as many."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def offloaded_step_threads(what: str, beside_the_device: bool) -> int:
    """The intra-op threads the offloaded step (`what` runs it) gets, said in the log (environment.cpu_adam_threads:
    not OMP_NUM_THREADS, which torchrun sets to 1 when several processes share a node)."""
    threads, why = cpu_adam_threads(beside_the_device)
    logger.info("the offloaded optimizer step runs %s on %d threads (%s)", what, threads, why)
    return threads


def adamw_mode_of(optimizer: torch.optim.Optimizer) -> dict[int, bool] | None:
    """For Adam-family optimizers the kernel can step: per param group, whether weight decay is
    decoupled (AdamW) or L2 (Adam). None for anything else, which then runs its own step()."""
    if isinstance(optimizer, CPUAdam):
        return {g: group["adamw_mode"] for g, group in enumerate(optimizer.param_groups)}
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if any(group["amsgrad"] or group["maximize"] for group in optimizer.param_groups):
        return None
    return {g: bool(group.get("decoupled_weight_decay")) or isinstance(optimizer, torch.optim.AdamW)
            for g, group in enumerate(optimizer.param_groups)}


def step_with_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]] | None) -> None:
    """`optimizer.step()`, its param groups' hyper-parameters taken from `settings` where given: the step runs on a
    second optimizer object that shares the first's state (and hooks) and holds `settings` as its param groups, so
    that a scheduler writing the live param groups meanwhile changes nothing here. The class's step is called
    directly: an LR scheduler wraps the instance's `step` to count calls, and that wrapper is bound to the first."""
    if settings is None:
        optimizer.step()
        return
    stepping = object.__new__(type(optimizer))
    stepping.__dict__.update(optimizer.__dict__)
    stepping.param_groups = settings
    type(optimizer).step(stepping)


class HostAdam:
    """Steps the masters of an Adam/AdamW with the C++ kernel, keeping torch's state layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, adamw_mode: dict[int, bool], beside_the_device: bool) -> None:
        """`beside_the_device`: the steps run while another thread drives the device (a delayed update)."""
        self.optimizer, self.adamw_mode = optimizer, adamw_mode
        self.kernel = cpu_adam_kernel() if timeline().host_kernels else None
        self.threads = offloaded_step_threads("the CPU Adam", beside_the_device)

    @torch.no_grad()
    def step_chunk(self, g: int, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None,
                   grad_scale: float, state: dict[str, torch.Tensor] | None = None,
                   settings: list[dict[str, Any]] | None = None) -> None:
        """One update of `master` (fp32, host) from `grad` (any float dtype, host) times grad_scale;
        `out` (host) receives the new values in its dtype. `state` defaults to optimizer.state[master];
        `settings` (param_group_settings) to the optimizer's param groups as they are now."""
        with intra_op_threads(self.threads):
            adam_step_with_state((settings or self.optimizer.param_groups)[g], self.adamw_mode[g],
                                 self.optimizer.state[master] if state is None else state, master, grad, out,
                                 grad_scale, self.kernel)


class StagedOutputs:
    """Where a host update writes the new compute-dtype values: the parameter chunks themselves when they are
    in host memory and nothing reads them meanwhile, else (`staged`) host buffers that `publish` copies over.
    Each staged buffer stays lent to its copy until `writable` waits on that copy. Copies land in the order they
    were queued, so an update that writes the chunks in the order `publish` queued them waits for one chunk's copy
    at a time while the later ones are still on their way: a delayed update starts once the first chunk has left
    for the device, not the whole model."""

    def __init__(self, param_chunks: list[list[torch.Tensor]], staged: bool) -> None:
        self.param_chunks = param_chunks
        every_chunk = [c for chunks in param_chunks for c in chunks]
        assert len({c.dtype for c in every_chunk}) <= 1, "the parameter chunks share the engine's compute dtype"
        staging = iter(host_buffers_for_good([c.numel() for c in every_chunk], every_chunk[0].dtype)) \
            if staged and every_chunk else None  # one block for every staged chunk
        self.outs = [[next(staging).view(c.shape).zero_() if staging else c for c in chunks] for chunks in param_chunks]
        self.lent_to = [[DONE] * len(chunks) for chunks in param_chunks]

    def writable(self, g: int, k: int) -> torch.Tensor:
        """Chunk k of param group g's buffer, once the copy that reads it has landed."""
        self.lent_to[g][k].wait()
        self.lent_to[g][k] = DONE
        return self.outs[g][k]

    def publish(self) -> None:
        """Queues the copies of the staged values into the parameter chunks."""
        for g, chunks in enumerate(self.param_chunks):
            for k in range(len(chunks)):
                self.publish_chunk(g, k)

    def publish_chunk(self, g: int, k: int) -> None:
        """Queues the copy of chunk k of param group g's staged values into the parameter chunk."""
        out, chunk = self.outs[g][k], self.param_chunks[g][k]
        if out is not chunk:
            self.lent_to[g][k] = copy_to_device(chunk, out, f"the staged new values of chunk {k} of param group {g}")


class HostUpdate(UpdateBackend):
    """ZeRO-Offload: fp32 master shards and optimizer states in host memory, stepped there; gradients arrive
    reduced and partitioned, the new parameters go back in the compute dtype. Adam and AdamW run the C++
    kernel (HostAdam); any other optimizer runs its own step() on the host masters.
    `staged`: the new values go to host buffers first (the parameters are on a device, or a delayed update
    writes while the model reads), copied over by publish(). `delayed`: the steps run in the background during the
    next forward and backward; otherwise each chunk's copy is queued as soon as its update is done, overlapping
    the next chunk's."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                 fp32_init: list[list[torch.Tensor]] | None, staged: bool, chunks_lent: LatestCopy | None,
                 delayed: bool = False) -> None:
        super().__init__(optimizer, param_chunks, chunks_lent)
        adamw_mode = adamw_mode_of(optimizer)
        self.host_adam = HostAdam(optimizer, adamw_mode, beside_the_device=delayed) if adamw_mode is not None \
            else None
        if self.host_adam is None:
            self.threads = offloaded_step_threads(f"{type(optimizer).__name__}.step()", beside_the_device=delayed)
        # Never pinned: the masters stay in host memory (the step reads and writes them there), no copy to
        # the device reads them, and page-locked memory is taken from what the host can swap or cache.
        self.masters = self._own_masters(fp32_init or param_chunks, host_memory_empty, consume=fp32_init is not None)
        self.staged = staged
        self.publish_as_stepped = staged and not delayed and self.host_adam is not None
        self.outputs = StagedOutputs(param_chunks, staged)
        self._retarget()

    @spanned("host_step")
    def step(self, coef: float, grad_chunks: list[list[torch.Tensor]],
             settings: list[dict[str, Any]] | None = None) -> None:
        """`settings`: the param groups' hyper-parameters to step with (param_group_settings), when not the
        optimizer's as they are now."""
        if not self.staged or self.publish_as_stepped:
            self._writable_chunks()
        for g, (masters, grads) in enumerate(zip(self.masters, grad_chunks)):
            for k, (master, grad) in enumerate(zip(masters, grads)):
                if self.host_adam is not None:
                    self.host_adam.step_chunk(g, master, grad.to(HOST), self.outputs.writable(g, k), coef,
                                              settings=settings)
                    if self.publish_as_stepped:
                        self.outputs.publish_chunk(g, k)
                else:
                    master.grad = grad.to(HOST, torch.float32).mul_(coef)
        if self.host_adam is None:
            with intra_op_threads(self.threads):
                step_with_settings(self.optimizer, settings)
            for g, masters in enumerate(self.masters):
                for k, master in enumerate(masters):
                    self.outputs.writable(g, k).copy_(master)
                    master.grad = None

    def publish(self) -> None:
        if self.staged and not self.publish_as_stepped:
            self._writable_chunks()
            self.outputs.publish()
