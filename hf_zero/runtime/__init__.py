"""The runtime: devices, streams and collectives, and the processes that run them.

    device.py           the one device layer: every copy, stream and event, and host memory (pinned or not)
    comm.py             the one door for collectives, with its ledger and the cross-rank sequence check
    launch.py           process groups, torchrun and spawned ranks, timeouts and heartbeats
    dtypes.py           the dtypes as safetensors names them
    host_memory.py      the host allocator's settings for large allocations
    memory.py           measured memory: peak RSS, what a rank has left, model-state bytes
    tensor_parallel.py  the ("dp", "tp") DeviceMesh and tensor-parallel plans

May import hf_zero.settings only. Knows nothing of ZeRO: a stage, a bucket or a checkpoint is never named here.
"""
