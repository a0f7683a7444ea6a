"""The ZeRO paper's model-state accounting (section 5, Figure 1), in bytes per rank.

Mixed-precision Adam: compute-dtype parameters (2Ψ) and gradients (2Ψ), plus K=12 bytes of
optimizer state per parameter (fp32 master, momentum, variance). In fp32 the parameters are the
master weights, so parameters 4Ψ, gradients 4Ψ and K=8 (momentum, variance).
Stage 1 divides the optimizer states by Nd, stage 2 the gradients too, stage 3 everything.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


def model_state_bytes(stage: int, psi: int, nd: int, dtype: str = "bf16",
                      reduce_dtype: str | None = None) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and Adam optimizer states, as the paper counts them. With a
    `reduce_dtype` (ZeroConfig.reduce_dtype), stages 2-3 keep their gradient shard in it; stages 0-1 keep
    the parameters' own `.grad`."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3; got {stage!r}")
    if dtype not in BYTES_PER_ELEMENT:
        raise ValueError(f"dtype must be one of {sorted(BYTES_PER_ELEMENT)}; got {dtype!r}")
    element = BYTES_PER_ELEMENT[dtype]
    gradient = BYTES_PER_ELEMENT[reduce_dtype or dtype] if stage >= 2 else element
    k = 8 if dtype == "fp32" else 12
    return {
        "parameters": element * psi / (nd if stage >= 3 else 1),
        "gradients": gradient * psi / (nd if stage >= 2 else 1),
        "optimizer_states": k * psi / (nd if stage >= 1 else 1),
    }


def communication_elements(stage: int, psi: int) -> int:
    """Elements each rank moves per step (section 7): 2Ψ for stages 0-2, 3Ψ for stage 3."""
    return 3 * psi if stage == 3 else 2 * psi


# The share of what a rank has left that an automatic budget (stage 3's units kept gathered) may take: the rest is
# for what the loop itself allocates (activations, generated tokens, the allocator's fragmentation).
BUDGET_SHARE = 0.5


def memory_left(device: "torch.device", ranks_on_node: int) -> tuple[int, str]:
    """The bytes this rank can still take where `device` holds its tensors, and where that figure comes from. On a
    GPU: what the driver reports free, plus what torch's allocator holds unused, less what the steps so far took
    beyond what is allocated now (their peak comes back at the next step). On a CPU: the host memory available,
    shared by the `ranks_on_node` processes of this node. A plan's timeline says what its simulated device has left."""
    import psutil
    import torch

    from hf_zero.runtime.device import timeline

    planned = timeline().memory_left()
    if planned is not None:
        return planned
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        left = free + torch.cuda.memory_reserved(device) - allocated_peak(device)
        return max(0, left), f"{device}'s free memory after the step's peak"
    available = psutil.virtual_memory().available
    return available // ranks_on_node, f"the host's available memory over {ranks_on_node} local rank(s)"


def budget_of_every_rank(device: "torch.device", comm: Any) -> tuple[int, str]:
    """BUDGET_SHARE of the bytes memory_left says this rank has, the smallest rank's for every rank of `comm` (a
    Communicator): a budget that decides which collectives run (buckets cut, units kept gathered) must be the same on
    every rank. Returns the bytes and where the figure comes from."""
    left, where = memory_left(device, comm.ranks_per_node)
    budgets = comm.all_gather_object(int(left * BUDGET_SHARE))
    smallest = min(budgets)
    where = f"{BUDGET_SHARE:.0%} of {where}" + (f" (rank {budgets.index(smallest)}'s, the smallest)"
                                                 if smallest < budgets[comm.rank] else "")
    return smallest, where


def reset_peak_rss() -> None:
    """Starts a new peak-resident-memory window for `peak_rss` (Linux: writing 5 to /proc/self/clear_refs
    resets the high-water mark). ru_maxrss cannot be reset, and after fork+exec it can even report the
    parent's size, which is why the window is kept here."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """This process's peak resident memory in bytes since `reset_peak_rss` (or since it started)."""
    return _status_bytes("VmHWM")


def current_rss() -> int:
    """This process's resident memory in bytes now."""
    return _status_bytes("VmRSS")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line; memory is measured on Linux only")


def start_measuring(device: "torch.device") -> int:
    """Starts a new peak window for `measured_peak` where `device` holds the run's tensors; returns the baseline:
    what is in use before the model is built (a GPU's allocated bytes, the host's resident memory)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _peak_before_restart.pop(str(device), None)
        return torch.cuda.memory_allocated(device)
    reset_peak_rss()
    return current_rss()


# Per GPU, the most torch's allocator had handed out before `restart_peak` began a new window: the steps' peak,
# which memory_left keeps counting (it comes back at the next step).
_peak_before_restart: dict[str, int] = {}


def restart_peak(device: "torch.device") -> None:
    """A new peak window for `measured_peak` in the middle of a run, its baseline kept. On a GPU this restarts torch's
    own peak counter (what transformers' memory metrics read too); memory_left still counts the earlier peak."""
    import torch

    if device.type == "cuda":
        _peak_before_restart[str(device)] = allocated_peak(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def allocated_peak(device: "torch.device") -> int:
    """The most torch's allocator has handed out at once on GPU `device`, across `restart_peak`s."""
    import torch

    return max(torch.cuda.max_memory_allocated(device), _peak_before_restart.get(str(device), 0))


def measured_peak(device: "torch.device", baseline: int) -> int:
    """The most this run took at once since `start_measuring`, above its baseline: torch's allocator's peak on a
    GPU, the peak resident memory on the host."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    return peak_rss() - baseline


def allocator_peak(profiler: "torch.profiler.profile") -> int:
    """The most bytes torch's allocator had handed out at once while `profiler` (torch.profiler, run with
    profile_memory=True) recorded: its allocation and free events summed in time order. A CPU's allocator keeps no
    peak of its own (a GPU's does: max_memory_allocated)."""
    from torch._C._profiler import _EventType

    changes, nodes = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    live = peak = 0
    # By time alone: a free and an allocation at the same nanosecond stay in the order recorded.
    for _, change in sorted(changes, key=lambda event: event[0]):
        live += change
        peak = max(peak, live)
    return peak
