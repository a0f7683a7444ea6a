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

import torch

from hf_zero.ops import CPUAdam, adam_step_with_state, cpu_adam_kernel

HOST = torch.device("cpu")


def to_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, pinned when there is an accelerator to copy to and from."""
    tensor = tensor.to(HOST)
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


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


class HostAdam:
    """Steps the masters of an Adam/AdamW with the C++ kernel, keeping torch's state layout."""

    def __init__(self, optimizer: torch.optim.Optimizer, adamw_mode: dict[int, bool]) -> None:
        self.optimizer, self.adamw_mode = optimizer, adamw_mode
        self.kernel = cpu_adam_kernel()

    @torch.no_grad()
    def step_chunk(self, g: int, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None,
                   grad_scale: float, state: dict[str, torch.Tensor] | None = None) -> None:
        """One update of `master` (fp32, host) from `grad` (any float dtype, host) times grad_scale;
        `out` (host) receives the new values in its dtype. `state` defaults to optimizer.state[master]."""
        adam_step_with_state(self.optimizer.param_groups[g], self.adamw_mode[g],
                             self.optimizer.state[master] if state is None else state, master, grad, out,
                             grad_scale, self.kernel)
