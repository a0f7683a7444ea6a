"""ZeRO++ on stage 3: each technique and all three side by side with plain stage 3, and a cluster projection.

4 gloo ranks stand for 2 nodes x 2 (`ranks_per_node` 2). Every configuration trains the same model from the
same seed in fresh processes; runs are interleaved (plain, qwZ, hpZ, qgZ, all three, then again) so that
drift of the machine hits all alike. Reported per configuration: the median step time over repeats (its
ratio to plain is the CPU cost of quantizing, since gloo over loopback gains nothing from fewer bytes), and
from the ledger (hf_zero/runtime/ledger.py `link_bytes`): node 0's cross-node volume as the ZeRO++ paper counts it,
and the bytes each rank sent over its links, intra-node and inter-node, averaged over the ranks.

hpZ with gradient accumulation: node 0's cross-node volume per step at 1, 2 and 4 micro-batches a step
(the secondary partition serves every micro-batch's forward until the optimizer step).

The projection then prices the paper's volumes on a cluster (a model, not a measurement): per step and GPU

    t_compute = 6 * params * tokens_per_gpu / (peak_flops * mfu)
    t_comm = node_volume / node_link + intra_bytes_per_gpu / nvlink_per_gpu
    step = t_compute + t_comm (no overlap)

where node_volume is what crosses each node's boundary (the paper's convention: a flat collective's
buffer once per node, which a ring's egress from each node is within (p-1)/p; qgZ's cross-node all-to-all
the quantized gradient), and intra_bytes the ring or all-to-all inside the node that hpZ and qgZ add. It is
run first for the ZeRO++ blog's cluster, to check it against the two points the blog publishes, then for
`--project_params` on H100 nodes.

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
from hf_zero.runtime.comm import SPANS  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402
from hf_zero.runtime.memory import BYTES_PER_ELEMENT  # noqa: E402
from hf_zero.settings.config import ZeroConfig  # noqa: E402

CONFIGS = {"plain": {}, "qwZ": {"quantized_weights": True}, "hpZ": {"hpz_partition_size": 2},
           "qgZ": {"quantized_gradients": True},
           "all three": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True}}
MIB = 2**20


def run_one(config: dict, model_name: str, dtype: str, batch: int, seq: int, warmup: int, steps: int,
            accumulation: int = 1) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_zoo.build(model_name, n_positions=max(seq, 128))
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The root freed after forward as well: the paper's schedule, whose bytes `formula_bytes` counts.
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "dtype": dtype, "ranks_per_node": 2,
                                                   "reshard_root_after_forward": True,
                                                   "gradient_accumulation_steps": accumulation, **config})
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        for _ in range(accumulation):
            ids = torch.randint(0, vocab, (batch, seq), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "psi": psi, "span": dict(engine.ledger.last_step_span_bytes),
            "node_volume_part": engine.ledger.last_step_paper_cross_node_bytes}


def ledger_bytes(ranks: list[dict]) -> dict:
    """Node 0's cross-node volume (the sum over its ranks, 0 and 1) and each span's bytes per rank."""
    per_rank = {span: sum(r["span"].get(span, 0) for r in ranks) / len(ranks) for span in SPANS}
    return {"node_volume": ranks[0]["node_volume_part"] + ranks[1]["node_volume_part"], **per_rank}


def formula_bytes(config: str, psi: float, element: int, block: int, per_node: int) -> tuple[float, float]:
    """(node_volume, intra_bytes_per_gpu) of a step at stage 3 with the root freed after forward (the paper's
    3 all-gathers and reduce-scatters of Ψ), by the paper's table: a forward all-gather (int8 values and an
    fp32 scale per block with qwZ), a backward all-gather (inside the node with hpZ), a reduce-scatter (int4
    and scales with qgZ, inside the node first). Inside a node a ring of N sends (N - 1)/N of its buffer per
    GPU, as does qgZ's all-to-all there."""
    on = CONFIGS[config]
    inside = (per_node - 1) / per_node
    gather = psi * (1 + 4 / block) if on.get("quantized_weights") else element * psi
    backward = 0.0 if on.get("hpz_partition_size") else gather
    backward_intra = inside * element * psi if on.get("hpz_partition_size") else 0.0
    reduce = psi * (0.5 + 4 / block) if on.get("quantized_gradients") else element * psi
    reduce_intra = inside * reduce if on.get("quantized_gradients") else 0.0
    return gather + backward + reduce, backward_intra + reduce_intra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-demo")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--accumulation", type=int, nargs="*", default=[1, 2, 4],
                   help="hpZ's cross-node volume per step at these micro-batches a step (none: skipped)")
    p.add_argument("--project_params", type=float, default=7e9)
    p.add_argument("--project_tokens_per_gpu", type=int, default=8192)
    args = p.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name, config in CONFIGS.items():
            ranks = spawn_gloo(run_one, 4, config, args.model, args.dtype, args.batch, args.seq, args.warmup,
                               args.steps)
            results[name].append({"seconds": ranks[0]["seconds"], "psi": ranks[0]["psi"], **ledger_bytes(ranks)})
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]['seconds']:.3f} s/step", flush=True)
    plain_s = statistics.median(r["seconds"] for r in results["plain"])
    psi, element = results["plain"][0]["psi"], BYTES_PER_ELEMENT[args.dtype]
    block = ZeroConfig().quantization_block_size
    print(f"\n{args.model} ({psi:,} parameters), stage 3 {args.dtype}, 4 gloo ranks as 2 nodes x 2, micro-batch "
          f"{args.batch} x {args.seq}, medians of {args.repeats} repeats x {args.steps} steps\n")
    print("| configuration | s/step | vs plain | node volume MiB/step (paper) | vs plain | intra-node MiB/rank | "
          "inter-node MiB/rank |")
    print("|---|---|---|---|---|---|---|")
    plain_volume = results["plain"][0]["node_volume"]
    for name, runs in results.items():
        seconds, figures = statistics.median(r["seconds"] for r in runs), runs[0]
        print(f"| {name} | {seconds:.3f} | {seconds / plain_s:.2f}x | {figures['node_volume'] / MIB:.2f} | "
              f"{figures['node_volume'] / plain_volume:.3f} | {figures['intra-node'] / MIB:.2f} | "
              f"{figures['inter-node'] / MIB:.2f} |")
    print("\nThe ledger's node volume per parameter (padding and blocks included) against the formula the "
          "projection uses:")
    for name, runs in results.items():
        volume, _ = formula_bytes(name, psi, element, block, 2)
        print(f"  {name}: {runs[0]['node_volume'] / psi:.3f} bytes/param (formula {volume / psi:.3f})")
    if args.accumulation:
        print("\nhpZ, node 0's cross-node volume per optimizer step by micro-batches a step:")
        for accumulation in args.accumulation:
            ranks = spawn_gloo(run_one, 4, CONFIGS["hpZ"], args.model, args.dtype, args.batch, args.seq, 0, 1,
                               accumulation)
            plain = spawn_gloo(run_one, 4, CONFIGS["plain"], args.model, args.dtype, args.batch, args.seq, 0, 1,
                               accumulation)
            print(f"  {accumulation}: hpZ {ledger_bytes(ranks)['node_volume'] / MIB:.2f} MiB, plain "
                  f"{ledger_bytes(plain)['node_volume'] / MIB:.2f} MiB", flush=True)
    check_against_the_blog()
    project(args.project_params, args.project_tokens_per_gpu)


# The ZeRO++ blog (microsoft.com/research, 2023-06-22; DeepSpeed's blogs/zeropp): 384 V100s, 24 DGX-2 nodes of
# 16, models of 18B to 138B parameters, end-to-end throughput of ZeRO++ (all three) over ZeRO-3.
BLOG_POINTS = [(400, 1024, (1.28, 1.36)), (400, 2048, (1.24, 1.29)), (100, 1024, (2.2, 2.2))]
V100_NODE = {"gpus_per_node": 16, "peak": 125e12, "nvlink": 150e9}  # fp16 tensor cores; NVSwitch per GPU
H100_NODE = {"gpus_per_node": 8, "peak": 989e12, "nvlink": 450e9}


def step_seconds(config: str, params: float, tokens: int, gbit: float, node: dict, mfu: float = 0.4) -> tuple:
    """(compute, comm) seconds of a step in 16-bit weights and gradients, blocks of 128."""
    compute = 6 * params * tokens / (node["peak"] * mfu)
    volume, intra = formula_bytes(config, params, 2, ZeroConfig().quantization_block_size, node["gpus_per_node"])
    return compute, volume / (gbit * 1e9 / 8) + intra / node["nvlink"]


def check_against_the_blog(mfu: float = 0.4) -> None:
    print(f"\nThe model against the blog's published points (V100 125 TFLOPS x MFU {mfu}, 16 GPUs a node, NVSwitch "
          f"150 GB/s per GPU; the ratio does not depend on the model's size, 18B or 138B):")
    print("| node link | tokens per GPU | ZeRO-3 step s | ZeRO++ step s | projected speed-up | blog | off by |")
    print("|---|---|---|---|---|---|---|")
    for gbit, tokens, (low, high) in BLOG_POINTS:
        plain, everything = (sum(step_seconds(c, 18e9, tokens, gbit, V100_NODE, mfu)) for c in ("plain", "all three"))
        gain = plain / everything
        off = 0.0 if low <= gain <= high else min(abs(gain - low) / low, abs(gain - high) / high)
        blog = f"{low:.2f}-{high:.2f}x" if low != high else f"up to {high:.1f}x"
        print(f"| {gbit} Gb/s | {tokens} | {plain:.2f} | {everything:.2f} | {gain:.2f}x | {blog} | {off:.0%} |")


def project(params: float, tokens: int, mfu: float = 0.4) -> None:
    """The step time of `params` on nodes of 8 H100s, from `formula_bytes`."""
    node = H100_NODE
    compute = step_seconds("plain", params, tokens, 100, node, mfu)[0]
    print(f"\nProjection: {params / 1e9:.0f}B parameters, bf16, {node['gpus_per_node']} H100s per node, {tokens} "
          f"tokens per GPU per step, compute {compute:.2f} s ({node['peak'] / 1e12:.0f} TFLOPS x MFU {mfu}), NVLink "
          f"{node['nvlink'] / 1e9:.0f} GB/s per GPU")
    print("| node link | configuration | node volume GB | intra GB/GPU | t_comm s | step s | vs plain |")
    print("|---|---|---|---|---|---|---|")
    for gbit in (100, 400):
        plain = sum(step_seconds("plain", params, tokens, gbit, node, mfu))
        for name in CONFIGS:
            volume, intra = formula_bytes(name, params, 2, ZeroConfig().quantization_block_size, node["gpus_per_node"])
            _, comm = step_seconds(name, params, tokens, gbit, node, mfu)
            print(f"| {gbit} Gb/s | {name} | {volume / 1e9:.1f} | {intra / 1e9:.1f} | {comm:.2f} | "
                  f"{compute + comm:.2f} | {plain / (compute + comm):.2f}x |")


if __name__ == "__main__":
    main()
