"""Consolidating a 2-rank stage-3 checkpoint into transformers weights: `hf-zero consolidate` beside
DeepSpeed's zero_to_fp32 on a DeepSpeed checkpoint of the same model (same seed, same weights).

  python benchmarks/bench_consolidate.py --model gpt2-bench-memory --max_shard_size 100MB --repeats 3

Both checkpoints are written once by 2 gloo ranks at stage 3. Each conversion then runs in a fresh
process, interleaved repeat by repeat; its peak resident memory is measured from the start of the
conversion (the high-water mark is reset there), so the interpreter and imports are not counted.
The two outputs are compared tensor by tensor. DeepSpeed is needed (`pip install -e ".[bench]"`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zero  # noqa: E402
import model_zoo  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402

SYSTEMS = ["hf_zero", "deepspeed"]

CONVERT = """
import json, sys, time, os
os.environ["DS_ACCELERATOR"] = "cpu"
import psutil
from hf_zero.runtime.memory import peak_rss, reset_peak_rss
system, checkpoint, output, shard = sys.argv[1:5]
if system == "deepspeed":
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
else:
    from hf_zero.checkpoint.consolidate import consolidate
before = psutil.Process().memory_info().rss
reset_peak_rss()
start = time.perf_counter()
if system == "deepspeed":
    # safe_serialization=True fails in DeepSpeed 0.19 on tied embeddings ("Some tensors share memory").
    convert_zero_checkpoint_to_fp32_state_dict(checkpoint, output, max_shard_size=shard, safe_serialization=False)
else:
    consolidate(checkpoint, output, max_shard_size=shard, progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "growth": peak_rss() - before}))
"""


def save_checkpoints(model_name: str, root: str) -> int:
    """The same initial model saved by hf_zero and by DeepSpeed, both at stage 3 on these 2 ranks."""
    import deepspeed

    torch.manual_seed(0)
    model = model_zoo.build(model_name)
    psi = sum(p.numel() for p in model.parameters())
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    engine.save_checkpoint(f"{root}/hf_zero")
    del engine, model
    torch.manual_seed(0)
    model = model_zoo.build(model_name)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    engine.save_checkpoint(f"{root}/deepspeed")
    return psi


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded output, safetensors or torch pickles."""
    out = {}
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index_name).is_file():
            files = sorted(set(json.loads((folder / index_name).read_text())["weight_map"].values()))
            for file in files:
                if file.endswith(".safetensors"):
                    with safe_open(str(folder / file), framework="pt") as f:
                        out.update({k: f.get_tensor(k) for k in f.keys()})
                else:
                    out.update(torch.load(folder / file, weights_only=True))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-bench-memory", choices=model_zoo.list())
    p.add_argument("--max_shard_size", default="100MB")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1]) as root:
        psi = spawn_gloo(save_checkpoints, 2, args.model, root)[0]
        runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for r in range(args.repeats):
            for system in SYSTEMS:
                output = Path(root) / f"out_{system}"
                done = subprocess.run([sys.executable, "-c", CONVERT, system, f"{root}/{system}", str(output),
                                       args.max_shard_size], capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{system} conversion failed:\n{done.stderr[-3000:]}")
                runs[system].append(json.loads(done.stdout.splitlines()[-1]))
                print(f"repeat {r} {system}: {runs[system][-1]}", flush=True)
        ours, theirs = weights(Path(root) / "out_hf_zero"), weights(Path(root) / "out_deepspeed")
        shared = sorted(set(ours) & set(theirs))
        identical = all(torch.equal(ours[k], theirs[k]) for k in shared)
        only = sorted(set(ours) ^ set(theirs))
    model_mib = 4 * psi / 2**20
    print(f"\n{args.model}: Ψ = {psi:,} ({model_mib:.0f} MiB in fp32), --max_shard_size {args.max_shard_size}, "
          f"{args.repeats} interleaved repeat(s); outputs identical on {len(shared)} shared tensors: {identical}; "
          f"in one output only: {only or 'none'}\n")
    print("| system | peak RSS above start (MiB) | x hf_zero | seconds | x hf_zero |")
    print("|---|---|---|---|---|")
    base = {k: statistics.median(x[k] for x in runs["hf_zero"]) for k in ("growth", "seconds")}
    for system in SYSTEMS:
        growth = statistics.median(x["growth"] for x in runs[system])
        seconds = statistics.median(x["seconds"] for x in runs[system])
        print(f"| {system} | {growth / 2**20:.0f} | {growth / base['growth']:.2f} | {seconds:.1f} | "
              f"{seconds / base['seconds']:.2f} |")


if __name__ == "__main__":
    main()
