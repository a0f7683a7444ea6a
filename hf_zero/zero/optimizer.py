"""The user's torch optimizer, re-targeted at this rank's shard (stage 1 and up: P_os).

Each param group of the optimizer keeps its hyper-parameters; its `params` become this rank's
chunks of the group's flat buffer. In fp32 the chunks are updated in place (the parameters are the
master weights). In bf16/fp16 each group gets one contiguous fp32 master shard; gradients are
converted to fp32 only for the duration of the step, as the paper's 12Ψ/Nd optimizer-state budget
assumes. Unscaling, global-norm clipping and the overflow check happen here, once, on the shard.
With offload the masters, states and update live on the host (hf_zero/offload/).
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from hf_zero.comm import Communicator
from hf_zero.config import ZeroConfig
from hf_zero.offload.delayed import DelayedUpdate
from hf_zero.offload.host import HOST, HostAdam, adamw_mode_of, to_host_memory
from hf_zero.offload.nvme import NvmeAdamStates
from hf_zero.precision import LossScaler


class ShardedOptimizer:
    """Steps `optimizer` on the owned chunks.

    param_chunks[g][k]: compute-dtype tensor this rank updates (bucket k of group g).
    grad_chunks[g][k]: the reduced gradient of the same elements.
    fp32_init[g][k]: their fp32 starting values (mixed precision only: the masters' initial values).
    grads_replicated: every rank holds the same whole gradient (stage 0), so the norm needs no all-reduce.
    offload: the masters and optimizer states live in host memory and the update runs there
      (hf_zero/offload/host.py); `delayed` then overlaps it with the next step (hf_zero/offload/delayed.py).
    tp_comm, tp_replicated[g][k]: with tensor parallelism, the tp group and the element ranges of chunk k
      of group g that every tp rank holds alike (counted once in the gradient norm).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                 grad_chunks: list[list[torch.Tensor]], fp32_init: list[list[torch.Tensor]] | None,
                 comm: Communicator, scaler: LossScaler, config: ZeroConfig, grads_replicated: bool,
                 delayed: DelayedUpdate | None = None, tp_comm: Communicator | None = None,
                 tp_replicated: list[list[list[tuple[int, int]]]] | None = None) -> None:
        self.optimizer = optimizer
        self.param_chunks, self.grad_chunks = param_chunks, grad_chunks
        self.comm, self.scaler = comm, scaler
        self.tp_comm, self.tp_replicated = tp_comm, tp_replicated
        self.gradient_clipping = config.gradient_clipping
        self.grads_replicated = grads_replicated
        self.offload, self.delayed = config.offload_optimizer != "none", delayed
        # Separate fp32 masters in mixed precision, and whenever the update runs on the host.
        self.mixed = fp32_init is not None or self.offload
        fp32_init = param_chunks if fp32_init is None else fp32_init
        adamw_mode = adamw_mode_of(optimizer) if self.offload else None
        self.host_adam = HostAdam(optimizer, adamw_mode) if adamw_mode is not None else None
        self.nvme: NvmeAdamStates | None = None
        self.master_shards: list[torch.Tensor] = []
        self.masters: list[list[torch.Tensor]] = []
        if config.offload_optimizer == "nvme":
            # offload_param nvme: the compute-dtype parameters go into the same files' tile stream.
            param_dtype = param_chunks[0][0].dtype if config.offload_param == "nvme" else None
            self.nvme = NvmeAdamStates(config.nvme_path, comm.rank, [[c.numel() for c in cs] for cs in param_chunks],
                                       fp32_init, self.host_adam, config.nvme_tile_numel, param_dtype)
            if param_dtype is not None:
                for g, chunks in enumerate(param_chunks):
                    for k, chunk in enumerate(chunks):
                        self.nvme.write_chunk(g, k, {"param": chunk})
        for g, group in enumerate(optimizer.param_groups):
            if self.nvme is not None:  # the masters are in files; the groups keep the chunks as placeholders
                self.masters.append(param_chunks[g])
            elif self.mixed:
                shard = torch.cat([t.reshape(-1) for t in fp32_init[g]]).float()
                shard = to_host_memory(shard) if self.offload else shard
                self.master_shards.append(shard)
                self.masters.append(list(torch.split(shard, [c.numel() for c in param_chunks[g]])))
            else:
                self.masters.append(param_chunks[g])
                for master, grad in zip(param_chunks[g], grad_chunks[g]):
                    master.grad = grad
            group["params"] = self.masters[g]
        # Where the host update writes the new compute-dtype values: straight into the parameter chunk
        # when it is in host memory and nothing reads it meanwhile, else a host buffer copied over after.
        # NVMe: a step that fails half-way must leave the model at the last good step too. With the
        # parameters on NVMe as well, the step writes them to the files itself.
        staged = self.offload and (delayed is not None or self.nvme is not None
                                   or any(c.device != HOST for cs in param_chunks for c in cs))
        self.outs = [[to_host_memory(torch.zeros_like(c, device=HOST)) if staged else c for c in chunks]
                     for chunks in param_chunks] if self.offload and not self.params_on_nvme else None
        self.global_grad_norm: float | None = None
        self.norm_is_current = False  # computed for the gradients the next step() applies

    @torch.no_grad()
    def compute_grad_norm(self) -> float:
        """The unscaled global gradient norm (one all-reduce), kept for the step that follows.
        inf or NaN when any rank's shard overflowed."""
        local_sq = torch.zeros(1, dtype=torch.float32, device=self._device())
        for grads in self.grad_chunks:
            for grad in grads:  # offloaded gradients are in host memory, the collective runs on the device
                local_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).square().to(local_sq.device)
        if self.tp_comm is not None:  # summed over tp below: count each replicated element once, not tp times
            for ranges, grads in zip(self.tp_replicated, self.grad_chunks):
                for chunk_ranges, grad in zip(ranges, grads):
                    for lo, hi in chunk_ranges:
                        local_sq -= (1 - 1 / self.tp_comm.world_size) * torch.linalg.vector_norm(
                            grad[lo:hi], dtype=torch.float32).square().to(local_sq.device)
        if not self.grads_replicated:
            self.comm.all_reduce_(local_sq)
        if self.tp_comm is not None:
            self.tp_comm.all_reduce_(local_sq)
        self.global_grad_norm = math.sqrt(local_sq.item()) / self.scaler.scale
        self.norm_is_current = True
        return self.global_grad_norm

    @torch.no_grad()
    def step(self, step_number: int = 0) -> bool:
        """Unscales, clips and applies the update; returns False when the step was skipped (overflow).
        `step_number` (from 0) tells a delayed update whether its warm-up is over."""
        norm = self.global_grad_norm if self.norm_is_current else self.compute_grad_norm()
        self.norm_is_current = False
        scale = self.scaler.scale
        if not math.isfinite(norm):
            self.scaler.update(overflow=True)
            return False
        coef = 1.0 / scale
        if self.gradient_clipping > 0:
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        if self.delayed is not None and self.delayed.overlaps(step_number):
            # The next backward refills the gradient buffers while this update runs: it gets a copy.
            grads = [[grad.to(HOST, copy=True) for grad in grads] for grads in self.grad_chunks]
            self.finish_pending()
            self.delayed.launch(lambda: self._update(coef, grads))
        else:
            self.finish_pending()
            self._update(coef, self.grad_chunks)
            self._publish()
        self.scaler.update(overflow=False)
        return True

    def finish_pending(self) -> bool:
        """Waits for a delayed update still running and gives its parameters to the chunks; True when
        there was one (the caller then shares the chunks with the other ranks)."""
        if self.delayed is None or not self.delayed.wait():
            return False
        self._publish()
        return True

    def _update(self, coef: float, grad_chunks: list[list[torch.Tensor]]) -> None:
        """Applies `coef` * gradients to the masters; with offload, writes the new values to `self.outs`."""
        if self.nvme is not None:
            self.nvme.step(grad_chunks, self.outs, coef)
            return
        for g, grads in enumerate(grad_chunks):
            for k, (master, grad) in enumerate(zip(self.masters[g], grads)):
                if self.host_adam is not None:
                    self.host_adam.step_chunk(g, master, grad.to(HOST), self.outs[g][k], coef)
                elif self.mixed:
                    master.grad = grad.to(master.device, torch.float32).mul_(coef)
                elif coef != 1.0:
                    grad.mul_(coef)
        if self.host_adam is not None:
            return
        self.optimizer.step()
        if self.mixed:
            for g, masters in enumerate(self.masters):
                for k, master in enumerate(masters):
                    (self.param_chunks if self.outs is None else self.outs)[g][k].copy_(master)
                    master.grad = None

    @property
    def params_on_nvme(self) -> bool:
        return self.nvme is not None and self.nvme.holds_params

    def _publish(self) -> None:
        """Copies staged host values into the parameter chunks (non-blocking to a device), or points the
        units' reads at the files' new side."""
        if self.params_on_nvme:
            self.nvme.publish()
        if self.outs is None:
            return
        for outs, chunks in zip(self.outs, self.param_chunks):
            for out, chunk in zip(outs, chunks):
                if out is not chunk:
                    chunk.copy_(out, non_blocking=True)

    # ---- checkpoints ------------------------------------------------------------------------------
    def chunk_state(self, g: int, k: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """The fp32 master of chunk k of group g and its optimizer state, wherever they live."""
        if self.nvme is not None:
            values = self.nvme.read_chunk(g, k)
            master = values.pop("master")
            return master, ({"step": self.nvme.steps[g], **values} if self.nvme.steps[g] > 0 else {})
        master = self.masters[g][k]
        return master, self.optimizer.state.get(master, {})

    @torch.no_grad()
    def load_chunk(self, g: int, k: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        """Sets chunk k of group g's fp32 master (and its compute-dtype copy) and, on NVMe, its state.
        In memory the state goes through the optimizer's own load_state_dict (checkpoint.load)."""
        if self.nvme is not None:
            params = {"param": master} if self.params_on_nvme else {}
            self.nvme.write_chunk(g, k, {"master": master, **params,
                                         **{kind: state[kind] for kind in ("exp_avg", "exp_avg_sq") if kind in state}})
            if "step" in state:
                self.nvme.steps[g] = torch.tensor(float(state["step"]))
        else:
            self.masters[g][k].copy_(master)
        if self.mixed and not self.params_on_nvme:
            self.param_chunks[g][k].copy_(master)

    def _device(self) -> torch.device:
        return self.comm.device

    def held_bytes(self) -> int:
        """fp32 masters (mixed precision) plus every tensor in the optimizer's state, in memory (NVMe: the
        buffer pool; the files are reported by nvme.file_bytes())."""
        total = sum(s.numel() * s.element_size() for s in self.master_shards)
        if self.nvme is not None:
            total += self.nvme.pool_bytes()
        for state in self.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return total


def check_optimizer(optimizer: torch.optim.Optimizer, config: ZeroConfig) -> None:
    """Rejects optimizers the engine cannot shard (or offload as asked), before any work starts."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer built on model.parameters(); "
                        f"got {type(optimizer).__name__}")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"optimizer {type(optimizer).__name__} needs a closure in step(), which re-runs the "
                         f"model; ZeRO shards the update and cannot do that. Use Adam, AdamW, SGD or another "
                         f"optimizer whose step() takes no closure.")
    if config.offload_optimizer == "nvme" and adamw_mode_of(optimizer) is None:
        raise ValueError(f"offload_optimizer nvme streams Adam/AdamW states; {type(optimizer).__name__} is not "
                         f"supported there (nor amsgrad or maximize). Use torch.optim.Adam, AdamW or "
                         f"hf_zero.ops.CPUAdam, or offload_optimizer cpu")
    if optimizer.state:
        raise ValueError("optimizer already has state (it has stepped); pass a fresh optimizer to "
                         "hf_zero.initialize and load its state through the engine")
