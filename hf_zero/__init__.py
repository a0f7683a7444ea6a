"""hf_zero: ZeRO (Zero Redundancy Optimizer) on PyTorch, wired into Hugging Face transformers."""
from hf_zero.config import ZeroConfig, ZeroConfigError
from hf_zero.engine import ZeroEngine, initialize

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "initialize"]
__version__ = "0.1.0"
