"""The host's part of an offloaded step (ZeRO-Offload), in nanoseconds per parameter of the rank's shard,
beside the floor this host's memory sets and DeepSpeed's CPU Adam on the same shard.

  python -m benchmarks.bench_offload_host --numel 5e7 --repeats 5

A shard of `numel` parameters as a rank offloading bf16 training with fp32 masters holds it: a bf16 gradient shard,
fp32 masters and Adam moments, bf16 parameters out. Per phase, what a straightforward host step does and what
the engine does, each timed here (medians of `repeats`, round-robin after a warm-up):
  norm      before: the fp64 sum of squares of the host gradient shard, 2 MiB pieces converted to fp64
            (hf_zero.optim.optimizer._square_sum, which the step ran over every chunk); now: nothing on the host, the
            device measures each chunk as it lands.
  landing   before: each bucket's chunk added into the host shard, which was zero-filled every step; now: nothing
            on the host, the chunks are copied into place by DMA.
  Adam      the CPU Adam over the shard, bf16 gradient in and bf16 parameter out in one pass (hf_zero's kernel,
            as the engine calls it, on the engine's thread count: cores / local processes).
  copy back DMA either way; before it started after the last chunk's Adam, now after each chunk's. Not a host cost,
            and not measurable without a device: the GPU evidence run shows it (benchmarks/gpu_evidence.py).
The floor: an Adam step must read and write 28 bytes per parameter (p, m, v in fp32 read and written, a bf16
gradient read and a bf16 parameter written), at the bandwidth of a STREAM-like triad done in place as Adam updates
(a += s*c in fp32: 12 bytes an element, and no write-allocate read that would go uncounted) measured here on the
same threads. DeepSpeed's CPU Adam (DeepSpeedCPUAdam, built by DeepSpeed's own op builder)
steps the same shard with fp32 gradients, as its ZeRO-Offload does (its gradient buffer is fp32), when DeepSpeed is
installed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_cpu_adam import HYPER, deepspeed_cpu_adam, median_seconds  # noqa: E402
from hf_zero.ops import adam_step, cpu_adam_kernel  # noqa: E402
from hf_zero.optim.optimizer import _square_sum  # noqa: E402
from hf_zero.settings.environment import cpu_adam_threads  # noqa: E402

ADAM_BYTES = 28  # per parameter: p, m, v read and written in fp32, a bf16 gradient read, a bf16 parameter written
TRIAD_BYTES = 12  # a += s*c in fp32: two reads, one write
BUCKET = 1 << 23  # elements of a bucket's chunk for the landing before (the engine's default reduce bucket)


def phases(numel: int) -> dict[str, Callable[[], None]]:
    """Each timed phase, on one shard."""
    gen = torch.Generator().manual_seed(0)
    masters = torch.randn(numel, generator=gen)
    grad = (torch.randn(numel, generator=gen) * 1e-2).to(torch.bfloat16)
    incoming = grad.clone()
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(numel, dtype=torch.bfloat16)
    a, c = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    kernel = cpu_adam_kernel()
    step = [0]

    def hf_zero_adam() -> None:
        step[0] += 1
        adam_step(masters, grad, exp_avg, exp_avg_sq, out, step[0], **HYPER, adamw_mode=True, grad_scale=1.0,
                  kernel=kernel)

    def landing_before() -> None:
        grad.zero_()
        for lo in range(0, numel, BUCKET):
            grad[lo:lo + BUCKET].add_(incoming[lo:lo + BUCKET])

    found = {"norm before (host)": lambda: _square_sum(grad).item(),
             "landing before (host)": landing_before,
             "Adam: hf_zero (bf16 in, bf16 out)": hf_zero_adam,
             "triad": lambda: a.add_(c, alpha=1e-3)}
    deepspeed = deepspeed_cpu_adam(masters, grad.float())
    if deepspeed is not None:
        found["Adam: DeepSpeedCPUAdam (fp32 in, fp32 out)"] = deepspeed
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=5e7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    numel = int(args.numel)
    threads, why = cpu_adam_threads()
    torch.set_num_threads(threads)
    ns = {name: seconds / numel * 1e9 for name, seconds in median_seconds(phases(numel), args.repeats).items()}
    triad_bandwidth = TRIAD_BYTES / ns.pop("triad")  # bytes per ns = GB/s
    floor = ADAM_BYTES / triad_bandwidth
    ours = ns["Adam: hf_zero (bf16 in, bf16 out)"]
    before = ns["norm before (host)"] + ns["landing before (host)"] + ours
    report = {"numel": numel, "threads": threads, "threads_why": why, "isa": cpu_adam_kernel().isa(),
              "triad_GBps": triad_bandwidth, "adam_floor_ns_per_param": floor, "ns_per_param": ns,
              "host_step_before_ns_per_param": before, "host_step_now_ns_per_param": ours}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"\n{numel:.0e} parameters, {threads} threads ({why}), {report['isa']}; triad {triad_bandwidth:.1f} GB/s, "
          f"so an Adam step's floor is {floor:.2f} ns a parameter")
    print("| phase | host ns / parameter | x the Adam floor |")
    print("|---|---|---|")
    for name, value in ns.items():
        print(f"| {name} | {value:.2f} | {value / floor:.2f} |")
    print(f"| host step before (norm + landing + Adam) | {before:.2f} | {before / floor:.2f} |")
    print(f"| host step now (Adam) | {ours:.2f} | {ours / floor:.2f} |")
    ds = ns.get("Adam: DeepSpeedCPUAdam (fp32 in, fp32 out)")
    if ds is not None:
        print(f"\nhf_zero's Adam takes {ours / ds:.2f}x DeepSpeedCPUAdam's time on the same shard")


if __name__ == "__main__":
    main()
