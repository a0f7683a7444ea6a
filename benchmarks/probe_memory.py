"""Where an hf_zero run's peak RSS comes from: resident memory sampled every millisecond beside what the
engine's ledger says it holds at that moment, labelled by phase (which unit's forward or backward, the
optimizer step). The same workloads and harness as bench_zero.py (2 gloo ranks, fresh processes,
`MALLOC_MMAP_THRESHOLD_`), so its peaks are the table's.

  python benchmarks/probe_memory.py --workload memory --system hf_zero_3
  python benchmarks/probe_memory.py --workload memory --system hf_zero_3 --config '{"prefetch_bucket_size": 0}'
  python benchmarks/probe_memory.py --workload memory --system fsdp2

For each rank: RSS after building the model, after initialize, the steady state after each step, the
peak of each phase, and at the run's peak the ledger's held counters (gathered units, gradient buckets)
and the model states; what none of them covers is activations, autograd's gradients before they reach
a bucket, and what the collectives allocate.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_zero import SYSTEMS, WORKLOADS, build  # noqa: E402

import hf_zero  # noqa: E402
import model_zoo  # noqa: E402
from hf_zero.runtime.comm import Ledger  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402
from hf_zero.runtime.memory import current_rss  # noqa: E402

MIB = 2**20


class Sampler:
    """RSS every millisecond in a thread; the highest seen in each phase, and the ledger at the run's peak."""

    def __init__(self, ledger) -> None:
        self.ledger, self.phase = ledger, "start"
        self.peaks: dict[str, int] = {}
        self.peak, self.at_peak = 0, {}
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running:
            rss, phase = current_rss(), self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
            if rss > self.peak:
                self.peak = rss
                self.at_peak = {"phase": phase, **{k: v for k, v in self.ledger.held.items()}}
            time.sleep(0.001)

    def stop(self) -> None:
        self.running = False
        self.thread.join()


def probe(workload: str, system: str, extra: dict, steps: int | None) -> dict:
    w = {**WORKLOADS[workload], **({"steps": steps} if steps else {})}
    torch.manual_seed(0)
    after_import = current_rss()
    model = model_zoo.build(w["model"])
    after_build = current_rss()
    if system.startswith("hf_zero_"):
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                    {"zero_stage": int(system.removeprefix("hf_zero_")), **extra})
        ledger = engine.ledger

        def train_step(b: dict) -> None:
            sampler.phase = "forward embeddings"
            loss = engine(**b).loss
            sampler.phase = "backward head"
            engine.backward(loss)
            sampler.phase = "optimizer step"
            engine.step()
    else:  # a reference system of bench_zero.py: its step, without the ledger's counters
        engine, ledger, step = None, Ledger(), build(system, model, w["batch"])

        def train_step(b: dict) -> None:
            sampler.phase = "forward embeddings"
            step(b)
    after_initialize = current_rss()
    sampler = Sampler(ledger)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: setattr(sampler, "phase", "forward block"))
        block.register_full_backward_pre_hook(lambda m, g, i=i: setattr(sampler, "phase", "backward block"))
    model.transformer.ln_f.register_full_backward_pre_hook(lambda m, g: setattr(sampler, "phase", "backward head"))
    g = torch.Generator().manual_seed(dist.get_rank())
    steady = []
    for _ in range(w["warmup"] + w["steps"]):
        ids = torch.randint(0, model.config.vocab_size, (w["batch"], w["seq"]), generator=g)
        train_step({"input_ids": ids, "labels": ids})
        sampler.phase = "between steps"
        time.sleep(0.01)
        steady.append(current_rss())
    sampler.stop()
    return {"after_import": after_import, "after_build": after_build, "after_initialize": after_initialize,
            "steady": steady, "phase_peaks": sampler.peaks, "peak": sampler.peak, "at_peak": sampler.at_peak,
            "state_bytes": dict(ledger.state_bytes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="memory")
    p.add_argument("--system", default="hf_zero_3", choices=SYSTEMS, help="hf_zero_N, or a reference of bench_zero.py")
    p.add_argument("--config", default="{}", help="more hf_zero engine settings, as JSON")
    p.add_argument("--steps", type=int, help="steps instead of the workload's")
    p.add_argument("--mmap_threshold", type=int, default=1 << 20, help="as bench_zero.py (0: glibc default)")
    args = p.parse_args()
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    ranks = spawn_gloo(probe, 2, args.workload, args.system, json.loads(args.config), args.steps,
                       start_method="spawn")
    for rank, r in enumerate(ranks):
        print(f"\nrank {rank}: {args.system} {args.config}, {args.workload} workload")
        print(f"  RSS after import {r['after_import'] / MIB:.0f} MiB, model built {r['after_build'] / MIB:.0f}, "
              f"initialize {r['after_initialize'] / MIB:.0f}, between steps "
              f"{', '.join(f'{s / MIB:.0f}' for s in r['steady'])}")
        print("  peak by phase: " + ", ".join(f"{k} {v / MIB:.0f}" for k, v in sorted(
            r["phase_peaks"].items(), key=lambda kv: -kv[1])))
        held = {k: v for k, v in r["at_peak"].items() if k != "phase"}
        states = sum(r["state_bytes"].values())
        print(f"  peak {r['peak'] / MIB:.0f} MiB in '{r['at_peak'].get('phase')}'; model states "
              f"{states / MIB:.0f} MiB; held then: " + ", ".join(f"{k} {v / MIB:.0f} MiB" if "bytes" in k else f"{k} {v}"
                                         for k, v in sorted(held.items())))


if __name__ == "__main__":
    main()
