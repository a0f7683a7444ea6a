"""The user's torch optimizer, re-targeted at this rank's shard (stage 1 and up: P_os).

Each param group of the optimizer keeps its hyper-parameters; its `params` become this rank's chunks
(or their fp32 masters). Where the masters and states live and how the update runs there is the update
backend's (update.py: on the device; offload/host.py: in host memory; offload/nvme.py: on NVMe). What is
the same everywhere is here: unscaling, global-norm clipping and the overflow check, once, on the shard,
and the delayed update (ZeRO-Offload 5.2), which runs a host backend's step in the background.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable

import torch

from hf_zero.optim.delayed import DelayedUpdate
from hf_zero.optim.host import HostUpdate, adamw_mode_of
from hf_zero.optim.nvme import NvmeUpdate
from hf_zero.optim.precision import LossScaler
from hf_zero.optim.update import (
    DeviceUpdate,
    UpdateBackend,
    is_elementwise,
    param_group_settings,
)
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import HOST, Copy, LatestCopy, copy_to_host, host_empty
from hf_zero.runtime.trace import span, spanned
from hf_zero.settings.config import ZeroConfig, ZeroConfigError
from hf_zero.zero.reducer import GradientReducer


def update_backend(optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                   grad_chunks: list[list[torch.Tensor]], fp32_init: list[list[torch.Tensor]] | None,
                   config: ZeroConfig, rank: int, chunks_lent: LatestCopy | None,
                   grads_partitioned: bool) -> UpdateBackend:
    """The backend for where `offload_optimizer` puts the states.
    param_chunks[g][k]: compute-dtype tensor this rank updates (chunk k of param group g).
    grad_chunks[g][k]: the reduced gradient of the same elements.
    fp32_init[g][k]: their fp32 starting values (mixed precision only: the masters' initial values).
    chunks_lent: what the backend waits on before writing param_chunks that queued copies still read.
    grads_partitioned: the gradients are a shard of their own (stages 2-3), not views of whole gradients."""
    if config.offload_optimizer == "nvme":
        # Stages 2-3 hold a gradient shard, which goes to the files too; stage 1's gradients are whole.
        grad_dtype = next((g.dtype for grads in grad_chunks for g in grads), None) if grads_partitioned else None
        return NvmeUpdate(optimizer, param_chunks, fp32_init, config.nvme_path, rank, config.nvme_tile_numel,
                          params_on_nvme=config.offload_param == "nvme", chunks_lent=chunks_lent,
                          grad_dtype=grad_dtype, delayed=config.delayed_param_update)
    if config.offload_optimizer == "cpu":
        # The update writes straight into the parameter chunks when they are in host memory and nothing reads
        # them meanwhile; a delayed update runs while the next forward reads them.
        staged = config.delayed_param_update or any(c.device != HOST for cs in param_chunks for c in cs)
        return HostUpdate(optimizer, param_chunks, fp32_init, staged, chunks_lent, delayed=config.delayed_param_update)
    return DeviceUpdate(optimizer, param_chunks, grad_chunks, fp32_init, chunks_lent)


class ShardedOptimizer:
    """Steps the backend's masters from the reduced gradient chunks.

    grads: the gradient reducer, which measures the gradients as they land where it can, and double-buffers them
      for a delayed update where it can; grad_chunks() the reduced gradient chunks now, per param group.
    grads_replicated: every rank holds the same whole gradient (stage 0), so the norm needs no all-reduce.
    delayed: overlaps a host backend's update with the next step (hf_zero/optim/delayed.py).
    tp_comm, tp_replicated[g][k]: with tensor parallelism, the tp group and the element ranges of chunk k
      of group g that every tp rank holds alike (counted once in the gradient norm).
    """

    def __init__(self, backend: UpdateBackend, grads: GradientReducer,
                 grad_chunks: Callable[[], list[list[torch.Tensor]]], comm: Communicator, scaler: LossScaler,
                 config: ZeroConfig, grads_replicated: bool, delayed: DelayedUpdate | None = None,
                 tp_comm: Communicator | None = None, tp_replicated: list[list[list[tuple[int, int]]]] | None = None
                 ) -> None:
        self.backend, self.optimizer = backend, backend.optimizer
        self.grads, self.grad_chunks = grads, grad_chunks
        self.comm, self.scaler = comm, scaler
        self.tp_comm, self.tp_replicated = tp_comm, tp_replicated
        self.gradient_clipping = config.gradient_clipping
        self.grads_replicated = grads_replicated
        self.delayed = delayed
        backend.measure_grads_with(self.chunk_square_sum)
        # The unscaled global norm of the gradients the next step() applies, fp64 on the device, once computed.
        self.norm: torch.Tensor | None = None
        # The update is queued without the host reading the norm first when the device can skip it (torch's fused
        # Adam/AdamW, no dynamic loss scale, which must change on the host before the next backward).
        # The norm then comes to the host by a copy of its own, which whoever needs the step's outcome waits on:
        # the host stays ahead of the device instead of draining its queue once a step.
        self.decided_on_device = backend.skips_on_device and not scaler.dynamic and delayed is None
        self.norm_on_host = host_empty(1, torch.float64) if self.decided_on_device else None
        self.undecided: tuple[int, Copy] | None = None  # the last step the device decided, and its norm's copy

    @torch.no_grad()
    def norm_on_device(self) -> torch.Tensor:
        """The unscaled global gradient norm as a 0-dim fp64 tensor on the compute device, nothing waiting for it
        (one all-reduce), kept for the step that follows. inf or NaN when any rank's shard overflowed. Squares
        are summed in fp64 on the gradients' own device (fp32 sums over millions of elements drift by 1e-4
        relative, which moves clipping). At stages 2-3 the reducer measured each chunk as it landed (on the
        device, before an offloaded chunk went to the host): the sum is read, not taken again."""
        if self.norm is not None:
            return self.norm
        with span("grad_norm"):
            self.norm = self._global_norm()
        return self.norm

    def _global_norm(self) -> torch.Tensor:
        local_sq = self.grads.measured_square_sum()
        if local_sq is None:  # one fp64 sum per chunk, summed in chunk order as the reducer's are
            sums = self.backend.grad_square_sums(self.grad_chunks())
            local_sq = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64,
                                                                          device=self.comm.device)
        local_sq = local_sq.reshape(1).to(self.comm.device)
        if not self.grads_replicated:
            self.comm.all_reduce_(local_sq)
        if self.tp_comm is not None:
            self.tp_comm.all_reduce_(local_sq)
        root = local_sq[0].sqrt()
        return torch.div(root, root.new_full((), self.scaler.scale))  # a division, as the host's

    def chunk_square_sum(self, g: int, k: int, grad: torch.Tensor) -> torch.Tensor:
        """The fp64 sum of squares of chunk k of group g's gradient as this rank adds it to the global norm:
        with tensor parallelism the norm is summed over tp too, so an element every tp rank holds alike counts
        1/tp here."""
        square_sum = _square_sum(grad)
        if self.tp_comm is not None:
            for lo, hi in self.tp_replicated[g][k]:
                square_sum = square_sum - (1 - 1 / self.tp_comm.world_size) * _square_sum(grad[lo:hi])
        return square_sum

    @torch.no_grad()
    @spanned("optimizer_step")
    def step(self, step_number: int = 0, untouched: list[list[list[tuple[int, int]]]] | None = None
             ) -> tuple[float, bool] | None:
        """Unscales, clips and applies the update; returns the global norm and whether the step was applied (False:
        skipped, an overflow), or None where the device decides that (`decided_on_device`: `decided_step` tells).
        `step_number` (from 0) tells a delayed update whether its warm-up is over. `untouched[g][k]`: element
        ranges of chunk k of group g that keep their values and states (parameters no rank used, which torch's
        optimizers skip); not where `untouched_refused_by` names a setting (the engine refuses those)."""
        norm = self.norm_on_device()
        self.norm = None
        if self.decided_on_device:
            # The norm goes to the host first: whoever waits for it (the Trainer asks whether the step was skipped
            # right after it) leaves the update queued behind it.
            self.undecided = step_number, copy_to_host(self.norm_on_host, norm.reshape(1), "the gradient norm")
            # The clipping coefficient as the host computes it below, in fp64 on the device; where it is not
            # finite the flag skips the update.
            coef = 1.0 / self.scaler.scale
            if self.gradient_clipping > 0:  # one division, as the host's (clip / tensor takes a reciprocal first)
                coef = torch.div(norm.new_full((), self.gradient_clipping), norm + 1e-6).clamp(max=1.0) * coef
            found_inf = torch.isfinite(norm).logical_not().to(torch.float32)
            self._apply(lambda grads: self.backend.step(coef, grads, found_inf=found_inf), untouched)
            return None
        norm = norm.item()
        if not math.isfinite(norm):
            self.scaler.update(overflow=True)
            return norm, False
        coef = 1.0 / self.scaler.scale
        if self.gradient_clipping > 0:
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        self.finish_pending()
        if self.delayed is not None and self.delayed.overlaps(step_number):
            # The next backward refills the gradient shards while this update runs: it lands in the other set of
            # shards where the reducer keeps two, else the update keeps a copy of its own.
            grads = self.grad_chunks()
            if not self.grads.hand_over():
                grads = self.backend.take_grads(grads, keep=True)
            # The hyper-parameters are this step's: the scheduler sets the next step's while this one runs.
            settings = param_group_settings(self.optimizer)
            self.delayed.launch(lambda: self.backend.step(coef, grads, settings=settings))
        else:
            self._apply(lambda grads: self.backend.step(coef, grads), untouched)
        self.scaler.update(overflow=False)
        return norm, True

    def _apply(self, step: Callable[[list[list[torch.Tensor]]], None],
               untouched: list[list[list[tuple[int, int]]]] | None) -> None:
        """Runs the backend's `step` on the gradients and publishes its values, `untouched` ranges kept."""
        kept = self._copy_ranges(untouched or [])
        step(self.backend.take_grads(self.grad_chunks(), keep=False))
        self.backend.publish()
        for tensor, lo, hi, values in kept:
            tensor[lo:hi].copy_(values)

    @property
    def untouched_refused_by(self) -> str | None:
        """The setting under which `step` cannot leave element ranges untouched (parameters no rank used), or None
        when it can."""
        return "delayed_param_update" if self.delayed is not None else self.backend.untouched_refused_by

    def decided_step(self) -> tuple[int, float, bool] | None:
        """The last step the device decided (its `step_number`), its global norm and whether it was applied, once
        the norm's copy has landed (the host waits for that copy only); None when every such step was read."""
        if self.undecided is None:
            return None
        (step_number, landing), self.undecided = self.undecided, None
        landing.wait()
        norm = float(self.norm_on_host[0])
        return step_number, norm, math.isfinite(norm)

    def _copy_ranges(self, ranges: list[list[list[tuple[int, int]]]]
                     ) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """Copies of the masters, elementwise optimizer states and parameters over `ranges`."""
        kept = []
        for g, chunks in enumerate(ranges):
            for k, chunk_ranges in enumerate(chunks):
                if not chunk_ranges:
                    continue
                master, state = self.backend.chunk_state(g, k)
                tensors = [master, self.backend.param_chunks[g][k],
                           *(v for v in state.values() if is_elementwise(v, master))]
                kept += [(t, lo, hi, t[lo:hi].clone()) for t in tensors for lo, hi in chunk_ranges]
        return kept

    def finish_pending(self) -> bool:
        """Waits for a delayed update still running and gives its parameters to the chunks; True when
        there was one (the caller then shares the chunks with the other ranks)."""
        if self.delayed is None or not self.delayed.wait():
            return False
        self.backend.publish()
        return True

    def held_bytes(self) -> int:
        return self.backend.held_bytes()


NORM_PIECE = 1 << 18  # elements a CPU converts to fp64 at a time: 2 MiB, whatever the shard's size


def _square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The sum of squares of `grad`, in fp64, on its device. One multi-tensor `_foreach_norm` over pieces of
    NORM_PIECE elements, each accumulated in fp64: on a GPU its kernels read the gradient's own dtype and add in
    fp64 (a few launches a chunk); on a CPU each piece goes through an fp64 copy of 2 MiB. Measured piece by
    piece with `vector_norm`, it was 5,000 launches a step for a 1.3B model, which left an H100 waiting on the
    host (docs/BENCHMARKS.md)."""
    if grad.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=grad.device)
    norms = torch._foreach_norm(grad.reshape(-1).split(NORM_PIECE), 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def check_optimizer(optimizer: torch.optim.Optimizer, config: ZeroConfig) -> None:
    """Rejects optimizers the engine cannot shard (or offload as asked), before any work starts."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer built on model.parameters(); "
                        f"got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ZeroConfigError(f"optimizer {type(optimizer).__name__} needs a closure in step(), which re-runs the "
                         f"model; ZeRO shards the update and cannot do that. Use Adam, AdamW, SGD or another "
                         f"optimizer whose step() takes no closure.")
    if config.offload_optimizer == "nvme" and adamw_mode_of(optimizer) is None:
        raise ZeroConfigError(f"offload_optimizer nvme streams Adam/AdamW states; {type(optimizer).__name__} is not "
                         f"supported there (nor amsgrad or maximize). Use torch.optim.Adam, AdamW or "
                         f"hf_zero.ops.CPUAdam, or offload_optimizer cpu")
    if optimizer.state:
        raise ZeroConfigError("optimizer already has state (it has stepped); pass a fresh optimizer to "
                         "hf_zero.initialize and load its state through the engine")
