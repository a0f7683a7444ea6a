"""A long `hf-zero train` run with checkpoints every --save_steps and rotation, watched from outside: each rank's
resident memory, open file descriptors, and the bytes in the NVMe and checkpoint folders, sampled every
--every seconds and tied to the training step rank 0 last logged.

  python benchmarks/bench_soak.py                                  # 2,000 steps, stage 3, a checkpoint every 100
  python benchmarks/bench_soak.py --steps 400 --plot soak.png      # and RSS against step as a picture (matplotlib)

The job: `hf-zero train --zero_stage 3 --offload_param cpu --offload_optimizer nvme` on 2 processes, gpt2-tiny so
that 2,000 steps take minutes on a CPU, keeping the newest 2 checkpoints. What it checks, printed as one JSON object:
- after the first save, the highest RSS of each rank in each save interval stays within 2% of the first interval's
  (a leak of a checkpoint's buffers, or of the NVMe tiles, grows it save after save);
- the open file descriptors and the NVMe folder do not grow after the first save;
- the checkpoint folder holds at most --save_total_limit complete checkpoints, one more for the moment between a
  save and the removal of the oldest.
HF_ZERO_CHECK_COLLECTIVES=0 in the environment runs the job without the collective sequence check.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_pretrained_memory import rank_processes  # noqa: E402
from hf_zero.cli.train_lm import checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def soak(args: argparse.Namespace, work: Path) -> dict:
    nvme, out = work / "nvme", work / "checkpoints"
    nvme.mkdir()
    command = [sys.executable, "-m", "hf_zero", "train", "--nproc_per_node", "2", "--model", args.model,
               "--zero_stage", "3", "--offload_param", "cpu", "--offload_optimizer", "nvme", "--nvme_path", str(nvme),
               "--max_steps", str(args.steps), "--max_minutes", "600", "--log_every", "10", "--batch_size", "4",
               "--seq_len", "64", "--output_dir", str(out), "--save_steps", str(args.save_steps),
               "--save_total_limit", str(args.save_total_limit)]
    samples: list[dict] = []
    step = [0]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT) as run:
        def read_steps() -> None:
            for line in run.stdout:
                if m := re.match(r"step (\d+):", line):
                    step[0] = int(m.group(1))
        reader = threading.Thread(target=read_steps, daemon=True)
        reader.start()
        launcher = psutil.Process(run.pid)
        while run.poll() is None:
            ranks = rank_processes(launcher)
            try:
                rss = [p.memory_info().rss for p in ranks]
                fds = [p.num_fds() for p in ranks]
            except psutil.Error:  # a rank ended between listing and reading
                continue
            if len(rss) == 2:
                samples.append({"time": time.monotonic(), "step": step[0], "rss": rss, "fds": fds,
                                "nvme_bytes": folder_bytes(nvme), "checkpoints": len(checkpoints(str(out)))})
            time.sleep(args.every)
        reader.join()
        if run.returncode != 0:
            raise RuntimeError(f"hf-zero train ended with {run.returncode}")
    return summarize(samples, args)


def summarize(samples: list[dict], args: argparse.Namespace) -> dict:
    after_first_save = [s for s in samples if s["step"] >= args.save_steps]
    intervals: dict[int, list[int]] = {}
    for s in after_first_save:
        intervals.setdefault(s["step"] // args.save_steps, [0, 0])
        peaks = intervals[s["step"] // args.save_steps]
        intervals[s["step"] // args.save_steps] = [max(a, b) for a, b in zip(peaks, s["rss"])]
    firsts, lasts = intervals[min(intervals)], intervals[max(intervals)]
    growth = [last / first - 1 for first, last in zip(firsts, lasts)]
    return {
        "steps": args.steps, "save_steps": args.save_steps, "samples": len(samples),
        "rss_peak_per_interval_MiB": {k: [round(v / 2**20, 1) for v in peaks]
                                      for k, peaks in sorted(intervals.items())},
        "rss_growth_first_to_last_interval": [round(g, 4) for g in growth],
        "rss_flat_within_2_percent": all(abs(g) <= 0.02 for g in growth),
        "fds_after_first_save": [min(s["fds"][r] for s in after_first_save) for r in range(2)] +
                                [max(s["fds"][r] for s in after_first_save) for r in range(2)],
        "nvme_MiB_after_first_save": [round(min(s["nvme_bytes"] for s in after_first_save) / 2**20, 2),
                                      round(max(s["nvme_bytes"] for s in after_first_save) / 2**20, 2)],
        # The newest is complete before the oldest goes: save_total_limit + 1 for a moment.
        "most_complete_checkpoints": max(s["checkpoints"] for s in samples),
        "series": [(s["step"], s["rss"]) for s in samples],
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in result["series"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    for rank in range(2):
        ax.plot(steps, [rss[rank] / 2**20 for _, rss in result["series"]], label=f"rank {rank}")
    for save in range(result["save_steps"], result["steps"] + 1, result["save_steps"]):
        ax.axvline(save, color="0.85", linewidth=0.5)
    ax.set_xlabel("training step (grey: a checkpoint saved)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title(f"hf-zero train, stage 3, offload_param cpu + offload_optimizer nvme, {result['steps']} steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save_steps", type=int, default=100)
    parser.add_argument("--save_total_limit", type=int, default=2)
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--plot", help="write RSS against step to this PNG (needs matplotlib)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as work:
        result = soak(args, Path(work))
    if args.plot:
        plot(result, args.plot)
    print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=1))


if __name__ == "__main__":
    main()
