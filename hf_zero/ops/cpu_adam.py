"""CPUAdam: torch.optim.AdamW's arguments, stepped by csrc/cpu_adam.cpp (ZeRO-Offload section 5.1).

The parameters are fp32 (the master weights when mixed precision is offloaded). A gradient may be
fp32, bf16 or fp16 (set `param.grad_dtype = None` first: torch refuses a gradient of another dtype
otherwise), and `mirror(param, copy)` names a bf16/fp16 (or fp32) tensor that receives the
updated values in the same pass over memory: the mixed-precision step reads the low-precision gradient
and writes the low-precision parameter without a separate conversion pass. `step(grad_scale=c)`
multiplies every gradient by c first (loss-scale unscaling and clipping folded into the same pass).

Where the extension cannot be built (no compiler), the step is torch's fused AdamW with the casts done
separately, and a warning says so once.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch.optim.adam import adam as torch_adam

from hf_zero.ops.build import load_extension
from hf_zero.runtime.device import check_host_access

logger = logging.getLogger("hf_zero")
_warned_fallback = False


def cpu_adam_kernel():
    """The compiled kernel module, or None (with a warning, once) when it cannot be built."""
    global _warned_fallback
    try:
        return load_extension("hf_zero_cpu_adam")
    except RuntimeError as error:
        if not _warned_fallback:
            logger.warning("%s; CPUAdam falls back to torch's fused AdamW (same results, one more pass over "
                           "memory for mixed precision)", error)
            _warned_fallback = True
        return None


class CPUAdam(torch.optim.Optimizer):
    """Adam (adamw_mode=False: L2 weight decay added to the gradient) or AdamW (adamw_mode=True, the
    default: decoupled weight decay) on fp32 CPU parameters."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, adamw_mode: bool = True) -> None:
        unsupported = {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                       "differentiable": differentiable}
        asked = [k for k, v in unsupported.items() if v]
        if asked:
            raise ValueError(f"CPUAdam does not support {asked}; use torch.optim.AdamW for those")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"CPUAdam needs lr, eps and weight_decay >= 0; got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam needs betas in [0, 1); got {betas}")
        # foreach and fused choose torch kernels; this optimizer has its own, so they change nothing.
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode))
        self.kernel = cpu_adam_kernel()
        self.mirrors: dict[torch.Tensor, torch.Tensor] = {}

    def mirror(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """After each step, `copy` (same size, fp32/bf16/fp16, contiguous) holds `param`'s new values."""
        if copy.numel() != param.numel() or not copy.is_contiguous():
            raise ValueError("CPUAdam.mirror needs a contiguous copy with as many elements as the parameter")
        self.mirrors[param] = copy

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                self._check(param)
                adam_step_with_state(group, group["adamw_mode"], self.state[param], param, param.grad,
                                     self.mirrors.get(param), grad_scale, self.kernel)
        return loss

    @staticmethod
    def _check(param: torch.Tensor) -> None:
        if param.device.type != "cpu" or param.dtype != torch.float32 or not param.is_contiguous():
            raise ValueError(f"CPUAdam steps contiguous fp32 CPU parameters; got {param.dtype} on {param.device}"
                             f"{'' if param.is_contiguous() else ', not contiguous'}")
        if param.grad.device.type != "cpu" or param.grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"CPUAdam needs fp32, bf16 or fp16 CPU gradients; got {param.grad.dtype} on "
                             f"{param.grad.device}")


def adam_step_with_state(group: dict[str, Any], adamw_mode: bool, state: dict[str, Any], param: torch.Tensor,
                         grad: torch.Tensor, out: torch.Tensor | None, grad_scale: float, kernel=None) -> None:
    """One step of `param` with an optimizer param group's hyper-parameters and torch Adam's state layout
    (`step`, `exp_avg`, `exp_avg_sq`), created at the first step as torch's Adam creates it."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
    state["step"] += 1
    beta1, beta2 = group["betas"]
    adam_step(param, grad, state["exp_avg"], state["exp_avg_sq"], out, int(state["step"].item()),
              float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"], adamw_mode, grad_scale, kernel)


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              out: torch.Tensor | None, step: int, lr: float, beta1: float, beta2: float, eps: float,
              weight_decay: float, adamw_mode: bool, grad_scale: float, kernel=None) -> None:
    """One Adam step on flat fp32 tensors in place; `out` gets the new values in its dtype. The kernel
    when built, else torch's fused AdamW."""
    grad, out = grad.reshape(-1), None if out is None else out.reshape(-1)
    for written in (param, exp_avg, exp_avg_sq, out):  # the host writes these; no queued copy may still read them
        if written is not None:
            check_host_access(written, writing=True)
    check_host_access(grad, writing=False)
    if kernel is not None:
        kernel.adam_step(param.reshape(-1), grad.contiguous(), exp_avg.reshape(-1), exp_avg_sq.reshape(-1), out,
                         step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale)
        return
    grad = grad.to(torch.float32) if grad_scale == 1.0 else grad.to(torch.float32) * grad_scale
    # The fused path counts the step itself, so it is given the count before this step.
    torch_adam([param.view(-1)], [grad], [exp_avg.view(-1)], [exp_avg_sq.view(-1)], [],
               [torch.tensor(float(step - 1))], fused=True, decoupled_weight_decay=adamw_mode, amsgrad=False,
               beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    if out is not None:
        out.copy_(param.view(-1))
