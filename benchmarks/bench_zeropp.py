"""ZeRO++ on stage 3: each technique and all three side by side with plain stage 3, and a cluster projection.

4 gloo ranks stand for 2 nodes x 2 (`ranks_per_node` 2). Every configuration trains the same model from the
same seed in fresh processes; runs are interleaved (plain, qwZ, hpZ, qgZ, all three, then again) so that
drift of the machine hits all alike. Reported per configuration: the median step time over repeats (its
ratio to plain is the CPU cost of quantizing, since gloo over loopback gains nothing from fewer bytes), and
the ledger's bytes per step and rank, intra-node and inter-node.

The projection then prices those bytes on a cluster: per-rank bytes per parameter from the ledger, scaled to
a model of `--project_params` on nodes of 8 GPUs, with

    t_comm = inter_bytes / (node_link / gpus_per_node) + intra_bytes / nvlink_per_gpu
    t_compute = 6 * params * tokens_per_gpu / (peak_flops * mfu)

and a step taking t_compute + t_comm without overlap, max(t_compute, t_comm) with perfect overlap. qgZ's
inter-node share is 1/ranks_per_node of its all-to-all's input, so measured at 2 per node it is rescaled to 8
(the formula is checked against the ledger at 2 per node, printed beside it).

  python benchmarks/bench_zeropp.py --repeats 3 --dtype fp32
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zero  # noqa: E402
import model_zoo  # noqa: E402
from hf_zero.config import ZeroConfig  # noqa: E402
from hf_zero.launch import spawn_gloo  # noqa: E402
from hf_zero.memory import BYTES_PER_ELEMENT  # noqa: E402

CONFIGS = {"plain": {}, "qwZ": {"quantized_weights": True}, "hpZ": {"hpz_partition_size": 2},
           "qgZ": {"quantized_gradients": True},
           "all three": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True}}
MIB = 2**20


def run_one(config: dict, model_name: str, dtype: str, batch: int, seq: int, warmup: int, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_zoo.build(model_name, n_positions=max(seq, 128))
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The root freed after forward as well: the paper's schedule, whose bytes `formula_bytes` counts.
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "dtype": dtype, "ranks_per_node": 2,
                                                   "reshard_root_after_forward": True, **config})
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(warmup + steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "psi": psi, "span": dict(engine.ledger.last_step_span_bytes),
            "bytes": dict(engine.ledger.last_step_bytes)}


def formula_bytes(config: str, psi: float, element: int, block: int, per_node: int) -> tuple[float, float]:
    """(intra, inter) bytes per rank and step at stage 3 with the root freed after forward (the paper's 3Ψ):
    a forward and a backward all-gather and a reduce-scatter of Ψ, each as the technique sends it."""
    quantized_w = psi * (1 + 4 / block)            # int8 values and an fp32 scale per block
    quantized_g = psi * (0.5 + 4 / block)          # int4 values and an fp32 scale per block
    on = CONFIGS[config]
    forward = quantized_w if on.get("quantized_weights") else element * psi
    backward = forward if not on.get("hpz_partition_size") else 0.0
    backward_intra = element * psi if on.get("hpz_partition_size") else 0.0
    reduce_inter = quantized_g / per_node if on.get("quantized_gradients") else element * psi
    reduce_intra = quantized_g if on.get("quantized_gradients") else 0.0
    return backward_intra + reduce_intra, forward + backward + reduce_inter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-demo")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--project_params", type=float, default=7e9)
    p.add_argument("--project_tokens_per_gpu", type=int, default=8192)
    args = p.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name, config in CONFIGS.items():
            results[name].append(spawn_gloo(run_one, 4, config, args.model, args.dtype, args.batch, args.seq,
                                            args.warmup, args.steps)[0])
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]['seconds']:.3f} s/step", flush=True)
    plain_s = statistics.median(r["seconds"] for r in results["plain"])
    psi, element = results["plain"][0]["psi"], BYTES_PER_ELEMENT[args.dtype]
    block = ZeroConfig().quantization_block_size
    print(f"\n{args.model} ({psi:,} parameters), stage 3 {args.dtype}, 4 gloo ranks as 2 nodes x 2, micro-batch "
          f"{args.batch} x {args.seq}, medians of {args.repeats} repeats x {args.steps} steps\n")
    print("| configuration | s/step | vs plain | intra-node MiB/step | inter-node MiB/step | inter vs plain |")
    print("|---|---|---|---|---|---|")
    plain_inter = results["plain"][0]["span"].get("inter-node", 0)
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        span = runs[0]["span"]
        print(f"| {name} | {seconds:.3f} | {seconds / plain_s:.2f}x | {span.get('intra-node', 0) / MIB:.2f} | "
              f"{span.get('inter-node', 0) / MIB:.2f} | {span.get('inter-node', 0) / plain_inter:.2f} |")
    print("\nThe ledger's bytes per parameter and rank at 2 per node (padding included) against the formula:")
    for name, runs in results.items():
        span = runs[0]["span"]
        intra, inter = formula_bytes(name, psi, element, block, 2)
        print(f"  {name}: ledger intra {span.get('intra-node', 0) / psi:.3f} inter {span.get('inter-node', 0) / psi:.3f}"
              f" bytes/param; formula {intra / psi:.3f} / {inter / psi:.3f}")
    project(args.project_params, args.project_tokens_per_gpu)


def project(params: float, tokens: int, gpus_per_node: int = 8, peak: float = 989e12, mfu: float = 0.4,
            nvlink: float = 450e9) -> None:
    """The step time of `params` in bf16 on nodes of 8 H100s, from the per-rank bytes of `formula_bytes`."""
    compute = 6 * params * tokens / (peak * mfu)
    print(f"\nProjection: {params / 1e9:.0f}B parameters, bf16, {gpus_per_node} GPUs per node, {tokens} tokens per "
          f"GPU per step, compute {compute:.2f} s ({peak / 1e12:.0f} TFLOPS x MFU {mfu}), NVLink {nvlink / 1e9:.0f} "
          f"GB/s per GPU")
    print("| node link | configuration | inter GB/GPU | intra GB/GPU | t_comm s | step s, no overlap | "
          "step s, overlapped |")
    print("|---|---|---|---|---|---|---|")
    for gbit in (100, 400):
        per_gpu = gbit * 1e9 / 8 / gpus_per_node
        for name in CONFIGS:
            intra, inter = formula_bytes(name, params, 2, ZeroConfig().quantization_block_size, gpus_per_node)
            comm = inter / per_gpu + intra / nvlink
            print(f"| {gbit} Gb/s | {name} | {inter / 1e9:.1f} | {intra / 1e9:.1f} | {comm:.1f} | "
                  f"{compute + comm:.1f} | {max(compute, comm):.1f} |")


if __name__ == "__main__":
    main()
