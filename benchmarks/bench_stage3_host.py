"""Stage 3's host time per unit per step: what the engine's hooks, gathers, frees, reductions and
bookkeeping cost the host for each unit, beside FSDP2's fully_shard and DeepSpeed's stage 3 on the same model, in
the same invocation.

  python -m benchmarks.bench_stage3_host --units 48 --repeats 5
  python -m benchmarks.bench_stage3_host --ranks 1 --systems plain hf_zero_2 hf_zero_3 fsdp2

The second asks the same on one device, where a GPU step is bound by the host: with one rank every
collective is a local copy, and what is left beside plain torch is each system's own host work.

The model is `units` blocks (Linear(width, width), GELU) of width 32, so small that the arithmetic is a sliver of a
step and what is left is the host's per-unit work. Each system shards every block as a unit of its own on 2 gloo
ranks (one thread each; `--ranks`) and trains `steps` steps of a (4, width) batch; "plain" runs the same model unsharded on each
rank with no communication, the compute every system shares. The host time per unit per step is
(system's step - plain's step) / units, in microseconds: for the sharded systems that is their hooks, their
collectives' host side (on gloo, the transfer itself too: every system pays it alike) and their bookkeeping.
Systems run round-robin, `repeats` times, each in fresh processes; medians. hf_zero also runs with
HF_ZERO_CHECK_COLLECTIVES=0, which shows what the collective-sequence check costs, and at stage 2 ("hf_zero_2": its
buckets and per-parameter gradient hooks, no units).
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zero  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402

WIDTH, BATCH, WARMUP = 32, 4, 3
SYSTEMS = ["plain", "hf_zero_2", "hf_zero_3", "hf_zero_3_unchecked", "fsdp2", "deepspeed_3"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.linear(x))


class Blocks(nn.Module):
    def __init__(self, units: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def one_system(system: str, units: int, steps: int) -> float:
    """The median step of `system` on this rank, in seconds."""
    torch.manual_seed(0)
    model = Blocks(units)
    if system in ("plain", "fsdp2"):
        if system == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x: torch.Tensor) -> None:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif system == "deepspeed_3":
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                          config={"train_micro_batch_size_per_gpu": BATCH,
                                                  "zero_allow_untested_optimizer": True,
                                                  # every block sharded, as the others shard it (its default
                                                  # keeps parameters under 1e5 elements whole on every rank)
                                                  "zero_optimization": {"stage": 3,
                                                                        "stage3_param_persistence_threshold": 0}})

        def step(x: torch.Tensor) -> None:
            engine.backward(engine(x).square().mean())
            engine.step()
    else:
        config = {"zero_stage": 2} if system == "hf_zero_2" else {"zero_stage": 3, "unit_module_classes": ["Block"]}
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)

        def step(x: torch.Tensor) -> None:
            engine.backward(engine(x).square().mean())
            engine.step()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for i in range(WARMUP + steps):
        dist.barrier()
        start = time.perf_counter()
        step(x)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def available(system: str) -> bool:
    if system != "deepspeed_3":
        return True
    if importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed is not installed: its row is left out", file=sys.stderr)
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    systems = [s for s in args.systems if available(s)]
    steps: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.repeats):
        for system in systems:
            env = {"HF_ZERO_CHECK_COLLECTIVES": "0"} if system == "hf_zero_3_unchecked" else {}
            before = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                ranks = spawn_gloo(one_system, args.ranks, system, args.units, args.steps, start_method="spawn")
            finally:
                for k, v in before.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            steps[system].append(max(ranks))  # a step ends when its slower rank does
    median = {s: statistics.median(t) for s, t in steps.items()}
    plain = median.get("plain", 0.0)
    per_unit = {s: (t - plain) / args.units * 1e6 for s, t in median.items() if s != "plain"}
    report = {"units": args.units, "width": WIDTH, "ranks": args.ranks, "step_s": median, "host_us_per_unit": per_unit}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"\n{args.units} units of width {WIDTH}, {args.ranks} gloo rank(s), medians of {args.repeats}")
    print("| system | step (ms) | host µs per unit per step | x FSDP2 |")
    print("|---|---|---|---|")
    fsdp = per_unit.get("fsdp2")
    for system, step in median.items():
        unit = per_unit.get(system)
        ratio = f"{unit / fsdp:.2f}" if unit is not None and fsdp else "-"
        print(f"| {system} | {step * 1e3:.2f} | {'-' if unit is None else f'{unit:.0f}'} | {ratio} |")


if __name__ == "__main__":
    main()
