"""The optimizer step on this rank's shard, and where its states live (ZeRO-Offload, ZeRO-Infinity).

    update.py     UpdateBackend: masters and optimizer states on the device
    host.py       the states in host memory, stepped by the C++ CPU Adam or the user's optimizer
    nvme.py       the states on NVMe, streamed through host memory in tiles
    delayed.py    the delayed parameter update: the host step overlapping the next forward and backward
    optimizer.py  ShardedOptimizer: the user's optimizer on this rank's chunks; norm, clipping, overflow
    precision.py  dynamic loss scaling for fp16

May import hf_zero.settings, hf_zero.runtime, hf_zero.ops and hf_zero.zero.
"""
