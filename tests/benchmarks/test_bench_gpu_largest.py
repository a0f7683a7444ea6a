"""benchmarks/bench_gpu_largest.py's search, on CPU: it needs CUDA to run, but not to plan its trials."""
from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

import pytest

import model_zoo
from benchmarks import bench_gpu_largest as bench
from hf_zero.cli.estimate import Setting

GIB = 2 ** 30


def test_with_offload_the_search_stops_at_what_host_memory_holds():
    """On one 80 GB H100 with 125 GiB of host memory, stage 3 with CPU offload keeps 18 bytes a parameter on the
    host (ZeRO-Offload's bound, about 7B): the search used to go up to 512 layers of width 4096 (100B), each
    trial past the bound killed by the kernel after minutes."""
    per_layer = model_zoo.parameter_count("gpt2-xl", **bench.gpt2_overrides(4096, 2)) - \
        model_zoo.parameter_count("gpt2-xl", **bench.gpt2_overrides(4096, 1))
    offload = Setting(3, 1, "cpu", "cpu")
    hi = bench.depth_bound(offload, 80 * GIB, 125 * GIB, per_layer, 1.2, 512)
    assert hi == int(1.2 * 125 * GIB / 18 / per_layer) + 1 < 60
    # Without offload the device's formula bounds it, as before: 16Ψ on one GPU.
    assert bench.depth_bound(Setting(0, 1), 80 * GIB, 125 * GIB, per_layer, 1.2, 512) == \
        int(1.2 * (80 * GIB / 16) / per_layer) + 1


@pytest.mark.parametrize("stderr, returncode", [("torch.OutOfMemoryError: CUDA out of memory", 1),
                                                ("Signal 9 (SIGKILL) received by PID 1234", 1),
                                                ("", -9)])
def test_a_trial_killed_for_memory_counts_as_not_fitting(monkeypatch, stderr, returncode):
    """The kernel's out-of-memory killer ends a trial with SIGKILL (torchrun: "Signal 9 (SIGKILL)"): the model
    did not fit in host memory, which the bisection must take as "smaller", not abort the run."""
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode, "", stderr))
    args = Namespace(nproc_per_node=1, n_embd=64, seq=8, steps=1)
    assert bench.run_trial("3+offload", args, 4) is None


def test_any_other_failure_of_a_trial_stops_the_search_with_its_error(monkeypatch):
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ValueError: bad width"))
    with pytest.raises(RuntimeError, match="ValueError: bad width"):
        bench.run_trial("3", Namespace(nproc_per_node=1, n_embd=64, seq=8, steps=1), 4)


def test_the_plans_largest_is_the_deepest_trial_it_fits_holding_at_least_the_formulas_model_states(tmp_path):
    """`--plan_only` on CPU, as a user runs it: a GPT-2 of width 64 at stage 0 on one GPU of 0.08 GiB. The depth
    its table gives fits by the plan and one layer more does not, and the plan's peak there holds at least the
    paper's 16Ψ (which counts model states only, where the plan adds activations and the step's temporaries)."""
    done = subprocess.run([sys.executable, bench.__file__, "--plan_only", "--gpu_memory", "0.08", "--host_memory", "4",
                           "--settings", "0", "--n_embd", "64", "--seq", "8", "--max_layers", "6"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 0 |")).split("|")
    layers = int(row[7])
    assert 1 <= layers < 6 and row[2].strip() == "-"  # nothing trained
    args = Namespace(nproc_per_node=1, n_embd=64, seq=8)
    gpu, host = int(0.08 * GIB), 4 * GIB
    planned = bench.planned_fit("0", args, gpu, host, layers, tmp_path)
    psi = model_zoo.parameter_count("gpt2-xl", **bench.gpt2_overrides(64, layers))
    assert planned is not None and 16 * psi <= planned["device_peak"] <= gpu
    assert bench.planned_fit("0", args, gpu, host, layers + 1, tmp_path) is None


@pytest.mark.parametrize("flags, said", [(["--plan_only", "--gpu_memory", "80"],
                                          "--plan_only plans for a machine given by --gpu_memory and --host_memory"),
                                         (["--gpu_memory", "80"],
                                          "--gpu_memory and --host_memory describe the machine for --plan_only")])
def test_the_machines_memory_is_given_for_planning_alone_and_only_then(flags, said):
    done = subprocess.run([sys.executable, bench.__file__, *flags], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and said in done.stderr
