"""The CPU Adam step (ZeRO-Offload 5.1): hf_zero's C++ kernel beside torch's AdamW and DeepSpeed's
CPU Adam, on N elements with all of this machine's threads, and the memory-bandwidth bound.

  python benchmarks/bench_cpu_adam.py --numel 1e8 --repeats 5

Each variant is timed `repeats` times after one warm-up step, round-robin, and reported as the median.
"Mixed" is what offloaded mixed-precision training needs per step: bf16 gradients in, fp32 master and
moments updated, bf16 parameters out. hf_zero does it in one pass; torch needs the gradient cast to
fp32 first and the parameter cast back after its fused step (both timed). The bound is the bytes one
update must read and write (28 per element either way: fp32 reads p, g, m, v and writes p, m, v;
mixed reads a 2-byte gradient and writes a 2-byte parameter besides) over the copy bandwidth measured
in the same run: the higher of a large copy's and a large in-place add's bytes per second (read plus
written), so the bound is the stricter one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_zero.ops import adam_step, cpu_adam_kernel  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES_PER_ELEMENT = 28


def bandwidths(numel: int, repeats: int) -> dict[str, float]:
    """Bytes moved per second by a copy (dst = src) and by an in-place add (a += b), both threaded by
    torch. A copy's destination is also read by the CPU before it is written (write-allocate), which
    the byte count leaves out; the in-place add reads and writes the same lines, as Adam does."""
    a, b = torch.randn(numel), torch.randn(numel)
    probes = {"copy": (lambda: a.copy_(b), 8), "in-place add": (lambda: a.add_(b), 12)}
    found = {}
    for name, (run, bytes_per_element) in probes.items():
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        found[name] = bytes_per_element * numel / statistics.median(times)
    return found


def variants(numel: int) -> dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen)
    g32 = torch.randn(numel, generator=gen) * 1e-2
    g16 = g32.to(torch.bfloat16)
    m, v = torch.zeros(numel), torch.zeros(numel)
    p16 = torch.empty(numel, dtype=torch.bfloat16)
    kernel = cpu_adam_kernel()
    step = [0]

    def ours(grad, out):
        def run():
            step[0] += 1
            adam_step(p, grad, m, v, out, step[0], **HYPER, adamw_mode=True, grad_scale=1.0, kernel=kernel)
        return run

    def torch_adamw(fused: bool, mixed: bool):
        param = p.clone().requires_grad_()
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=fused,
                                foreach=not fused)

        def run():
            param.grad = g16.float() if mixed else g32  # the cast an offloaded bf16 gradient needs
            opt.step()
            if mixed:
                p16.copy_(param.detach())  # and the cast back to the compute dtype
        return run

    found = {
        "hf_zero fp32": ours(g32, None),
        "hf_zero mixed (bf16 in/out)": ours(g16, p16),
        "torch AdamW fused fp32": torch_adamw(True, False),
        "torch AdamW fused + casts (mixed)": torch_adamw(True, True),
        "torch AdamW foreach fp32": torch_adamw(False, False),
    }
    deepspeed = deepspeed_cpu_adam(p, g32)
    if deepspeed is not None:
        found["DeepSpeed CPU Adam fp32"] = deepspeed
    return found


def deepspeed_cpu_adam(param: torch.Tensor, grad: torch.Tensor) -> Callable[[], None] | None:
    """One step of DeepSpeed's CPU Adam (its own op, built by DeepSpeed) on a copy of `param` with the fp32 gradient
    `grad`; None where DeepSpeed is missing or cannot build it (the reference is optional: stderr says why)."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds_param = param.clone().requires_grad_()
        ds_opt = DeepSpeedCPUAdam([ds_param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
    except Exception as error:
        print(f"DeepSpeed CPU Adam not available: {type(error).__name__}: {str(error)[:200]}", file=sys.stderr)
        return None

    def step() -> None:
        ds_param.grad = grad
        ds_opt.step()
    return step


def median_seconds(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Each run once to warm up (first-touch page faults, thread pools, lazy builds), then `repeats` times
    round-robin, so that drift of the machine hits all alike: the median seconds of each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=1e8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    numel = int(args.numel)
    medians = median_seconds(variants(numel), args.repeats)
    measured = bandwidths(numel, args.repeats)
    bandwidth = max(measured.values())
    bound = BYTES_PER_ELEMENT * numel / bandwidth
    report = {"numel": numel, "threads": torch.get_num_threads(), "isa": cpu_adam_kernel().isa(),
              "bandwidth_GBps": {k: v / 1e9 for k, v in measured.items()}, "bound_s": bound,
              "variants": {name: {"median_s": s, "params_per_s": numel / s, "of_bound": bound / s}
                           for name, s in medians.items()}}
    print(json.dumps(report, indent=1))
    print(f"\n{numel:.0e} elements, {report['threads']} threads, {report['isa']}; bandwidth "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in measured.items()) + f"; bound {bound * 1e3:.0f} ms")
    print("| variant | median ms | Mparams/s | % of bound |")
    print("|---|---|---|---|")
    for name, s in medians.items():
        print(f"| {name} | {s * 1e3:.0f} | {numel / s / 1e6:.0f} | {100 * bound / s:.0f}% |")
    fused = medians["torch AdamW fused fp32"]
    print(f"\nmixed vs torch fused + casts: {medians['torch AdamW fused + casts (mixed)'] / medians['hf_zero mixed (bf16 in/out)']:.2f}x; "
          f"fp32 vs torch fused: {fused / medians['hf_zero fp32']:.2f}x")


if __name__ == "__main__":
    main()
