"""Peak RSS per rank when an unmodified Trainer script fine-tunes a checkpoint larger than each rank should hold:
a GPT-2 of gpt2-large's shape (774M parameters, 3.1 GB in fp32, random weights written by
save_pretrained as sharded safetensors), through `hf-zero run --nproc_per_node 4 --zero_stage 3`, built
partitioned (also giving back the heap backward frees: --zero_trim_host_heap) and, beside it in the same
invocation, whole on every rank first.

  python benchmarks/bench_pretrained_memory.py                 # gpt2-large's shape, 3 steps
  python benchmarks/bench_pretrained_memory.py --n_layer 6     # quicker, same width
  python benchmarks/bench_pretrained_memory.py --n_layer 12 --runs nvme --do_eval   # 302M, NVMe, evaluated too

Each rank's VmHWM is read from /proc while the job runs: when the Trainer logs "Running training" (the
model is built, the Trainer and the engine exist, no step has run) and at the end. Runs: partitioned,
partitioned with the heap trimmed, whole first, and partitioned with ZeRO-Infinity (parameters and
optimizer states on NVMe). The losses of the runs are compared (they must agree within 1e-5 relative).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_style_clm.py"
GIB = 2**30


def save_checkpoint(folder: Path, n_layer: int, n_embd: int) -> int:
    """A randomly initialised GPT-2 with gpt2-large's vocabulary and context, written sharded; its fp32 bytes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if (folder / "model.safetensors.index.json").is_file():
        return int((folder / "fp32_bytes").read_text())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=20, vocab_size=50257,
                                       n_positions=1024, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder, max_shard_size="500MB")
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    (folder / "fp32_bytes").write_text(str(nbytes))
    return nbytes


def rank_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The ranks, by number: torchrun's agent runs inside the launcher and forks them from its fork server, which
    names each (hf_zero.cli.node_ranks); a rank's own children (DataLoader workers) keep its name."""
    try:
        ranks = {int(p.name().split()[1]): p for p in launcher.children(recursive=True)
                 if p.name().startswith("rank ") and not p.parent().name().startswith("rank ")}
    except (psutil.Error, IndexError, ValueError):  # a rank that has just exited
        return []
    return [ranks[r] for r in sorted(ranks)]


def vm_hwm(process: psutil.Process) -> int:
    with open(f"/proc/{process.pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# The runs by name: what the table calls each, and its flags.
RUNS = {"partitioned": ("partitioned", []),
        "trimmed": ("partitioned, --zero_trim_host_heap", ["--zero_trim_host_heap", "true"]),
        "whole": ("whole first", ["--zero_init_partitioned", "false"]),
        "nvme": ("partitioned, NVMe params + optimizer", ["--zero_offload_param", "nvme", "--zero_offload_optimizer",
                                                          "nvme"])}


def run(name: str, checkpoint: Path, out: Path, steps: int, flags: list[str]) -> dict:
    """One `hf-zero run`; per rank the VmHWM before the first step and over the whole run, and the losses."""
    command = [sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "4", str(SCRIPT),
               "--model_name_or_path", str(checkpoint), "--output_dir", str(out), "--zero_stage", "3",
               "--do_train", "--max_steps", str(steps), "--logging_steps", "1", "--per_device_train_batch_size", "1",
               "--learning_rate", "1e-4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
               "--save_strategy", "no", "--log_level", "info", *flags]
    started = time.perf_counter()
    launcher = psutil.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}  # pid -> the last VmHWM read
    at_first_step: dict[int, int] = {}
    lines: list[str] = []

    def sample() -> None:
        while launcher.poll() is None:
            for rank in rank_processes(launcher):
                try:
                    peaks[rank.pid] = vm_hwm(rank)
                except OSError:  # exited between the listing and the read
                    pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in launcher.stdout:
        lines.append(line)
        if "Running training" in line and not at_first_step:
            at_first_step = {rank.pid: vm_hwm(rank) for rank in rank_processes(launcher)}
    launcher.wait()
    sampler.join()
    if launcher.returncode != 0:
        raise SystemExit(f"{name} failed:\n{''.join(lines[-40:])}")
    history = json.loads((out / "log_history.json").read_text())
    return {"name": name, "seconds": time.perf_counter() - started,
            "before_first_step": sorted(at_first_step.values()), "whole_run": sorted(peaks.values()),
            "losses": [entry["loss"] for entry in history if "loss" in entry]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n_layer", type=int, default=36)
    parser.add_argument("--n_embd", type=int, default=1280)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", default="/tmp/hf_zero_bench_pretrained")
    parser.add_argument("--do_eval", action="store_true", help="evaluate after training too (--do_eval): stage 3 keeps "
                        "units gathered through the evaluation loop, within its keep limit")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs (default: all)")
    args = parser.parse_args()
    work = Path(args.work)
    checkpoint = work / f"gpt2_{args.n_layer}x{args.n_embd}"
    model_bytes = save_checkpoint(checkpoint, args.n_layer, args.n_embd)
    psi = model_bytes // 4
    (work / "nvme").mkdir(parents=True, exist_ok=True)
    print(f"checkpoint: {psi / 1e6:.0f}M parameters, {model_bytes / GIB:.2f} GiB in fp32; 4 ranks, "
          f"stage-3 formula 16Ψ/Nd = {4 * model_bytes / 4 / GIB:.2f} GiB")
    evaluating = ["--do_eval"] if args.do_eval else []
    runs = [run(RUNS[name][0], checkpoint, work / name, args.steps,
                [*RUNS[name][1], *(["--zero_nvme_path", str(work / "nvme")] if name == "nvme" else []), *evaluating])
            for name in args.runs]
    print("| run | peak RSS per rank before the first step (GiB, x model) | over the run (GiB, x model) | s |")
    print("|---|---|---|---|")
    for r in runs:
        first = ", ".join(f"{b / GIB:.2f} ({b / model_bytes:.2f}x)" for b in r["before_first_step"])
        whole = ", ".join(f"{b / GIB:.2f} ({b / model_bytes:.2f}x)" for b in r["whole_run"])
        print(f"| {r['name']} | {first} | {whole} | {r['seconds']:.0f} |")
    reference = runs[0]["losses"]
    for r in runs:
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], reference))
        print(f"{r['name']}: losses {['%.5f' % x for x in r['losses']]}, worst relative difference to the "
              f"{runs[0]['name']} run {worst:.1e}")
        assert len(r["losses"]) == args.steps and math.isfinite(worst) and worst <= 1e-5


if __name__ == "__main__":
    main()
