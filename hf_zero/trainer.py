"""The Trainer classes' former import path, kept for code that imports them from here (hf_zero/hf/trainer.py)."""
from hf_zero.hf.trainer import (
    ZeroOptimizer,
    ZeroSeq2SeqTrainer,
    ZeroTrainer,
    ZeroTrainerMixin,
)

__all__ = ["ZeroOptimizer", "ZeroSeq2SeqTrainer", "ZeroTrainer", "ZeroTrainerMixin"]
