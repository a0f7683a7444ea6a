"""Test doubles for the device: a simulated GPU that checks the stream order of every op on CPU.

    simulated_gpu.py  copies that land late, streams and events, and the stream checker

Plugged in from outside: under HF_ZERO_SIMULATE_ASYNC at rank start, or by a test's setup. No production
module imports it except the device layer's one plug point (hf_zero/runtime/device.py).
"""
