"""A benchmark of this working tree against another revision's code, in one invocation (an A/B of a change).

The base revision is checked out into a temporary git worktree; the benchmark script is then run from each tree
in turn, one repeat at a time (base, this, base, this ...), so that drift of the machine hits both alike. Each
script imports the code of its own tree (benchmarks put their tree first on sys.path). The script must take
`--repeats` and `--json` as benchmarks/bench_zero.py does: {system: [{"step_s", "peak_rss_mib"}, ...]}.

  python benchmarks/ab_revision.py --base HEAD --repeats 5 -- benchmarks/bench_zero.py --workload speed \\
      --systems hf_zero_3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD, main~1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS: the benchmark, relative to the repository")
    args = p.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        p.error("name the benchmark after --, e.g. -- benchmarks/bench_zero.py --workload speed")
    script, bench_args = bench[0], bench[1:]
    with tempfile.TemporaryDirectory() as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            runs = {"base": {}, "this": {}}
            for r in range(args.repeats):
                for label, tree in (("base", base_tree), ("this", HERE)):
                    out = Path(scratch) / f"{label}{r}.json"
                    subprocess.run([sys.executable, str(tree / script), *bench_args, "--repeats", "1", "--json",
                                    str(out)], check=True, cwd=tree, stdout=subprocess.DEVNULL)
                    for system, results in json.loads(out.read_text()).items():
                        runs[label].setdefault(system, []).extend(results)
                    print(f"repeat {r} {label}: " + ", ".join(f"{s} {v[-1]['step_s']:.3f} s/step"
                                                             for s, v in runs[label].items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(base_tree)], check=True)
    print(f"\n{' '.join(bench)}: {args.base} (base) against this tree, {args.repeats} interleaved repeats\n")
    print("| system | base s/step (median) | this s/step (median) | this / base | base peak RSS (MiB) | "
          "this peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for system, base_results in runs["base"].items():
        base_step = statistics.median(x["step_s"] for x in base_results)
        this_step = statistics.median(x["step_s"] for x in runs["this"][system])
        base_rss = statistics.median(x["peak_rss_mib"] for x in base_results)
        this_rss = statistics.median(x["peak_rss_mib"] for x in runs["this"][system])
        print(f"| {system} | {base_step:.3f} | {this_step:.3f} | {this_step / base_step:.3f} | {base_rss:.0f} | "
              f"{this_rss:.0f} |")


if __name__ == "__main__":
    main()
