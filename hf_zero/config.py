"""ZeroConfig: every engine setting in one typed place, validated before any work starts."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


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
    # ZeRO-Offload / ZeRO-Infinity: where this rank's optimizer states (stages 1-3) and parameter
    # shards (stage 3) live; nvme needs nvme_path. delayed_param_update overlaps the CPU step with the
    # next forward and backward (ZeRO-Offload section 5.2).
    offload_optimizer: str = "none"
    offload_param: str = "none"
    nvme_path: str | None = None
    # NVMe: elements per tile streamed through the pool of 3 host buffer sets (3 x 12 bytes per element).
    nvme_tile_numel: int = 8_000_000
    delayed_param_update: bool = False
    # Ordinary steps before the delayed update starts (the paper: the first steps move the most).
    delayed_param_update_warmup: int = 10
    # ZeRO-R: every transformer block checkpointed, its input checkpoint split across the tensor-parallel
    # group (P_a) and/or kept in host memory (P_a+cpu), in one contiguous buffer per step (M_D).
    partition_activations: bool = False
    cpu_checkpointing: bool = False

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

    def validate(self, name: Callable[[str], str] = str) -> None:
        """Raises ZeroConfigError on the first bad setting. `name(key)` is how a message names a setting:
        the key itself for engine configs, the command-line flag for ZeroTrainingArguments."""
        def fail(key: str, message: str) -> None:
            raise ZeroConfigError(f"{name(key)} {message}")

        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            fail("zero_stage", f"must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        if self.dtype not in DTYPES:
            fail("dtype", f"must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "gradient_accumulation_steps",
                    "loss_scale_window", "nvme_tile_numel"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(key, f"must be a positive integer; got {value!r}")
        for key in ("prefetch_bucket_size", "param_persistence_threshold", "delayed_param_update_warmup"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                fail(key, f"must be an integer >= 0; got {value!r}")
        for key in ("gradient_clipping", "loss_scale"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or value < 0:
                fail(key, f"must be a number >= 0 (0 turns it off); got {value!r}")
        if self.loss_scale > 0 and self.dtype != "fp16":
            fail("loss_scale", f"applies to fp16 only (bf16 and fp32 need no scaling); got "
                               f"{name('loss_scale')}={self.loss_scale} with {name('dtype')}={self.dtype!r}")
        if self.min_loss_scale <= 0:
            fail("min_loss_scale", f"must be > 0; got {self.min_loss_scale!r}")
        if not isinstance(self.initial_scale_power, int) or not 0 <= self.initial_scale_power <= 64:
            fail("initial_scale_power", f"must be an integer in 0..64; got {self.initial_scale_power!r}")
        if self.unit_module_classes is not None and (
            not isinstance(self.unit_module_classes, (list, tuple))
            or not all(isinstance(c, str) for c in self.unit_module_classes)
        ):
            fail("unit_module_classes", f"must be a list of module class names; got {self.unit_module_classes!r}")
        self._validate_offload(name, fail)

    def _validate_offload(self, name: Callable[[str], str], fail: Callable[[str, str], None]) -> None:
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                fail(key, f"must be one of {', '.join(OFFLOAD_DEVICES)}; got {getattr(self, key)!r}")
        conflict = offload_conflict(self.zero_stage, self.offload_optimizer, self.offload_param, name)
        if conflict:
            raise ZeroConfigError(conflict)
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        if uses_nvme and not self.nvme_path:
            fail("nvme_path", f"is required when {name('offload_optimizer')} or {name('offload_param')} is nvme")
        if self.nvme_path and not uses_nvme:
            fail("nvme_path", f"is set but nothing is offloaded to nvme; set {name('offload_optimizer')} "
                              f"or {name('offload_param')} to nvme, or drop {name('nvme_path')}")
        if self.offload_param == "nvme" and self.offload_optimizer != "nvme":
            # The parameters are written in the optimizer's NVMe tile stream, so that a step lands whole or
            # not at all; with the optimizer states in host memory (12 bytes per element) the parameters'
            # 2-4 bytes on disk would save little.
            fail("offload_param", f"nvme needs {name('offload_optimizer')} nvme (the parameters are written in "
                                  f"the optimizer's NVMe stream); got {name('offload_optimizer')} "
                                  f"{self.offload_optimizer}. Set both to nvme, or {name('offload_param')} cpu")
        if self.nvme_path and uses_nvme:
            from hf_zero.offload.nvme import NvmeError, check_nvme_path
            try:
                check_nvme_path(self.nvme_path)
            except NvmeError as error:
                fail("nvme_path", str(error).removeprefix("nvme_path "))
        if self.delayed_param_update and self.offload_optimizer == "none":
            fail("delayed_param_update", f"overlaps the CPU optimizer step; it needs {name('offload_optimizer')} "
                                         f"cpu or nvme")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def offload_conflict(zero_stage: int, offload_optimizer: str, offload_param: str,
                     name: Callable[[str], str] = str) -> str | None:
    """Why this offload cannot run at this stage, or None: the one rule the engine's settings, the
    Trainer flags and `hf-zero estimate` all apply. `name(key)` spells each setting in the message."""
    if offload_param != "none" and zero_stage != 3:
        return (f"{name('offload_param')} needs {name('zero_stage')} 3 (only stage 3 partitions parameters); "
                f"got {name('offload_param')} {offload_param} with {name('zero_stage')} {zero_stage}")
    if offload_optimizer != "none" and zero_stage == 0:
        return (f"{name('offload_optimizer')} needs {name('zero_stage')} 1, 2 or 3 (each rank offloads its own "
                f"partition); got {name('zero_stage')} 0")
    return None

