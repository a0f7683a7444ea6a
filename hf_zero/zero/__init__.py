"""ZeRO-DP and ZeRO-R: how the model states are partitioned across the data-parallel ranks.

The package, in the order a reader meets it:

    partition.py    flat buffers, buckets and the chunk of each bucket a rank owns (small frozen dataclasses)
    holder.py       the interface of a stage's parameter holder, all the engine knows of a stage
    stages.py       the one place that maps zero_stage to its holder
    flat_params.py  stages 0-2: whole parameters in flat buffers, the all-gather after the step, and the
                    gradient reduction of stages 0-1 (all-reduce, in-place reduce-scatter)
    stage2.py       stage 2's reduction: gradients copied into fixed-size buckets and reduce-scattered into
                    a gradient shard during backward (stage 3 reuses it, one bucket per unit)
    grad_landing.py where the reduced chunks land, one strategy per offload_optimizer: a device shard, a pinned
                    host shard, NVMe files
    update_files.py what this layer asks of the update backend one layer up (NVMe gradient files, a reader of
                    parameter chunks), as protocols
    stage3/         stage 3: units gathered on use and freed after, their shards and construction, the
                    schedule of gathers and reductions, shared weights (its __init__ maps its files)
    reducer.py      bucket readiness during backward and the step's phase, shared by every stage
    activations.py  ZeRO-R: partitioned, offloaded, contiguous activation checkpoints
    zeropp.py       ZeRO++: quantized gathers and reductions, hierarchical (hpZ) secondary shards
    construct.py    models built shard by shard under stage 3: seeded, pretrained or stock initialisation

The optimizer step on the shards and where its states live are hf_zero/optim/, one layer up.
May import hf_zero.settings, hf_zero.runtime and hf_zero.ops.

The paper's symbols, as the code uses them:

    Ψ (psi)   the number of model parameters
    Nd        the data-parallel degree: ranks the states are partitioned over (`comm.world_size`)
    K         bytes of optimizer state per parameter: 12 for mixed-precision Adam (fp32 master, momentum,
              variance), 8 in fp32 where the parameters are the masters (hf_zero/runtime/memory.py)
    P_os      stage 1: optimizer states partitioned (4Ψ + 12Ψ/Nd bytes per rank in mixed precision)
    P_g       stage 2: gradients too (2Ψ + 14Ψ/Nd)
    P_p       stage 3: parameters too (16Ψ/Nd)
    P_a       partitioned activation checkpoints: a block's input split over the tensor-parallel group
    C_B       constant-size buffers: gradient buckets of `reduce_bucket_size` elements whatever Ψ
    M_D       memory defragmentation: one preallocated contiguous buffer per kind of state (flat buffers,
              grad and master shards, the activation checkpoint buffer)
"""
