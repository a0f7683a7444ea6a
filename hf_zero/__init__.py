"""hf_zero: ZeRO (Zero Redundancy Optimizer) on PyTorch, wired into Hugging Face transformers."""
import importlib
from typing import Any

from hf_zero.settings.config import ZeroConfig, ZeroConfigError

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroSeq2SeqTrainer", "ZeroTrainer", "initialize"]
__version__ = "0.1.0"

# Imported on first use: the trainers import all of transformers' Trainer, and the engine DTensor and
# transformers' model utilities (1.2 s), which engine-only users and the hf-zero command's checks of its
# flags (before any process starts) should not pay for.
_LAZY = {"ZeroTrainer": "hf_zero.hf.trainer", "ZeroSeq2SeqTrainer": "hf_zero.hf.trainer",
         "ZeroEngine": "hf_zero.engine", "initialize": "hf_zero.engine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
