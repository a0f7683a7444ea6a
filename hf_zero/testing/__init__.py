"""Test doubles for the device: a simulated GPU that plays CUDA's asynchrony on CPU and checks the stream order of
every op.

    simulated_gpu.py   the simulated timeline (hf_zero.runtime.timeline's strategy), `install` and `uninstall`
    copies.py          the copy engine: copies and collectives that land as late (or as early) as a GPU may land them
    stream_checker.py  the stream checker: every access to memory by a stream, refused unless a wait orders it
    dispatch.py        what the checker sees of torch's ops (a dispatch mode), and the simulated device's memory
    memory.py          host memory beside the simulated device's, and buffers as if pinned
    streams.py         which stream each thread queues on now

Plugged in from outside: at the first device work under HF_ZERO_SIMULATE_ASYNC (a rank's start), through the device
layer's one plug point (hf_zero/runtime/device.py), or by a test's setup (`simulated_gpu.install`). No other
production module imports it. It sees hf_zero.runtime and hf_zero.settings only.
"""
