"""The process-group helpers' former import path, kept for scripts that import them from here
(hf_zero/runtime/launch.py)."""
from hf_zero.runtime.launch import free_port, init_distributed, spawn_gloo

__all__ = ["free_port", "init_distributed", "spawn_gloo"]
