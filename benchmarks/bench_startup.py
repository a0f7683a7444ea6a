"""How long `hf-zero run` takes to start, beside stock torchrun: medians over `--repeats` fresh interpreters.

- to the first error: a misspelt launch flag (`--nproc_per_nod 2`) and a misspelt --zero_* flag after the script
  (`--zero_stgae 2`), each until the one-line error and the exit; stock: torchrun's own misspelt flag;
- to the first step: tests/scripts/hf_style_clm.py on `--nproc` CPU processes until the first logged loss, through
  `hf-zero run --zero_stage 2` and, stock, through `torchrun` with transformers' own Trainer; and the CPU time the
  machine spent over the whole run of one step (every process: launcher, ranks, hf-zero's fork server), from
  /proc/stat, so nothing else may run meanwhile.

  python benchmarks/bench_startup.py                 # 5 repeats of the errors, 2 of the first step
  python benchmarks/bench_startup.py --no_first_step
  python benchmarks/bench_startup.py --repeats 1 --nproc 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_style_clm.py"
HF_ZERO = [sys.executable, "-m", "hf_zero", "run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAINING = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--do_train",
            "--max_steps", "1", "--logging_steps", "1"]


def seconds_to_exit(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode == 0:
        raise RuntimeError(f"{' '.join(command)} was meant to fail and did not")
    return elapsed


def busy_core_seconds() -> float:
    """The machine's CPU time so far, every core and process (/proc/stat: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:9]]
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def first_step(command: list[str]) -> tuple[float, float]:
    """Seconds until the Trainer prints the first step's logs (a line with 'loss'), and the machine's core-seconds
    over the whole run, which is let finish."""
    start, busy = time.perf_counter(), busy_core_seconds()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as run:
        elapsed = None
        for line in run.stdout:
            if elapsed is None and "'loss'" in line:
                elapsed = time.perf_counter() - start
        if run.wait() != 0 or elapsed is None:
            raise RuntimeError(f"{' '.join(command)} ended with {run.returncode} before logging a loss")
    return elapsed, busy_core_seconds() - busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each error case (default 5)")
    parser.add_argument("--step_repeats", type=int, default=2, help="runs of each first-step case (default 2)")
    parser.add_argument("--no_first_step", action="store_true", help="time the errors only")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the first-step runs (default 2)")
    args = parser.parse_args()
    env_note = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    errors = {
        "hf-zero run, misspelt launch flag": HF_ZERO + ["--nproc_per_nodes", "2", str(SCRIPT)],
        "hf-zero run, misspelt --zero_* flag": HF_ZERO + ["--nproc_per_node", "2", str(SCRIPT), "--zero_stgae", "2"],
        "stock torchrun, misspelt launch flag": TORCHRUN + ["--nproc_per_nodes", "2", str(SCRIPT)],
    }
    results = {name: statistics.median(seconds_to_exit(command) for _ in range(args.repeats))
               for name, command in errors.items()}
    if not args.no_first_step:
        with tempfile.TemporaryDirectory() as out:
            nproc = str(args.nproc)
            steps = {
                f"hf-zero run --zero_stage 2, {nproc} processes": HF_ZERO + [
                    "--nproc_per_node", nproc, str(SCRIPT), "--output_dir", f"{out}/zero", "--zero_stage", "2",
                    *TRAINING],
                f"stock torchrun + Trainer (DDP), {nproc} processes": TORCHRUN + [
                    "--nproc_per_node", nproc, str(SCRIPT), "--output_dir", f"{out}/stock", *TRAINING],
            }
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
            for _ in range(args.step_repeats):  # in turn, so that both see the machine's same stretch
                for name, command in steps.items():
                    runs[name].append(first_step(command))
            for name, taken in runs.items():
                results[f"to the first step: {name}"] = statistics.median(seconds for seconds, _ in taken)
                results[f"core-seconds of the run: {name}"] = statistics.median(busy for _, busy in taken)
    for name, value in results.items():
        print(f"{value:7.2f} s  {name}")
    print(json.dumps({"median_seconds": results, **env_note}))


if __name__ == "__main__":
    main()
