"""Loss scaling for fp16 (paper section 3.1: mixed-precision training).

Written here rather than taken from torch.amp.GradScaler because the engine already learns about
overflow for free: the global gradient norm is one all-reduced sum of squares over every shard, and
it is inf or NaN exactly when any rank's shard overflowed. So the overflow verdict agrees on every
rank without a second collective, and the scaler only has to keep the scale.
"""
from __future__ import annotations

import torch

from hf_zero.settings.config import ZeroConfig


class LossScaler:
    """Static or dynamic loss scale. Dynamic: halve on overflow, double after `window` clean steps."""

    def __init__(self, config: ZeroConfig) -> None:
        self.dynamic = config.torch_dtype == torch.float16 and config.loss_scale == 0
        if config.loss_scale > 0:
            self.scale = float(config.loss_scale)
        else:
            self.scale = float(2 ** config.initial_scale_power) if self.dynamic else 1.0
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.clean_steps = 0

    def skipped_step_message(self, step: int, norm: float) -> str:
        """What happened when step `step` was skipped, in the terms of this precision."""
        if self.dynamic:
            return f"gradient overflow, step {step} skipped; loss scale is now {self.scale:g}"
        return (f"the gradients are not finite (global norm {norm}): the loss or a gradient is inf or NaN, so step "
                f"{step} was skipped and the parameters and optimizer states are as they were")

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
