"""How long `hf-zero run` takes to start, beside stock torchrun: medians over `--repeats` fresh interpreters.

- to the first error: a misspelt launch flag (`--nproc_per_nod 2`) and a misspelt --zero_* flag after the script
  (`--zero_stgae 2`), each until the one-line error and the exit; stock: torchrun's own misspelt flag;
- to the first step: tests/scripts/hf_style_clm.py on 2 CPU processes until the first logged loss, through
  `hf-zero run --zero_stage 2` and, stock, through `torchrun` with transformers' own Trainer.

  python benchmarks/bench_startup.py                 # 5 repeats of the errors, 2 of the first step
  python benchmarks/bench_startup.py --no_first_step
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


def seconds_to_first_step(command: list[str]) -> float:
    """Until the Trainer prints the first step's logs (a line with 'loss'), then the run is let finish."""
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as run:
        elapsed = None
        for line in run.stdout:
            if elapsed is None and "'loss'" in line:
                elapsed = time.perf_counter() - start
        if run.wait() != 0 or elapsed is None:
            raise RuntimeError(f"{' '.join(command)} ended with {run.returncode} before logging a loss")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each error case (default 5)")
    parser.add_argument("--step_repeats", type=int, default=2, help="runs of each first-step case (default 2)")
    parser.add_argument("--no_first_step", action="store_true", help="time the errors only")
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
            steps = {
                "hf-zero run --zero_stage 2, 2 processes": HF_ZERO + [
                    "--nproc_per_node", "2", str(SCRIPT), "--output_dir", f"{out}/zero", "--zero_stage", "2",
                    *TRAINING],
                "stock torchrun + Trainer (DDP), 2 processes": TORCHRUN + [
                    "--nproc_per_node", "2", str(SCRIPT), "--output_dir", f"{out}/stock", *TRAINING],
            }
            results |= {f"to the first step: {name}": statistics.median(
                seconds_to_first_step(command) for _ in range(args.step_repeats)) for name, command in steps.items()}
    for name, value in results.items():
        print(f"{value:7.2f} s  {name}")
    print(json.dumps({"median_seconds": results, **env_note}))


if __name__ == "__main__":
    main()
