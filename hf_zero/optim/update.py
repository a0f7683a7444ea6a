"""Update backends: where the fp32 masters and optimizer states of this rank's chunks live, and the update
that runs there. One per place: on the device (here), in host memory (hf_zero/optim/host.py), on NVMe
(hf_zero/optim/nvme.py). `ShardedOptimizer` (optimizer.py) keeps what is the same everywhere: the
gradient norm, clipping, the overflow check and the delayed update.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from hf_zero.runtime.device import HOST, LatestCopy
from hf_zero.zero.update_files import GradientFiles, ShardReader

# torch's optimizers whose fused step skips itself on a `found_inf` device flag, leaving the state as it was. Not
# subclasses, whose step() may not read the flag; not SGD, whose fused step leaves a first step's momentum buffer
# unfilled (torch.empty_like) when it skips.
SKIPPING_ON_DEVICE = (torch.optim.Adam, torch.optim.AdamW)


def param_group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters as they are now (`params` included, the same list). A step that runs
    later than it was asked for steps with these: a delayed update runs while the scheduler already sets the next
    step's learning rate in the live param groups (in place where it is a tensor, hence the copies)."""
    return [{key: value.clone() if torch.is_tensor(value) else value for key, value in group.items()}
            for group in optimizer.param_groups]


def is_elementwise(value: Any, master: torch.Tensor) -> bool:
    """Optimizer state with one value per element (Adam's moments), as opposed to per-step scalars."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel()


class UpdateBackend(ABC):
    """param_chunks[g][k]: the compute-dtype tensor of chunk k of param group g that this rank updates.
    `masters[g][k]` is what the user optimizer's param group g holds for it."""

    masters: list[list[torch.Tensor]]
    # Whether checkpoints load the optimizer state through the optimizer's own load_state_dict (in memory),
    # or the backend took it in load_chunk (NVMe).
    states_in_optimizer = True
    # The setting under which this backend steps every element, so that parameters no rank used cannot keep their
    # values and states as torch's optimizers leave them (None: it can leave ranges untouched).
    untouched_refused_by: str | None = None

    def __init__(self, optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                 chunks_lent: LatestCopy | None) -> None:
        self.optimizer, self.param_chunks = optimizer, param_chunks
        self.chunks_lent = chunks_lent
        self.master_shards: list[torch.Tensor] = []  # fp32 masters kept apart from the parameters, if any

    def _writable_chunks(self) -> list[list[torch.Tensor]]:
        """param_chunks, once no queued copy reads them any more (stage 3 with shards in host memory)."""
        if self.chunks_lent is not None:
            self.chunks_lent.wait()
        return self.param_chunks

    def _own_masters(self, values: list[list[torch.Tensor]], empty: Callable[[int], torch.Tensor],
                     consume: bool) -> list[list[torch.Tensor]]:
        """One contiguous fp32 master shard per param group (M_D) where `empty` allocates, filled chunk by chunk from
        `values` (no whole-shard temporary, on the device or anywhere); returns its chunks, cut as the
        parameter chunks are. `consume`: `values` is ours, and each chunk is let go once copied. The shard is
        allocated whole before the first copy, so an allocator counts both whole for the copy's duration (4 bytes
        a parameter / Nd more); a CPU's resident memory does not, as the shard's pages are written while the
        chunks' are given back."""
        self.master_shards = [empty(sum(c.numel() for c in chunks)) for chunks in self.param_chunks]
        masters = [list(torch.split(shard, [c.numel() for c in chunks]))
                   for shard, chunks in zip(self.master_shards, self.param_chunks)]
        for group_masters, group_values in zip(masters, values):
            for k, master in enumerate(group_masters):
                master.copy_(group_values[k].reshape(-1))
                if consume:
                    group_values[k] = None
        return masters

    def _retarget(self) -> None:
        """The user's param groups step this rank's masters from now on (their hyper-parameters stay)."""
        for group, masters in zip(self.optimizer.param_groups, self.masters):
            group["params"] = masters

    # Whether the update can be skipped by the device itself when the gradients are not finite (`step`'s
    # found_inf), so that the host need not read the gradient norm before queuing it.
    skips_on_device = False

    @abstractmethod
    def step(self, coef: float, grad_chunks: list[list[torch.Tensor]]) -> None:
        """Applies `coef` x the gradients to the masters; the new compute-dtype values are published next.
        (`DeviceUpdate.step` also takes the coefficient as a device tensor, and a device flag that skips it; the
        host backends take `settings`, the param groups' hyper-parameters of a step that runs in the background.)"""

    def publish(self) -> None:
        """Hands the last update's compute-dtype values to the parameter chunks."""

    def chunk_state(self, g: int, k: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """The fp32 master of chunk k of group g and its optimizer state."""
        master = self.masters[g][k]
        return master, self.optimizer.state.get(master, {})

    def load_chunk(self, g: int, k: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        """Sets chunk k of group g's fp32 master and its compute-dtype copy; the state goes through the
        optimizer's own load_state_dict (a backend keeping it elsewhere takes it here)."""
        self.masters[g][k].copy_(master)
        self._writable_chunks()[g][k].copy_(master)

    def gradient_files(self) -> GradientFiles | None:
        """Where stages 2-3 write the reduced gradients instead of memory (NVMe), or None."""
        return None

    def take_grads(self, grad_chunks: list[list[torch.Tensor]], keep: bool) -> list[list[torch.Tensor]]:
        """The gradients the next step() applies. `keep`: they must outlive the next backward, which refills
        the gradient shards while a delayed update runs (copies in host memory)."""
        return [[grad.to(HOST, copy=True) for grad in grads] for grads in grad_chunks] if keep else grad_chunks

    def measure_grads_with(self, square_sum: Callable[[int, int, torch.Tensor], torch.Tensor]) -> None:
        """How `grad_square_sums` measures chunk k of group g's gradient (the optimizer's, which knows
        tensor parallelism's replicas)."""
        self.square_sum = square_sum

    def grad_square_sums(self, grad_chunks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The fp64 sum of squares of every chunk's reduced gradient, in chunk order."""
        return [self.square_sum(g, k, grad) for g, grads in enumerate(grad_chunks) for k, grad in enumerate(grads)]

    def held_bytes(self) -> int:
        """Masters kept besides the parameters, and every tensor of the optimizer's state, in memory."""
        return sum(s.numel() * s.element_size() for s in self.master_shards) + sum(
            v.numel() * v.element_size() for state in self.optimizer.state.values()
            for v in state.values() if torch.is_tensor(v))

    def param_reader(self) -> ShardReader | None:
        """Where stage-3 units read their parameter chunks from instead of memory, when not from memory."""
        return None


class DeviceUpdate(UpdateBackend):
    """The optimizer steps on the compute device. In fp32 the parameter chunks are the masters, updated in
    place, with the reduced gradient chunks as their gradients. In lower precision each param group gets one
    contiguous fp32 master shard; gradients become fp32 only for the duration of the step, as the paper's
    12Ψ/Nd optimizer-state budget assumes."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_chunks: list[list[torch.Tensor]],
                 grad_chunks: list[list[torch.Tensor]], fp32_init: list[list[torch.Tensor]] | None,
                 chunks_lent: LatestCopy | None) -> None:
        super().__init__(optimizer, param_chunks, chunks_lent)
        self.mixed = fp32_init is not None
        if self.mixed:
            compute = next(c.device for chunks in param_chunks for c in chunks)
            self.masters = self._own_masters(fp32_init, lambda n: torch.empty(n, device=compute), consume=True)
        else:
            self.masters = param_chunks
            for masters, grads in zip(param_chunks, grad_chunks):
                for master, grad in zip(masters, grads):
                    master.grad = grad
        self._retarget()
        # torch's fused kernels take a device flag that leaves the parameters, states and step counts as they were
        # (what torch.amp.GradScaler hands them): a non-finite step is skipped without the host reading anything.
        self.skips_on_device = type(optimizer) in SKIPPING_ON_DEVICE and \
            all(group.get("fused") for group in optimizer.param_groups)

    def step(self, coef: float | torch.Tensor, grad_chunks: list[list[torch.Tensor]],
             found_inf: torch.Tensor | None = None) -> None:
        """`coef` may be a device tensor (the clipping coefficient as the device computed it), and `found_inf`
        (where `skips_on_device`) a float32 device flag that, when 1, makes the update leave everything as it was."""
        self._writable_chunks()
        scales = not isinstance(coef, float) or coef != 1.0
        for masters, grads in zip(self.masters, grad_chunks):
            for master, grad in zip(masters, grads):
                if self.mixed:
                    master.grad = grad.to(master.device, torch.float32)
                    grad = master.grad
                if scales:
                    grad.mul_(coef)
        if found_inf is not None:
            self.optimizer.found_inf = found_inf
        try:
            self.optimizer.step()
        finally:
            if found_inf is not None:
                del self.optimizer.found_inf
        if self.mixed:
            for masters, chunks in zip(self.masters, self.param_chunks):
                for master, chunk in zip(masters, chunks):
                    chunk.copy_(master)
                    master.grad = None
