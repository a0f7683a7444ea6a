"""The main job, `hf-zero train` (hf_zero/train_lm.py): with tensor parallelism, ZeRO-R's partitioned
CPU checkpoints and CPU optimizer offload on 2 ranks it trains as the plain job does in one process."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from hf_zero import train_lm
from hf_zero.config import ZeroConfigError
from hf_zero.launch import spawn_gloo

# Dropout off: with tensor parallelism each rank draws masks for its own heads, so random masks differ.
SHORT = ["--max_steps", "12", "--seq_len", "64", "--batch_size", "4", "--log_every", "4", "--max_minutes", "5",
         "--dropout", "0"]


def run_job(argv: list[str]) -> dict[str, float]:
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    return train_lm.main(parser.parse_args(argv))


@pytest.mark.slow
def test_tensor_parallel_job_with_zero_r_and_cpu_offload_trains_as_one_process():
    plain = spawn_gloo(run_job, 1, [*SHORT, "--zero_stage", "0"])[0]
    parallel = spawn_gloo(run_job, 2, [*SHORT, "--zero_stage", "2", "--tensor_parallel_size", "2",
                                       "--partition_activations", "--cpu_checkpointing",
                                       "--offload_optimizer", "cpu"])
    assert plain["final_train_loss"] < plain["first_loss"] - 1.0  # it learns
    for summary in parallel:
        assert summary["steps"] == plain["steps"] == 12
        for key in ("first_loss", "final_train_loss", "val_loss"):
            assert summary[key] == pytest.approx(plain[key], rel=1e-4), key


@pytest.mark.parametrize("flags, message", [
    (["--tensor_parallel_size", "3"], "--tensor_parallel_size must divide the number of processes (2); got 3"),
    (["--zero_stage", "3", "--hpz_partition_size", "4"], "--hpz_partition_size must divide the ranks per node "
                                                         "(2): a secondary partition lies within one node; got 4"),
])
def test_a_layout_the_processes_cannot_take_stops_before_they_start(refused_before_launch, flags, message):
    code, err = refused_before_launch("train", "--nproc_per_node", "2", *flags)
    assert code == 2
    assert message in err


def test_a_micro_batch_whose_activations_cannot_fit_is_refused_before_launch_naming_the_flag(refused_before_launch):
    """Issue 53, item 8: a billion sequences passed the check, and both ranks were OOM-killed 35 s later with only
    torchrun's `exitcode: -9`. The bound is a lower one (hf_zero.estimate's 12 bytes per hidden unit, token and
    layer), so what it suggests is not refused by it."""
    code, err = refused_before_launch("train", "--nproc_per_node", "2", "--batch_size", "1000000000")
    found = re.fullmatch(r"hf-zero train: --batch_size 1000000000 of --seq_len 128 needs at least [\d,.]+ GiB of "
                         r"activations per rank for gpt2-demo \(fp32\), more than the host memory available to each "
                         r"of the 2 ranks on this node, [\d,.]+ GiB: use a --batch_size below (\d+), or a shorter "
                         r"--seq_len\n", err)
    assert code == 2 and found, err
    suggested = int(found.group(1))
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    # Not refused (half of it: the host's available memory moves meanwhile)
    train_lm.check_args(parser.parse_args(["--batch_size", str(suggested // 2)]), 2, 2)
    with pytest.raises(ZeroConfigError, match="--batch_size"):
        train_lm.check_args(parser.parse_args(["--batch_size", str(10 * suggested)]), 2, 2)


def test_a_misspelt_flag_is_one_line_naming_the_nearest_one(refused_before_launch):
    assert refused_before_launch("train", "--zero_stgae", "2") == (
        2, "hf-zero train: unrecognized arguments: --zero_stgae 2; did you mean --zero_stage? (--help lists the flags)\n")


def test_the_progress_bar_ends_with_the_time_budget_not_the_step_limit():
    done = subprocess.run([sys.executable, "-m", "hf_zero", "train", "--nproc_per_node", "1", "--max_steps", "100000",
                           "--max_minutes", "0.05", "--seq_len", "32", "--batch_size", "2", "--log_every", "1000"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    bars = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.startswith("train (0.05 min budget)")]
    steps, total = map(int, re.search(r"\| (\d+)/(\d+) \[", bars[-1]).groups())
    assert steps == total < 100000, bars[-1]
    summary = next(line for line in done.stderr.splitlines() if " steps in " in line)
    assert summary.startswith(f"{steps} steps in ")


@pytest.mark.parametrize("flags, message", [
    (["--batch_size", "0"], "--batch_size must be at least 1; got 0"),
    (["--batch_size", "-3"], "--batch_size must be at least 1; got -3"),
    (["--seq_len", "0"], "--seq_len must be at least 1; got 0"),
    (["--max_steps", "0"], "--max_steps must be at least 1; got 0"),
    (["--max_steps", "-1"], "--max_steps must be at least 1; got -1"),
    (["--log_every", "0"], "--log_every must be at least 1; got 0"),
    (["--max_minutes", "nan"], "--max_minutes must be a positive number; got nan"),
    (["--max_minutes", "-1"], "--max_minutes must be a positive number; got -1.0"),
    (["--lr", "inf"], "--lr must be a positive number; got inf"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1); got 1.5"),
    (["--text", "EMPTY"], "holds 0 bytes; its last 5% (0 bytes) validate, which needs more than --seq_len + 1 (129)"),
    (["--text", "MISSING"], "no readable file there"),
    (["--seq_len", "30000"], "give a longer text or a shorter --seq_len"),
])
def test_a_setting_the_job_cannot_run_with_is_one_line_before_any_process_starts(refused_before_launch, tmp_path,
                                                                                  flags, message):
    (tmp_path / "EMPTY").write_bytes(b"")
    flags = [str(tmp_path / f) if f in ("EMPTY", "MISSING") else f for f in flags]
    code, err = refused_before_launch("train", "--nproc_per_node", "2", *flags)
    assert code == 2
    assert err.startswith("hf-zero train: --") and message in err and err.count("\n") == 1, err
