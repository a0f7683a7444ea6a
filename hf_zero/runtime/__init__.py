"""The runtime: devices, streams and collectives, and the processes that run them.

    device.py           the one device layer: every copy, stream and event, and host memory (pinned or not);
                        its one plug point installs the simulated GPU (hf_zero.testing) under HF_ZERO_SIMULATE_ASYNC
    timeline.py         what a timeline of device work does, one strategy; the CPU's (immediate) is its own
    cuda_timeline.py    CUDA's timeline: streams, events, non-blocking copies, HF_ZERO_CUDA_DELAY
    pinned.py           host memory page-locked for the whole run, to the byte
    comm.py             the one door for collectives (`Communicator`)
    ledger.py           what the collectives sent, as the ZeRO paper counts it, and over which links
    sequence_check.py   the cross-rank check that every rank issues the same collectives, and errors naming them
    groups.py           the process groups and device meshes, built in one place
    launch.py           the default process group, torchrun and spawned ranks, timeouts and heartbeats
    dtypes.py           the dtypes as safetensors names them
    host_memory.py      the host allocator's settings for large allocations; start-up objects frozen out of
                        Python's cyclic collector
    memory.py           measured memory: peak RSS, what a rank has left, model-state bytes
    tensor_parallel.py  the ("dp", "tp") DeviceMesh and tensor-parallel plans
    trace.py            trace spans: each phase of a step named in a torch.profiler trace

May import hf_zero.settings only (device.py also names the simulated GPU, by its one plug point). Knows nothing of
ZeRO: a stage, a bucket or a checkpoint is never named here.
"""
