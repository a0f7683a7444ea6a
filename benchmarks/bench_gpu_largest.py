"""The largest GPT-2 each ZeRO stage trains on the GPUs at hand, beside the paper's formula (Table 2).

Needs CUDA; without it the script says so and exits (a skipped benchmark is never evidence). Run on one
machine, launched plainly (it starts torchrun itself, one fresh job per trial so that an out-of-memory
trial cannot leave a fragmented allocator to the next):

  python benchmarks/bench_gpu_largest.py --nproc_per_node 8
  python benchmarks/bench_gpu_largest.py --nproc_per_node 1 --settings 3 3+offload

A trial builds GPT-2 of width `--n_embd` with n_layer blocks in bf16 (stage 3: on meta, filled shard by
shard by SeededInit; below that: whole on the device) and trains `--steps` AdamW steps at micro-batch 1,
sequence `--seq`, with transformers' gradient checkpointing so that activations stay small beside the
model states. The depth is found by bisection between 1 and what the formula allows times `--headroom`.
The table gives, per setting, the largest Ψ trained, the formula's largest Ψ for model states alone
(`hf_zero.cli.estimate.largest_params`: 16Ψ DDP ... 16Ψ/Nd stage 3, offloaded bytes off the device), their
ratio, and the trial's peak allocated device memory (torch.cuda.max_memory_allocated, rank 0).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model_zoo  # noqa: E402
from hf_zero.cli.estimate import Setting, largest_params, model_states  # noqa: E402

OUT_OF_MEMORY = 3  # a trial's exit status when the model did not fit
SETTINGS = {"0": {"zero_stage": 0}, "1": {"zero_stage": 1}, "2": {"zero_stage": 2},
            "2+offload": {"zero_stage": 2, "offload_optimizer": "cpu"}, "3": {"zero_stage": 3},
            "3+offload": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}}


def gpt2_overrides(n_embd: int, n_layer: int) -> dict:
    return {"n_embd": n_embd, "n_head": n_embd // 64, "n_layer": n_layer, "n_positions": 1024}


def trial(config: dict, n_embd: int, n_layer: int, seq: int, steps: int) -> None:
    """One rank of one trial, under torchrun: trains or exits with OUT_OF_MEMORY."""
    import torch.distributed as dist

    import hf_zero
    from hf_zero.zero.construct import SeededInit

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    overrides = gpt2_overrides(n_embd, n_layer)
    try:
        if config["zero_stage"] == 3:
            with torch.device("meta"):
                model = model_zoo.build("gpt2-xl", **overrides)
            init_from = SeededInit(0)
        else:
            with torch.device(device):
                model = model_zoo.build("gpt2-xl", **overrides)
            init_from = None
        model.gradient_checkpointing_enable()
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                                    {**config, "dtype": "bf16"}, init_from=init_from)
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
        for _ in range(steps):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        sys.exit(OUT_OF_MEMORY)
    if dist.get_rank() == 0:
        print(json.dumps({"peak_allocated": torch.cuda.max_memory_allocated()}), flush=True)
    dist.destroy_process_group()


def run_trial(setting: str, args: argparse.Namespace, n_layer: int) -> dict | None:
    """Launches one trial; its result, or None when it ran out of device memory."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc_per_node}", __file__, "--trial", json.dumps(SETTINGS[setting]),
               "--n_embd", str(args.n_embd), "--n_layer", str(n_layer), "--seq", str(args.seq),
               "--steps", str(args.steps)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        if f"exitcode  : {OUT_OF_MEMORY}" in done.stderr or "OutOfMemoryError" in done.stderr:
            return None
        if "SIGKILL" in done.stderr or "Signal 9" in done.stderr or done.returncode == -9:
            return None  # the kernel's out-of-memory killer: host memory (offloaded states) ran out
        raise RuntimeError(f"trial {setting} with {n_layer} layers failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "seconds": time.perf_counter() - start}


def depth_bound(setting: Setting, gpu_bytes: int, host_bytes: int, per_layer: int, headroom: float,
                max_layers: int) -> int:
    """The deepest trial the bisection starts: `headroom` times the formula's depth for the device's memory
    (without parameter offload) and for the host's (with optimizer offload: offloaded states fill host memory,
    and a trial beyond it only starts one the kernel kills, minutes each), at most `max_layers`."""
    formula_psi = largest_params(setting, gpu_bytes) if setting.offload_param == "none" else None
    host_psi = host_bytes / model_states(1, setting)[1] if setting.offload_optimizer != "none" else None
    return min([max_layers] + [int(headroom * psi / per_layer) + 1 for psi in (formula_psi, host_psi)
                               if psi is not None])


def largest_fitting(fits, hi: int) -> tuple[int, dict | None]:
    """The largest n in [1, hi] with fits(n) not None, assuming fitting is monotone in n; (0, None) if none."""
    lo, best = 0, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        result = fits(mid)
        if result is None:
            hi = mid - 1
        else:
            lo, best = mid, result
    return lo, best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc_per_node", type=int, default=1)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--n_embd", type=int, default=4096, help="width of every trial's GPT-2 (a multiple of 64)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--headroom", type=float, default=1.2,
                   help="bisect up to this multiple of the formulas' depth (device memory, and host memory with "
                   "offload)")
    p.add_argument("--max_layers", type=int, default=512, help="depth cap, for settings the device does not limit")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--n_layer", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_largest.py needs CUDA: no GPU here, nothing measured")
    if args.trial:
        trial(json.loads(args.trial), args.n_embd, args.n_layer, args.seq, args.steps)
        return
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    host_bytes = psutil.virtual_memory().available // args.nproc_per_node
    per_layer = model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(args.n_embd, 2)) - \
        model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(args.n_embd, 1))
    rows = []
    for name in args.settings:
        config = SETTINGS[name]
        setting = Setting(config["zero_stage"], args.nproc_per_node, config.get("offload_optimizer", "none"),
                          config.get("offload_param", "none"))
        formula_psi = largest_params(setting, gpu_bytes) if setting.offload_param == "none" else None
        hi = depth_bound(setting, gpu_bytes, host_bytes, per_layer, args.headroom, args.max_layers)
        n_layer, result = largest_fitting(lambda n, s=name: run_trial(s, args, n), hi)
        psi = model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(args.n_embd, n_layer)) if n_layer else 0
        rows.append((name, n_layer, psi, formula_psi, result))
        print(f"{name}: {n_layer} layers, Ψ = {psi / 1e9:.2f}B", flush=True)
    device = torch.cuda.get_device_name(0)
    print(f"\n{args.nproc_per_node} x {device} ({gpu_bytes / 2**30:.0f} GiB), GPT-2 width {args.n_embd}, bf16 AdamW, "
          f"micro-batch 1, sequence {args.seq}, gradient checkpointing, {args.steps} steps per trial\n")
    print("| setting | layers | Ψ trained | formula's largest Ψ (model states) | trained / formula "
          "| peak allocated (GiB, rank 0) |")
    print("|---|---|---|---|---|---|")
    for name, n_layer, psi, formula_psi, result in rows:
        formula = f"{formula_psi / 1e9:.2f}B" if formula_psi else "host-bound"
        ratio = f"{psi / formula_psi:.2f}" if formula_psi else "-"
        peak = f"{result['peak_allocated'] / 2**30:.1f}" if result else "-"
        print(f"| {name} | {n_layer} | {psi / 1e9:.2f}B | {formula} | {ratio} | {peak} |")


if __name__ == "__main__":
    main()
