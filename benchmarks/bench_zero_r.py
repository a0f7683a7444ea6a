"""ZeRO-R activation memory on tensor parallelism: no checkpointing, checkpointing, P_a, P_a+cpu.

GPT-2 (`gpt2-demo`: 4 blocks, hidden 256, 4 heads, byte vocabulary) at sequence 256, global batch 16, on 4 gloo
ranks as tp 2 x dp 2 with ZeRO stage 2 over dp. Every mode runs in fresh processes (so that peak RSS is
its own), interleaved over repeats; the table gives medians per rank:

  activation peak   peak RSS during a step's forward and backward, above the RSS before it
  checkpoints       block-input checkpoints held after the forward: on the device / in host memory
                    (the store's own count; for plain checkpointing, the paper's formula, which the
                    store's count equals when it keeps them whole: tests/zero/test_activations.py)
  step time         forward + backward + optimizer step

and beside them the paper's analysis (section 6.1) for the same configuration: one checkpoint of
batch x seq x hidden per block, divided by the tp degree with P_a, none on the device with P_a+cpu.

  python benchmarks/bench_zero_r.py --repeats 2
"""
from __future__ import annotations

import argparse
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
from hf_zero.runtime.memory import current_rss, peak_rss, reset_peak_rss  # noqa: E402
from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh  # noqa: E402

MODEL, SEQ, GLOBAL_BATCH, TP, WORLD = "gpt2-demo", 256, 16, 2, 4
WARMUP, STEPS = 1, 4
MODES = {"none": None, "checkpointing": {}, "P_a": {"partition_activations": True},
         "P_a+cpu": {"partition_activations": True, "cpu_checkpointing": True}}


def run_mode(mode: str) -> dict:
    torch.manual_seed(0)
    model = model_zoo.build(MODEL)
    model.train()
    mesh = init_mesh(TP)
    apply_tensor_parallel(model, mesh["tp"])
    if mode == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    config = {"zero_stage": 2, **(MODES[mode] or {})}
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config, mesh=mesh)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    g = torch.Generator().manual_seed(0)
    times, activation_peaks, checkpoints = [], [], None
    for i in range(WARMUP + STEPS):
        ids = torch.randint(0, model.config.vocab_size, (GLOBAL_BATCH, SEQ), generator=g).chunk(dp)[dp_rank]
        dist.barrier()
        reset_peak_rss()
        before = current_rss()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        if engine.activation_store is not None:
            checkpoints = dict(engine.activation_store.held_bytes)
        engine.backward(loss)
        activation_peak = peak_rss() - before
        engine.step()
        dist.barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            activation_peaks.append(activation_peak)
    return {"step_s": statistics.median(times), "activation_peak": statistics.median(activation_peaks),
            "checkpoints": checkpoints, "blocks": model.config.n_layer, "hidden": model.config.n_embd,
            "local_batch": GLOBAL_BATCH // dp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed activations leave RSS (see bench_zero.py)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            # Fresh interpreters, not forks of a preloaded server: each peak RSS is the system's own.
            ranks = spawn_gloo(run_mode, WORLD, mode, start_method="spawn")
            runs[mode] += ranks
            print(f"repeat {repeat} {mode}: {ranks[0]['step_s']:.3f} s/step", flush=True)
    first = runs["none"][0]
    whole = 4 * first["blocks"] * first["local_batch"] * SEQ * first["hidden"]  # fp32 block inputs, one rank
    paper = {"none": None, "checkpointing": (whole, 0), "P_a": (whole // TP, 0), "P_a+cpu": (0, whole // TP)}
    mib = 2**20
    base_time = statistics.median(r["step_s"] for r in runs["none"])
    print(f"\n{MODEL}, seq {SEQ}, global batch {GLOBAL_BATCH}, tp {TP} x dp {WORLD // TP}, ZeRO stage 2; "
          f"medians over {args.repeats} repeats x {WORLD} ranks\n")
    print("| mode | activation peak / rank | checkpoints device / host (measured) | paper's formula device / host "
          "| step time | vs none |")
    print("|---|---|---|---|---|---|")
    for mode, results in runs.items():
        peak = statistics.median(r["activation_peak"] for r in results) / mib
        step = statistics.median(r["step_s"] for r in results)
        held = results[0]["checkpoints"]
        measured = "—" if held is None else f"{held['device'] / mib:.2f} / {held['host'] / mib:.2f} MiB"
        formula = "—" if paper[mode] is None else f"{paper[mode][0] / mib:.2f} / {paper[mode][1] / mib:.2f} MiB"
        print(f"| {mode} | {peak:.1f} MiB | {measured} | {formula} | {step:.3f} s | {step / base_time:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
