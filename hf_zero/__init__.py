"""hf_zero: ZeRO (Zero Redundancy Optimizer) on PyTorch, wired into Hugging Face transformers."""
from typing import Any

from hf_zero.config import ZeroConfig, ZeroConfigError
from hf_zero.engine import ZeroEngine, initialize

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroSeq2SeqTrainer", "ZeroTrainer", "initialize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The trainers import all of transformers' Trainer; engine-only users should not pay for that.
    if name in ("ZeroTrainer", "ZeroSeq2SeqTrainer"):
        from hf_zero import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
