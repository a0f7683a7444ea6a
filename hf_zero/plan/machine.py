"""The machine a job is planned for, and the units a plan speaks in: apart from the simulation, so that `hf-zero
plan` reads its flags without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
KEYS = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "other")  # hf_zero.plan.memory.KINDS


@dataclass(frozen=True)
class Machine:
    """The machine a job is planned for. Defaults: a node of 8 A100s of 80 GB (312 bf16 TFLOPS, NVSwitch at 150
    GB/s per GPU, 200 Gb/s InfiniBand per GPU, PCIe 4 x16), the hf_zero CPU Adam's measured 0.54 ns per parameter
    rounded up for a host shared by 8 ranks, and no NVMe unless given (a DGX A100's four U.2 drives in RAID 0 move
    about 25 GB/s)."""
    gpu_memory: int = 80 * GB
    host_memory: int = 1000 * GB  # per node
    gpu_tflops: float = 312.0
    mfu: float = 0.4  # the fraction of the peak a step's matmuls reach (bench_zeropp's projection uses the same)
    intra_node_gbps: float = 150.0  # GB/s each GPU sends within its node
    inter_node_gbps: float = 25.0  # GB/s each GPU sends to other nodes
    pcie_gbps: float = 16.0  # GB/s between a GPU and its host
    cpu_adam_ns: float = 1.0  # host ns per parameter of a rank's offloaded step
    nvme_capacity: int = 0  # bytes of NVMe per node for ZeRO-Infinity's files; 0: none
    nvme_gbps: float = 25.0  # GB/s a node's NVMe reads and writes, shared by its ranks
