"""ZeroConfig's former import path, kept for code that imports it from here (hf_zero/settings/config.py)."""
from hf_zero.settings.config import ZeroConfig, ZeroConfigError

__all__ = ["ZeroConfig", "ZeroConfigError"]
