"""The ZeRO paper's Table 1 (model states per device for 7.5B, 128B and 1T over 1 to 1024 GPUs, mixed-precision
Adam, K = 12) beside what `hf-zero plan` measures for the closest models of the zoo: each stage's parameters,
gradients and optimizer states held on rank 0's device between steps (gradients at the end of backward), the
engine's own code run as one rank of each world.

  python -m benchmarks.bench_plan_scale
  python -m benchmarks.bench_plan_scale --models zero-72x3072 --gpus 4 64 1024
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAPER_NDS = (1, 4, 16, 64, 256, 1024)


def paper(psi: float, stage: int, nd: int) -> float:
    """Table 1's formula: 2Ψ + 2Ψ + 12Ψ bytes, each partitioned from its stage on."""
    return (2 * psi / (nd if stage >= 3 else 1) + 2 * psi / (nd if stage >= 2 else 1) + 12 * psi / nd) / 1e9


def main() -> None:
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import plan
    from hf_zero.plan.simulate import Job, Setting

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["zero-72x3072", "zero-212x8192"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[4, 16, 64, 256, 1024])
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print("| model | Ψ | GPUs | stage | planned GB | paper's formula GB | planned / formula | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for nd in args.gpus:
            per_node = min(nd, 8)
            for stage in (1, 2, 3):
                job = Job(model, nd // per_node, per_node, "bf16", args.seq, 10**15)
                start = time.perf_counter()
                rank = plan(job, Setting(stage, gradient_checkpointing=True), Machine(10**15), ranks=[0]).busiest
                seconds = time.perf_counter() - start
                states = rank.model_states / 1e9
                formula = paper(rank.params, stage, nd)
                print(f"| {model} | {rank.params / 1e9:.1f}B | {nd} | {stage} | {states:,.2f} | {formula:,.2f} | "
                      f"{states / formula:.3f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
