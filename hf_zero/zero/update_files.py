"""What this layer asks of the update backend one layer up (hf_zero/optim/), as protocols its classes satisfy, so
that this layer never imports that one: with the optimizer states on NVMe, the files the reduced gradients of
stages 2-3 are added into, and with the parameters there too, where stage-3 units read their chunks."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from hf_zero.runtime.device import Copy


class GradientFiles(Protocol):
    """The reduced gradient chunks in files (hf_zero.optim.nvme.NvmeAdamStates)."""

    def accumulate_grad(self, g: int, k: int, values: torch.Tensor) -> Future:
        """Adds `values` (host memory, left as they are until the future is done) into chunk k of group g."""

    def clear_grads(self) -> None:
        """The next backward's gradients start from zero."""


class ShardReader(Protocol):
    """Host buffers the trained chunks of stage-3 units are read into from files (hf_zero.optim.nvme.ParamReader)."""

    def read(self, g: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(chunk k of group g, the buffer it lies in: given back with `release`)."""

    def release(self, buffer: torch.Tensor, copy: Copy) -> None:
        """Gives `buffer` back; `copy` (to the device) may still be reading it."""

    def pool_bytes(self) -> int:
        """Host memory the buffers hold."""


class UpdateFiles(Protocol):
    """What a parameter holder asks of the update backend once it exists (ParamHolder.attach)."""

    def gradient_files(self) -> GradientFiles | None:
        """Where stages 2-3 add the reduced gradients instead of memory, or None."""

    def param_reader(self) -> ShardReader | None:
        """Where stage-3 units read their trained chunks from instead of memory, or None."""
