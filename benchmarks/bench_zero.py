"""hf_zero stages 1-3 side by side with DDP, torch ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

Every system trains the same model from the same seed with fp32 AdamW on 2 gloo ranks (one thread
each), each run in fresh processes so that peak RSS (VmHWM) is that system's own. Runs are
interleaved (system A, B, C, then A, B, C again ...) so that drift of the machine hits all alike;
the table gives medians over repeats and ratios to DDP.

  python benchmarks/bench_zero.py --workload speed --repeats 3
  python benchmarks/bench_zero.py --workload memory --repeats 1
  python benchmarks/bench_zero.py --workload compile --systems fsdp2 fsdp2_compiled ddp_compiled hf_zero_2 \
      hf_zero_2_compiled hf_zero_3 hf_zero_3_compiled

`_compiled` systems compile each GPT2Block with inductor, as torchtitan does (torch.compile on the block, then
fully_shard on FSDP2's), and hf_zero's `compile` setting does; the first step's time beyond the median (the
compilation) is reported apart. Inductor caches what it compiled on disk (its FX graph cache), so later repeats
compile from the cache.

DeepSpeed is optional (`pip install -e ".[bench]"`); without it its rows are left out and said so.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zero  # noqa: E402
import model_zoo  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402
from hf_zero.runtime.memory import model_state_bytes, peak_rss  # noqa: E402

WORKLOADS = {
    # model, micro-batch, sequence, warm-up steps, timed steps
    "speed": dict(model="gpt2-bench-speed", batch=4, seq=128, warmup=2, steps=8),
    "memory": dict(model="gpt2-bench-memory", batch=1, seq=64, warmup=0, steps=3),
    "compile": dict(model="gpt2", batch=2, seq=128, warmup=2, steps=4),
}
SYSTEMS = ["ddp", "torch_zero_redundancy", "fsdp2", "deepspeed_1", "deepspeed_2", "deepspeed_3",
           "hf_zero_1", "hf_zero_2", "hf_zero_3"]
# ZeRO-Offload at stage 2 (`--systems` picks them): optimizer on the host, with the delayed update
# (warm-up 1 step, so that the timed steps run delayed), and states on NVMe under a temporary folder.
COMPILED_SYSTEMS = ["ddp_compiled", "fsdp2_compiled", "hf_zero_2_compiled", "hf_zero_3_compiled"]
OFFLOAD_SYSTEMS = ["hf_zero_2_offload", "hf_zero_2_offload_dpu", "hf_zero_2_nvme", "deepspeed_2_offload"]
OFFLOAD_CONFIG = {"offload": {"offload_optimizer": "cpu"},
                  "offload_dpu": {"offload_optimizer": "cpu", "delayed_param_update": True,
                                  "delayed_param_update_warmup": 1},
                  "nvme": {"offload_optimizer": "nvme"}}
FORMULA_STAGE = {"ddp": 0, "hf_zero_1": 1, "hf_zero_2": 2, "hf_zero_3": 3, "deepspeed_1": 1, "deepspeed_2": 2,
                 "deepspeed_3": 3, "torch_zero_redundancy": 1, "fsdp2": 3,
                 **{name: 2 for name in OFFLOAD_SYSTEMS}, "ddp_compiled": 0, "fsdp2_compiled": 3,
                 "hf_zero_2_compiled": 2, "hf_zero_3_compiled": 3}


def build(system: str, model: torch.nn.Module, micro_batch: int):
    """Returns (forward_backward_step(batch) -> None) for the system, built on `model`."""
    compiled = system.endswith("_compiled")
    system = system.removesuffix("_compiled")
    if compiled and not system.startswith("hf_zero"):
        for i, block in enumerate(model.transformer.h):  # torchtitan's order: compile each block, then wrap
            model.transformer.h.register_module(str(i), torch.compile(block))
    if system == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif system == "torch_zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        net = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif system.startswith("deepspeed"):
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": micro_batch, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": int(system.split("_")[1])}}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if system.endswith("_offload"):  # DeepSpeed's own CPU Adam, as it requires with offload
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def ds_step(b):
            engine.backward(engine(**b).loss)
            engine.step()
        return ds_step
    else:
        _, _, stage, *offload = system.split("_", 3)
        config = {"zero_stage": int(stage), **OFFLOAD_CONFIG.get("_".join(offload), {}),
                  **({"compile": True} if compiled else {})}
        if config.get("offload_optimizer") == "nvme":
            import tempfile
            config["nvme_path"] = tempfile.mkdtemp(prefix="hf_zero_bench_nvme_")
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)

        def zero_step(b):
            engine.backward(engine(**b).loss)
            engine.step()
        return zero_step

    def plain_step(b):
        net(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return plain_step


def run_system(system: str, workload: str) -> dict:
    w = WORKLOADS[workload]
    if system.startswith("deepspeed"):
        os.environ["DS_ACCELERATOR"] = "cpu"
    torch.manual_seed(0)
    model = model_zoo.build(w["model"])
    model.config.use_cache = False  # as the Trainer trains
    psi = sum(p.numel() for p in model.parameters())
    step = build(system, model, w["batch"])
    g = torch.Generator().manual_seed(dist.get_rank())
    times, first_step_s = [], None
    for i in range(w["warmup"] + w["steps"]):
        ids = torch.randint(0, model.config.vocab_size, (w["batch"], w["seq"]), generator=g)
        dist.barrier()
        start = time.perf_counter()
        step({"input_ids": ids, "labels": ids})
        dist.barrier()
        if i == 0:
            first_step_s = time.perf_counter() - start
        if i >= w["warmup"]:
            times.append(time.perf_counter() - start)
    # VmHWM, not ru_maxrss: after fork+exec ru_maxrss can report the launching process's size instead.
    step_s = statistics.median(times)
    return {"step_s": step_s, "peak_rss_mib": peak_rss() / 2**20, "psi": psi,
            "first_step_extra_s": first_step_s - step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + OFFLOAD_SYSTEMS + COMPILED_SYSTEMS)
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--mmap_threshold", type=int, default=1 << 20,
                   help="glibc MALLOC_MMAP_THRESHOLD_ for every system's processes, in bytes (0: glibc default). "
                        "glibc otherwise raises the threshold as tensors are freed and keeps later frees in its "
                        "heap, so peak RSS reflects allocation history more than what a system holds")
    args = p.parse_args()
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # inherited by every spawned rank
    systems = [s for s in args.systems if not s.startswith("deepspeed") or importlib.util.find_spec("deepspeed")]
    if len(systems) < len(args.systems):
        print("deepspeed is not installed: its rows are left out (pip install -e '.[bench]')")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.repeats):
        for s in systems:
            # Fresh interpreters, not forks of a preloaded server: each peak RSS is the system's own.
            ranks = spawn_gloo(run_system, 2, s, args.workload, start_method="spawn")
            runs[s].append({"step_s": max(x["step_s"] for x in ranks),
                            "peak_rss_mib": max(x["peak_rss_mib"] for x in ranks), "psi": ranks[0]["psi"],
                            "first_step_extra_s": max(x["first_step_extra_s"] for x in ranks)})
            print(f"repeat {r} {s}: {runs[s][-1]['step_s']:.3f} s/step, peak RSS {runs[s][-1]['peak_rss_mib']:.0f} "
                  f"MiB, first step +{runs[s][-1]['first_step_extra_s']:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    reference = next((s for s in ("ddp", "fsdp2") if s in runs), None)
    ref_step = statistics.median(x["step_s"] for x in runs[reference]) if reference else None
    psi = next(iter(runs.values()))[0]["psi"]
    malloc = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc default malloc"
    print(f"\n{args.workload}: {WORKLOADS[args.workload]}, Ψ = {psi:,}, 2 ranks, fp32 AdamW, "
          f"{args.repeats} interleaved repeat(s), {malloc}\n")
    print(f"| system | s/step (median) | x {reference or '-'} | first step beyond the median (s): first repeat, "
          f"later repeats' median | peak RSS per rank (MiB) | paper formula, model states (MiB) |")
    print("|---|---|---|---|---|---|")
    for s in systems:
        step = statistics.median(x["step_s"] for x in runs[s])
        rss = statistics.median(x["peak_rss_mib"] for x in runs[s])
        formula = sum(model_state_bytes(FORMULA_STAGE[s], psi, 2, "fp32").values()) / 2**20
        ratio = f"{step / ref_step:.2f}" if ref_step else "-"
        extra = [x["first_step_extra_s"] for x in runs[s]]
        later = f"{statistics.median(extra[1:]):.1f}" if len(extra) > 1 else "-"
        print(f"| {s} | {step:.3f} | {ratio} | {extra[0]:.1f}, {later} | {rss:.0f} | {formula:.0f} |")


if __name__ == "__main__":
    main()
