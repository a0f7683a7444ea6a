"""What transformers' own initialisation costs when stage 3 builds a model from its config partitioned
(hf_zero/hf/stock_init.py), beside a plain `from_config` in the same invocation: one process, each way in a fresh
interpreter, `--repeats` times; medians of the seconds and of the peak RSS growth.

- plain: `AutoModelForCausalLM.from_config` (every tensor whole, drawn once while built and once by the init);
- stock_init: `record_stock_init` on meta (each draw made on a scratch tensor and thrown away), then every module's
  init run again from its recorded state into a unit-sized buffer at a time, as the engine fills a rank's units
  (here the whole model, unit by unit, on one rank: the time one rank of any world size spends).

  python benchmarks/bench_stock_init.py                  # GPT-2 of gpt2-medium's shape (355M)
  python benchmarks/bench_stock_init.py --n_layer 6      # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(way: str, n_layer: int, n_embd: int) -> dict[str, float]:
    import time

    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from hf_zero.hf.stock_init import record_stock_init
    from hf_zero.runtime.memory import current_rss, peak_rss, reset_peak_rss
    from hf_zero.zero.construct import _init_order

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=16)
    reset_peak_rss()
    before = current_rss()
    start = time.perf_counter()
    torch.manual_seed(0)
    if way == "plain":
        AutoModelForCausalLM.from_config(config)
    else:
        model, stock = record_stock_init(lambda: AutoModelForCausalLM.from_config(config))
        recorded = time.perf_counter() - start
        with torch.no_grad():
            in_blocks = {id(p) for block in model.transformer.h for p in block.parameters()}
            units = [list(block.parameters()) for block in model.transformer.h]
            units.append([p for p in model.parameters() if id(p) not in in_blocks])  # the root unit: the rest
            for params in units:  # a unit at a time
                held = {id(p): torch.empty_like(p, device="cpu") for p in params}
                for p in params:
                    torch.utils.swap_tensors(p, torch.nn.Parameter(held[id(p)]))
                for name, module, owner in _init_order(model):  # the modules that write the unit (theirs, their children's)
                    writes = [*module.parameters(recurse=False),
                              *(p for child in module.children() for p in child.parameters(recurse=False))]
                    if any(id(p) in held for p in writes):
                        stock.init_module(name, module, owner)
                for p in params:  # the unit gives up its memory
                    torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta")))
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "peak_growth_mib": (peak_rss() - before) / 2**20}
    if way != "plain":
        result["recording_seconds"] = recorded
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=24)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--_one", choices=["plain", "stock_init"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        print(json.dumps(run_one(args._one, args.n_layer, args.n_embd)))
        return
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "stock_init": []}
    for _ in range(args.repeats):
        for way in runs:
            # The mmap threshold `hf-zero run` gives the processes it launches (hf_zero.runtime.launch): the glibc default
            # moves up to 32 MiB and leaves freed unit-sized blocks in the heap.
            out = subprocess.run([sys.executable, __file__, "--_one", way, "--n_layer", str(args.n_layer),
                                  "--n_embd", str(args.n_embd)], capture_output=True, text=True, check=True,
                                 cwd=ROOT, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(8 * 2**20)})
            runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {way: {key: statistics.median(r[key] for r in results) for key in results[0]}
              for way, results in runs.items()}
    print(json.dumps(median, indent=1))
    print(f"stock_init / plain: {median['stock_init']['seconds'] / median['plain']['seconds']:.2f}x the time, "
          f"{median['stock_init']['peak_growth_mib'] / median['plain']['peak_growth_mib']:.2f}x the peak growth")


if __name__ == "__main__":
    main()
