"""The ZeRO paper's Table 1 (model states per device for 7.5B, 128B and 1T over 1 to 1024 GPUs, mixed-precision
Adam, K = 12) beside what `hf-zero plan` measures: each stage's parameters, gradients and optimizer states held on
rank 0's device between steps (gradients at the end of backward), the engine's own code run as one rank of each
world; rank 0's peak in the step (gathered units, activations and temporaries besides), and the step's time as the
plan models it on its default machine (A100s of 80 GB, hf_zero.plan.machine.Machine); and beside both, DeepSpeed's
estimators for the same model and world (`estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs`, no offload; DeepSpeed has none for stage 1), where DeepSpeed is
installed (`pip install 'hf_zero[bench]'`).

Models: the zoo's configurations of the paper's Table 4, "7.5b", a GPT-2 of 51 layers x 3456 (7.49B) for Figure 1's
7.5B, and "1t", a GPT-2 of 128 layers x 25600 (1.007T; Table 1's 1T row gives no shape). Where the paper prints its
own figure for a row (Figure 1's 7.5B over 64 GPUs, 1T over 1024 at stage 3), it stands beside the plan's.

  python -m benchmarks.bench_plan_scale
  python -m benchmarks.bench_plan_scale --models zero-72x3072 --gpus 4 64 1024
"""
from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import model_zoo

# GPT-2 shapes for sizes the paper names without a shape: Figure 1's 7.5B (51 x 3456: 7.49B) and Table 1's 1T.
SHAPES = {"7.5b": dict(n_layer=51, n_embd=3456, n_head=27), "1t": dict(n_layer=128, n_embd=25600, n_head=200)}
# The paper's own figures, GB per device by stage: Figure 1's 7.5B over 64 GPUs (sections 5.1-5.3), and 16 GB for
# 1T over 1024 GPUs at stage 3 (section 1: "16TB divided by 1024 is 16GB").
PAPER_FIGURES = {("7.5b", 64): {1: 31.4, 2: 16.6, 3: 1.9}, ("1t", 1024): {3: 16.0}}


def paper(psi: float, stage: int, nd: int) -> float:
    """Table 1's formula: 2Ψ + 2Ψ + 12Ψ bytes, each partitioned from its stage on."""
    return (2 * psi / (nd if stage >= 3 else 1) + 2 * psi / (nd if stage >= 2 else 1) + 12 * psi / nd) / 1e9


def deepspeed_estimate(model: str, stage: int, nd: int, per_node: int) -> float | None:
    """DeepSpeed's own estimator's device bytes per GPU (GB) for the model and world; None for stage 1 (it has none)
    or without DeepSpeed."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    psi, largest_layer = _sizes(model)
    if stage == 2:
        _, gpu = estimate_zero2_model_states_mem_needs(psi, per_node, nd // per_node, cpu_offload=False)
    elif stage == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest_layer, per_node, nd // per_node,
                                                          cpu_offload=False, cpu_offload_params=False)
    else:
        return None
    return gpu / 1e9


@functools.lru_cache(maxsize=None)
def _sizes(model: str) -> tuple[int, int]:
    """Ψ and the largest layer's parameters, as DeepSpeed's `*_all_live` estimators count them (a module's own
    parameters), from the model built on the meta device."""
    import torch

    from hf_zero.plan.models import build_model

    with torch.device("meta"):
        built = build_model(model)
    psi = sum(p.numel() for p in built.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules())
    return psi, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["zero-48x1600", "7.5b", "zero-72x3072", "zero-212x8192", "1t"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print("| model | Ψ | GPUs | stage | planned GB | paper's formula GB | planned / formula | the paper's figure GB "
          "| DeepSpeed's estimator GB | planned peak GB | planned step s | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            model = model_zoo.save_config("gpt2-xl", Path(scratch, f"gpt2-{name}"), **SHAPES[name]) \
                if name in SHAPES else name
            _rows(name, model, args.gpus, args.seq)


def _rows(name: str, model: str, gpus: list[int], seq: int) -> None:
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import plan
    from hf_zero.plan.simulate import Job, Setting

    for nd in gpus:
        per_node = min(nd, 8)
        for stage in (1, 2, 3):
            job = Job(model, nd // per_node, per_node, "bf16", seq, 10**15)
            start = time.perf_counter()
            planned = plan(job, Setting(stage, gradient_checkpointing=True), Machine(10**15), ranks=[0])
            seconds = time.perf_counter() - start
            rank = planned.busiest
            states = rank.model_states / 1e9
            formula = paper(rank.params, stage, nd)
            deepspeed = deepspeed_estimate(model, stage, nd, per_node)
            print(f"| {name} | {rank.params / 1e9:.1f}B | {nd} | {stage} | {states:,.2f} | {formula:,.2f} | "
                  f"{states / formula:.3f} | {PAPER_FIGURES.get((name, nd), {}).get(stage, '')} | "
                  f"{'' if deepspeed is None else f'{deepspeed:,.2f}'} | "
                  f"{rank.device_peak / 1e9:,.2f} | {planned.step_seconds['total']:.3g} | {seconds:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
