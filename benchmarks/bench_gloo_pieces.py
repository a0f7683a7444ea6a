"""A gloo collective as one call or in per-rank pieces: what each costs the host, by size and ranks, in the same
invocation. This is what chooses hf_zero.runtime.comm.GLOO_WHOLE_BYTES.

  python -m benchmarks.bench_gloo_pieces --ranks 2 4 --repeats 5

On gloo the Communicator gathers in place by one broadcast per rank and reduce-scatters by one reduce per rank to
its owner, since gloo's own all_gather_single and reduce_scatter_single copy their whole output (input) into a
temporary first. A collective of at most GLOO_WHOLE_BYTES is one call instead (an all-gather, and an all-reduce for
a reduce-scatter). Each round here is an all-gather of `bytes` then a reduce-scatter of as many, issued through the
Communicator as a stage-3 unit issues them (asynchronous, then waited), with the collective sequence check on as
by default. Reported per collective: the rank's process CPU time (its gloo threads included) and the wall time,
the median over ranks and repeats; each (size, ranks, path) runs in fresh processes, the paths alternating.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_zero.runtime.launch import spawn_gloo

SIZES = [256, 64 * 1024, 256 * 1024, 1024 * 1024]  # bytes of the gathered output / reduced input
PATHS = {"one call": 2**62, "pieces": 0}  # Communicator.pieces_above_bytes for each path
WARMUP = 20


def rounds_on_this_rank(nbytes: int, pieces_above: int, rounds: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per collective on this rank, over `rounds` all-gathers and reduce-scatters."""
    import torch.distributed as dist

    from hf_zero.runtime.comm import Communicator
    from hf_zero.runtime.ledger import Ledger

    comm, world, rank = Communicator(Ledger()), dist.get_world_size(), dist.get_rank()
    comm.pieces_above_bytes = pieces_above
    numel = nbytes // 4 // world * world
    gathered, reduced = torch.zeros(numel), torch.ones(numel)
    mine = gathered[rank * numel // world:(rank + 1) * numel // world]

    def one_round() -> None:
        comm.all_gather_(gathered, mine, async_op=True).wait()
        reduced.fill_(1.0)  # the sums stay finite round after round
        comm.reduce_scatter_(reduced[:numel // world], reduced, async_op=True).wait()

    for _ in range(WARMUP):
        one_round()
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        one_round()
    return (time.process_time() - cpu) / (2 * rounds), (time.perf_counter() - wall) / (2 * rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bytes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    report = []
    for ranks in args.ranks:
        for nbytes in args.bytes:
            runs: dict[str, list[tuple[float, float]]] = {path: [] for path in PATHS}
            for _ in range(args.repeats):
                for path, pieces_above in PATHS.items():
                    runs[path] += spawn_gloo(rounds_on_this_rank, ranks, nbytes, pieces_above, args.rounds)
            median = {path: (statistics.median(c for c, _ in r), statistics.median(w for _, w in r))
                      for path, r in runs.items()}
            report.append({"ranks": ranks, "bytes": nbytes, **{
                path: {"cpu_us": cpu * 1e6, "wall_us": wall * 1e6} for path, (cpu, wall) in median.items()}})
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"gloo, one thread per rank, medians over ranks and {args.repeats} repeats of {args.rounds} rounds")
    print("| ranks | bytes | one call: CPU µs | pieces: CPU µs | CPU, one call / pieces | wall, one call / pieces |")
    print("|---|---|---|---|---|---|")
    for row in report:
        whole, pieces = row["one call"], row["pieces"]
        print(f"| {row['ranks']} | {row['bytes']:,} | {whole['cpu_us']:.0f} | {pieces['cpu_us']:.0f} | "
              f"{whole['cpu_us'] / pieces['cpu_us']:.2f} | {whole['wall_us'] / pieces['wall_us']:.2f} |")


if __name__ == "__main__":
    main()
