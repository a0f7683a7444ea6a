"""`hf-zero plan`'s peak against a real run's: 2 and 4 gloo ranks on this CPU, stages 1-3, with and without the
optimizer offloaded to the CPU, and at stage 3 with the optimizer and parameters in CPU memory or on NVMe (in a
temporary folder), a GPT-2 of `--layers` x `--width` (vocabulary 8192), micro-batch `--batch` x `--seq` tokens, bf16,
AdamW, two steps.

Measured, each rank a fresh interpreter (a forked one inherits its parent's pages), over building the model and two
steps:
- resident: the peak resident memory less the resident memory before the model is built (its code imported, as a
  script imports it first: transformers' GPT-2 modules take 0.14 GB of a process's memory, which is not the model's),
  at each of glibc's mmap thresholds given: first as `hf-zero run` and `hf-zero train` set it for their ranks
  (hf_zero.runtime.host_memory: allocations above 8 MiB mmapped, so freed ones leave the resident memory), then at 1
  MiB, where glibc's heap keeps no freed block larger than that; beside each, the second step's seconds;
- the allocator's peak: the most bytes torch's CPU allocator had handed out at once, from torch's profiler's
  allocation events (in a run of its own).

Planned: the same job, world and setting, `hf_zero.plan.planner.plan` at rank 0. On a CPU the device's memory and
the host's are one, so the plan's figure is what device and host held together at one moment, in the step or in its
set-up (the model built whole, as here), whichever is more.

  python -m benchmarks.bench_plan_memory
  python -m benchmarks.bench_plan_memory --layers 12 --width 1024 --ranks 2 4
  python -m benchmarks.bench_plan_memory --ranks 2 --stages 3 --offload cpu+params
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A row's offload: where the optimizer's states and the parameters live; NVMe for both is ZeRO-Infinity.
OFFLOADS = {"none": ("none", "none"), "cpu": ("cpu", "none"), "cpu+params": ("cpu", "cpu"), "nvme": ("nvme", "nvme")}
SAID = {"none": "", "cpu": ", optimizer on cpu", "cpu+params": ", optimizer and parameters on cpu",
        "nvme": ", optimizer and parameters on nvme"}
SETTINGS = [(1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "cpu+params"), (3, "nvme")]


def measured(layers: int, width: int, batch: int, seq: int, stage: int, offload: str,
             allocated: bool) -> tuple[int, float]:
    """One rank's peak over building the model and two steps: its resident bytes above its resident bytes before
    the model is built, or (`allocated`) the most bytes torch's CPU allocator had handed out at once, from torch's
    profiler's allocation events (a run of its own: the profiler's records add to the resident memory); and the
    second step's seconds."""
    import time

    import torch
    import torch.distributed as dist
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (a script imports its model's code before building it)
    from torch.profiler import ProfilerActivity, profile

    import hf_zero
    import model_zoo
    from hf_zero.runtime.memory import allocator_peak, current_rss, peak_rss, reset_peak_rss

    reset_peak_rss()
    baseline = current_rss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if allocated else contextlib.nullcontext() \
            as profiler:
        torch.manual_seed(0)
        model = model_zoo.build("gpt2-bench-memory", n_layer=layers, n_embd=width, n_head=width // 64,
                                attn_pdrop=0.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = hf_zero.initialize(model, optimizer, {"zero_stage": stage, "dtype": "bf16",
                                                       **offload_settings(offload)})
        for step in range(2):
            started = time.perf_counter()
            ids = torch.randint(0, 8192, (batch, seq),
                                generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            seconds = time.perf_counter() - started
    return allocator_peak(profiler) if allocated else peak_rss() - baseline, seconds


NVME_FOLDER = Path(tempfile.gettempdir()) / "hf_zero_bench_plan_memory"


def offload_settings(offload: str) -> dict[str, str]:
    """The engine's offload settings of a row; NVMe's files in a folder of this machine's temporary one."""
    optimizer, parameters = OFFLOADS[offload]
    settings = {"offload_optimizer": optimizer, "offload_param": parameters}
    if "nvme" in (optimizer, parameters):
        NVME_FOLDER.mkdir(exist_ok=True)
        settings["nvme_path"] = str(NVME_FOLDER)
    return settings


def planned(layers: int, width: int, batch: int, seq: int, stage: int, offload: str, ranks: int) -> int:
    """The plan's peak for rank 0, the model given as a folder holding its config.json, as users give theirs."""
    import tempfile

    import model_zoo
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import plan
    from hf_zero.plan.simulate import Job, Setting

    with tempfile.TemporaryDirectory() as folder:
        model_zoo.save_config("gpt2-bench-memory", folder, n_layer=layers, n_embd=width, n_head=width // 64)
        job = Job(folder, 1, ranks, "bf16", seq, 10**15)
        setting = Setting(stage, *OFFLOADS[offload], micro_batch=batch)
        rank = plan(job, setting, Machine(10**15, 10**15, nvme_capacity=10**15), ranks=[0]).busiest
    return rank.measured_peak(one_memory=True)


def main() -> None:
    import os

    from hf_zero.runtime.host_memory import MMAP_THRESHOLD
    from hf_zero.runtime.launch import spawn_gloo

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3],
                        help="the rows of these stages (default: every row)")
    parser.add_argument("--offload", nargs="+", choices=tuple(OFFLOADS), default=list(OFFLOADS),
                        help="the rows of these offloads: cpu is the optimizer's, cpu+params the parameters' too "
                             "(default: every row)")
    parser.add_argument("--mmap_thresholds", type=int, nargs="+", default=[MMAP_THRESHOLD, 1 << 20], metavar="BYTES",
                        help="glibc's mmap threshold in the ranks (MALLOC_MMAP_THRESHOLD_), a resident measurement at "
                             "each; the first is the allocator run's (default: hf-zero run's and train's, then 1 MiB)")
    args = parser.parse_args()
    mib = [f"{threshold / 2**20:g} MiB" for threshold in args.mmap_thresholds]
    print("| ranks | setting | planned GB | "
          + " | ".join(f"resident GB (each rank), mmap above {m} | resident / planned | 2nd step s" for m in mib)
          + " | allocator's peak GB (each rank) | allocator's / planned |")
    print("|---|---|---|" + "---|---|---|" * len(mib) + "---|---|")
    for ranks in args.ranks:
        for stage, offload in [(stage, offload) for stage, offload in SETTINGS
                               if stage in args.stages and offload in args.offload]:
            shape = (args.layers, args.width, args.batch, args.seq, stage, offload)
            want = planned(*shape, ranks)
            columns = []
            for threshold in args.mmap_thresholds:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)  # read by each fresh rank as it starts
                runs = spawn_gloo(measured, ranks, *shape, False, start_method="spawn")
                resident = [peak for peak, _ in runs]
                columns.append(f"{', '.join(f'{g / 1e9:.3f}' for g in resident)} | {max(resident) / want:.2f} "
                               f"| {max(seconds for _, seconds in runs):.2f}")
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_thresholds[0])
            allocated = [peak for peak, _ in spawn_gloo(measured, ranks, *shape, True, start_method="spawn")]
            print(f"| {ranks} | stage {stage}{SAID[offload]} | {want / 1e9:.3f} | " + " | ".join(columns)
                  + f" | {', '.join(f'{g / 1e9:.3f}' for g in allocated)} | {max(allocated) / want:.2f} |", flush=True)
    shutil.rmtree(NVME_FOLDER, ignore_errors=True)


if __name__ == "__main__":
    main()
