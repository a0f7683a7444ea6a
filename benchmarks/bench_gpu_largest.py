"""The largest GPT-2 each ZeRO stage trains on the GPUs at hand, beside the paper's formula (Table 2) and the
largest `hf-zero plan` says fits.

The trials need CUDA; without it the script says so and exits (a skipped benchmark is never evidence), except
with `--plan_only`, which gives the plan's column alone. Run on one
machine, launched plainly (it starts torchrun itself, one fresh job per trial so that an out-of-memory
trial cannot leave a fragmented allocator to the next):

  python benchmarks/bench_gpu_largest.py --nproc_per_node 8
  python benchmarks/bench_gpu_largest.py --nproc_per_node 1 --settings 3 3+offload
  python benchmarks/bench_gpu_largest.py --plan_only --gpu_memory 80 --host_memory 125   # any machine, no GPU

Beside each setting's largest trained, the largest `hf-zero plan` says fits: the same bisection over the same
trials, each planned (hf_zero.plan: the engine's own step simulated, activations and temporaries included) for
the machine's device and host memory. `--plan_only` gives that column alone, on a CPU, for a machine given by
`--gpu_memory` and `--host_memory` (GiB; host memory per rank), so that the prediction is known before the GPUs
are; a GPU run plans in a process of its own beside its trials (a few minutes of one core for the default width).
The plan's device peak is its busiest rank's, against the device's whole memory: the CUDA context, NCCL's and
cuBLAS's workspaces are not in it, so its largest may be a layer above what trains. A GPU run plans for the host
memory available when it starts, the planning process's ~2 GB included.

A trial builds GPT-2 of width `--n_embd` with n_layer blocks in bf16 (stage 3: on meta, filled shard by
shard by SeededInit; below that: whole on the device) and trains `--steps` AdamW steps at micro-batch 1,
sequence `--seq`, with transformers' gradient checkpointing so that activations stay small beside the
model states. The depth is found by bisection between 1 and what the formula allows times `--headroom`.
The table gives, per setting, the largest Ψ trained, the formula's largest Ψ for model states alone
(`hf_zero.cli.estimate.largest_params`: 16Ψ DDP ... 16Ψ/Nd stage 3, offloaded bytes off the device), their
ratio, the trial's peak allocated device memory (torch.cuda.max_memory_allocated, rank 0), and the plan's
largest with its peak and the ratio of the trained Ψ to it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
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


def planned_fit(name: str, args: argparse.Namespace, gpu_bytes: int, host_bytes: int, n_layer: int,
                folder: Path) -> dict | None:
    """The trial of `n_layer` layers planned (its rank with the highest device peak), or None where the plan says
    it does not fit: the trial's model, micro-batch 1, sequence, checkpointing, bf16 with fp32 masters and AdamW as
    the trial makes it on a GPU (for-each), over `nproc_per_node` GPUs of `gpu_bytes` with `host_bytes` of host
    memory each."""
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import plan
    from hf_zero.plan.simulate import Job
    from hf_zero.plan.simulate import Setting as PlannedSetting

    model = model_zoo.save_config("gpt2-xl", folder / f"gpt2-{args.n_embd}x{n_layer}",
                                  **gpt2_overrides(args.n_embd, n_layer))
    job = Job(model, nodes=1, gpus_per_node=args.nproc_per_node, seq_len=args.seq, gpu_memory=gpu_bytes,
              optimizer_kwargs=json.dumps({"lr": 1e-5, "foreach": True}))
    planned = plan(job, PlannedSetting(**SETTINGS[name], micro_batch=1, gradient_checkpointing=True),
                   Machine(gpu_memory=gpu_bytes, host_memory=host_bytes * args.nproc_per_node))
    return {"device_peak": planned.busiest.device_peak} if planned.fits else None


def planned_largest(name: str, args: argparse.Namespace, gpu_bytes: int, host_bytes: int, hi: int
                    ) -> tuple[int, dict | None]:
    """The deepest trial in [1, hi] `hf-zero plan` says fits (`planned_fit`), bisected as the trials are."""
    with tempfile.TemporaryDirectory() as folder:
        return largest_fitting(lambda n: planned_fit(name, args, gpu_bytes, host_bytes, n, Path(folder)), hi)


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
    p.add_argument("--plan_only", action="store_true",
                   help="the plan's largest alone, without CUDA, for the machine --gpu_memory and --host_memory give")
    p.add_argument("--gpu_memory", type=float, help="GiB per GPU (with --plan_only only)")
    p.add_argument("--host_memory", type=float, help="GiB of host memory per rank (with --plan_only only)")
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--n_layer", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plan_only:
        if args.gpu_memory is None or args.host_memory is None:
            p.error("--plan_only plans for a machine given by --gpu_memory and --host_memory (GiB)")
        gpu_bytes, host_bytes = int(args.gpu_memory * 2**30), int(args.host_memory * 2**30)
    elif args.gpu_memory is not None or args.host_memory is not None:
        p.error("--gpu_memory and --host_memory describe the machine for --plan_only; trials use the GPUs at hand")
    elif not torch.cuda.is_available():
        sys.exit("bench_gpu_largest.py needs CUDA: no GPU here, nothing measured (--plan_only plans without one)")
    elif args.trial:
        trial(json.loads(args.trial), args.n_embd, args.n_layer, args.seq, args.steps)
        return
    else:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        host_bytes = psutil.virtual_memory().available // args.nproc_per_node
    per_layer = model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(args.n_embd, 2)) - \
        model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(args.n_embd, 1))
    rows = []
    planning = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for name in args.settings:
            config = SETTINGS[name]
            setting = Setting(config["zero_stage"], args.nproc_per_node, config.get("offload_optimizer", "none"),
                              config.get("offload_param", "none"))
            formula_psi = largest_params(setting, gpu_bytes) if setting.offload_param == "none" else None
            hi = depth_bound(setting, gpu_bytes, host_bytes, per_layer, args.headroom, args.max_layers)
            planned = planning.submit(planned_largest, name, args, gpu_bytes, host_bytes, hi)
            trained = None
            if not args.plan_only:  # the trials, while the plan's search runs on a core of the host
                trained = largest_fitting(lambda n, s=name: run_trial(s, args, n), hi)
                print(f"{name}: {trained[0]} layers trained", flush=True)
            rows.append((name, formula_psi, trained, planned))
        rows = [(name, formula_psi, trained, _outcome(planned)) for name, formula_psi, trained, planned in rows]
    finally:  # a failed trial leaves no plan search running on
        planning.shutdown(cancel_futures=True)
    device = "(planned only)" if args.plan_only else torch.cuda.get_device_name(0)
    trials = "" if args.plan_only else f", {args.steps} steps per trial"
    print(f"\n{args.nproc_per_node} x {device} ({gpu_bytes / 2**30:.0f} GiB), GPT-2 width {args.n_embd}, bf16 AdamW, "
          f"micro-batch 1, sequence {args.seq}, gradient checkpointing{trials}\n")
    print("| setting | layers trained | Ψ trained | formula's largest Ψ (model states) | trained / formula "
          "| peak allocated (GiB, rank 0) | layers planned | Ψ planned | planned peak (GiB, busiest rank) "
          "| trained / planned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, formula_psi, trained, planned in rows:
        print(_row(name, formula_psi, trained, planned, args.n_embd))


def _row(name: str, formula_psi: int | None, trained: tuple[int, dict | None] | None,
         planned: tuple[int, dict | None] | str, n_embd: int) -> str:
    """One setting's row: its trials' (None: planned only) and its plan's (text: the plan's error)."""
    def params(n_layer: int) -> int:
        return model_zoo.parameter_count("gpt2-xl", **gpt2_overrides(n_embd, n_layer)) if n_layer else 0

    formula = f"{formula_psi / 1e9:.2f}B" if formula_psi else "host-bound"
    psi = params(trained[0]) if trained else 0
    if trained is None:
        measured = f"- | - | {formula} | - | -"
    else:
        ratio = f"{psi / formula_psi:.2f}" if formula_psi else "-"
        peak = f"{trained[1]['peak_allocated'] / 2**30:.1f}" if trained[1] else "-"
        measured = f"{trained[0]} | {psi / 1e9:.2f}B | {formula} | {ratio} | {peak}"
    if isinstance(planned, str):
        return f"| {name} | {measured} | plan failed: {planned[-200:]!r} | | | |"
    planned_psi = params(planned[0])
    planned_peak = f"{planned[1]['device_peak'] / 2**30:.1f}" if planned[1] else "-"
    to_plan = f"{psi / planned_psi:.2f}" if trained is not None and planned_psi else "-"
    return f"| {name} | {measured} | {planned[0]} | {planned_psi / 1e9:.2f}B | {planned_peak} | {to_plan} |"


def _outcome(planned: Future) -> tuple[int, dict | None] | str:
    """The plan's search's result, or its error as text: a failed plan costs its columns, not the trials'."""
    try:
        return planned.result()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


if __name__ == "__main__":
    main()
