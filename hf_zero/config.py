"""ZeroConfig: every engine setting in one typed place, validated before any work starts."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroConfigError(ValueError):
    """A setting has a value the engine cannot use; the message names the setting and what is allowed."""


@dataclass
class ZeroConfig:
    """Settings of the ZeRO engine. Sizes are in elements, as in DeepSpeed's configuration."""

    zero_stage: int = 2
    dtype: str = "fp32"
    # C_B: fixed-size gradient buckets, independent of model size (paper section 6.2).
    reduce_bucket_size: int = 5_000_000
    # Stages 1-2: at most this many parameter elements are being all-gathered at once after the step.
    allgather_bucket_size: int = 50_000_000
    overlap_comm: bool = True
    # Stage 3: how many parameter elements of upcoming units may be gathered ahead of use.
    prefetch_bucket_size: int = 50_000_000
    # Stage 3: parameters with fewer elements than this stay replicated on every rank.
    param_persistence_threshold: int = 0
    # Stage 3: class names of the modules gathered and freed as one unit; None uses the model's
    # `_no_split_modules` (transformers' block classes) or else the children of its ModuleLists.
    unit_module_classes: list[str] | None = None
    # Stage 3: free the root unit (embeddings, head) after forward and gather it again for backward, as
    # the paper's 3Ψ schedule does. Off by default: backward needs it at once, so keeping it saves Ψ_root
    # of all-gather per step for no extra peak memory (FSDP2 does the same with its root).
    reshard_root_after_forward: bool = False
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    # fp16 loss scaling: loss_scale 0 means dynamic, starting at 2**initial_scale_power.
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0

    @classmethod
    def from_any(cls, config: "ZeroConfig | dict[str, Any] | str | Path | None") -> "ZeroConfig":
        """Builds a validated config from a ZeroConfig, a dict, or a JSON file path."""
        if config is None:
            config = cls()
        elif isinstance(config, (str, Path)):
            config = json.loads(Path(config).read_text())
        if isinstance(config, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - known)
            if unknown:
                raise ZeroConfigError(f"unknown ZeRO setting(s) {unknown}; known settings: {sorted(known)}")
            config = cls(**config)
        if not isinstance(config, cls):
            raise ZeroConfigError(f"config must be a ZeroConfig, a dict or a JSON path, not {type(config).__name__}")
        config.validate()
        return config

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def validate(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ZeroConfigError(f"zero_stage must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        if self.dtype not in DTYPES:
            raise ZeroConfigError(f"dtype must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "gradient_accumulation_steps",
                     "loss_scale_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ZeroConfigError(f"{name} must be a positive integer; got {value!r}")
        for name in ("prefetch_bucket_size", "param_persistence_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ZeroConfigError(f"{name} must be an integer >= 0; got {value!r}")
        for name in ("gradient_clipping", "loss_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ZeroConfigError(f"{name} must be a number >= 0 (0 turns it off); got {value!r}")
        if self.loss_scale > 0 and self.dtype != "fp16":
            raise ZeroConfigError(f"loss_scale applies to fp16 only (bf16 and fp32 need no scaling); "
                                  f"got loss_scale={self.loss_scale} with dtype={self.dtype!r}")
        if self.min_loss_scale <= 0:
            raise ZeroConfigError(f"min_loss_scale must be > 0; got {self.min_loss_scale!r}")
        if not isinstance(self.initial_scale_power, int) or not 0 <= self.initial_scale_power <= 64:
            raise ZeroConfigError(f"initial_scale_power must be an integer in 0..64; got {self.initial_scale_power!r}")
        if self.unit_module_classes is not None and (
            not isinstance(self.unit_module_classes, (list, tuple))
            or not all(isinstance(c, str) for c in self.unit_module_classes)
        ):
            raise ZeroConfigError(
                f"unit_module_classes must be a list of module class names; got {self.unit_module_classes!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
