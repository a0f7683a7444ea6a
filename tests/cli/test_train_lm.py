"""The main job, `hf-zero train` (hf_zero/cli/train_lm.py): with tensor parallelism, ZeRO-R's partitioned
CPU checkpoints and CPU optimizer offload on 2 ranks it trains as the plain job does in one process."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.cli import train_lm
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.settings.config import ZeroConfigError

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


def compiled_job(argv: list[str]) -> dict:
    import torch._dynamo

    return {**run_job(argv), "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


@pytest.mark.slow
def test_a_compiled_job_trains_as_the_same_job_eager():
    """--compile at stage 3 on 2 ranks (each draws its own batches, so the reference is the same job eager): the
    blocks compiled (dynamo's own count of graphs), the losses eager's."""
    eager = spawn_gloo(run_job, 2, [*SHORT, "--zero_stage", "3"])
    compiled = spawn_gloo(compiled_job, 2, [*SHORT, "--zero_stage", "3", "--compile", "--compile_backend", "aot_eager"])
    for summary, reference in zip(compiled, eager):
        assert summary["graphs"] >= 1
        for key in ("first_loss", "final_train_loss", "val_loss"):
            assert summary[key] == pytest.approx(reference[key], rel=1e-6), key


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
    """A billion sequences passed the check, and both ranks were OOM-killed 35 s later with only
    torchrun's `exitcode: -9`. The bound is a lower one (hf_zero.cli.estimate's 12 bytes per hidden unit, token and
    layer), so what it suggests is not refused by it."""
    code, err = refused_before_launch("train", "--nproc_per_node", "2", "--batch_size", "1000000000")
    found = re.fullmatch(r"hf-zero train: --batch_size 1000000000 of --seq_len 128 needs at least [\d,.]+ GiB of "
                         r"activations per rank for gpt2-demo \(fp32\), more than the host memory available to each "
                         r"of the 2 ranks on this node, [\d,.]+ GiB: use a --batch_size of at most (\d+), or a shorter "
                         r"--seq_len\n", err)
    assert code == 2 and found, err
    suggested = int(found.group(1))
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    # Not refused (half of it: the host's available memory moves meanwhile)
    train_lm.check_args(parser.parse_args(["--batch_size", str(suggested // 2)]), 2, 2)
    with pytest.raises(ZeroConfigError, match="--batch_size"):
        train_lm.check_args(parser.parse_args(["--batch_size", str(10 * suggested)]), 2, 2)


@pytest.mark.parametrize("sequences_that_fit", [682.5, 0.5])
def test_the_batch_size_refusal_names_the_largest_batch_it_accepts(monkeypatch, sequences_that_fit):
    """The refusal said "below 682" where 682 was accepted. Where not one sequence fits, it names
    no batch size."""
    from types import SimpleNamespace

    import torch

    from hf_zero.cli.estimate import activation_bytes

    per_sequence = activation_bytes("gpt2-demo", 1, 128, False, "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the host's memory, as on this machine
    monkeypatch.setattr(train_lm.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=int(2 * sequences_that_fit * per_sequence)))
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    fits = int(sequences_that_fit)
    if fits:
        train_lm.check_args(parser.parse_args(["--batch_size", str(fits)]), 2, 2)
    with pytest.raises(ZeroConfigError) as refused:
        train_lm.check_args(parser.parse_args(["--batch_size", str(fits + 1)]), 2, 2)
    assert str(refused.value).endswith(f"use a --batch_size of at most {fits}, or a shorter --seq_len" if fits else
                                       "GiB: use a shorter --seq_len"), refused.value


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
    (["--max_restarts", "2"], "--max_restarts resumes from the checkpoints that --output_dir and --save_steps write"),
    (["--save_steps", "10"], "--save_steps must be 0 or more, and above 0 needs --output_dir; got 10 without"),
    (["--output_dir", "OUT", "--save_steps", "5", "--save_total_limit", "0"], "--save_total_limit must be at least 1"),
    (["--compile", "--compile_backend", "inductr"], "--compile_backend 'inductr' is not a torch.compile backend"),
    (["--compile_mode", "default"], "--compile_mode is set but --compile is off"),
])
def test_a_setting_the_job_cannot_run_with_is_one_line_before_any_process_starts(refused_before_launch, tmp_path,
                                                                                  flags, message):
    (tmp_path / "EMPTY").write_bytes(b"")
    flags = [str(tmp_path / f) if f in ("EMPTY", "MISSING") else f for f in flags]
    code, err = refused_before_launch("train", "--nproc_per_node", "2", *flags)
    assert code == 2
    assert err.startswith("hf-zero train: --") and message in err and err.count("\n") == 1, err


FAULTS = Path(__file__).parents[1] / "scripts" / "faults"  # sitecustomize.py: SIGKILL a chosen rank at a chosen point


def test_a_job_whose_rank_is_killed_restarts_from_its_newest_checkpoint_and_ends_as_the_uninterrupted_one(tmp_path):
    """`hf-zero train --max_restarts 1` at stage 3 on 2 ranks, 12 steps with a checkpoint every 4 (the newest 2 kept):
    rank 1 killed inside step 7 restarts from step-4 with its schedule, random state (dropout on) and place in the
    data, and the checkpoint at step 12 holds the uninterrupted job's masters bit for bit."""
    from safetensors.torch import load_file

    def job(folder: str, *more: str, kills: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hf_zero", "train", "--nproc_per_node", "2", "--model", "gpt2-tiny",
             "--zero_stage", "3", "--max_steps", "12", "--seq_len", "32", "--batch_size", "2", "--log_every", "4",
             "--output_dir", str(tmp_path / folder), "--save_steps", "4", "--save_total_limit", "2", *more],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]),
                 "HF_ZERO_TEST_KILLS": kills})

    straight = job("straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    restarted = job("restarted", "--max_restarts", "1", kills="1:0:backward=7")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"restart 1: resuming from {tmp_path / 'restarted' / 'step-4'} (step 4)" in restarted.stderr
    assert sorted(p.name for p in (tmp_path / "restarted").iterdir()) == ["step-12", "step-8"]  # the newest 2
    for rank in range(2):
        shard = f"rank{rank:05d}-of-00002.safetensors"
        expected, resumed = (load_file(tmp_path / f / "step-12" / shard) for f in ("straight", "restarted"))
        assert expected.keys() == resumed.keys()
        for key, tensor in expected.items():
            assert torch.equal(tensor, resumed[key]), key


def test_zero_stage_auto_plans_among_the_stages_the_other_flags_allow():
    """hpZ needs stage 3, so `--zero_stage auto --hpz_partition_size 2` plans stage 3 alone; it was refused with
    stage 2's message, the default stage the other flags were checked at."""
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    args = parser.parse_args(["--zero_stage", "auto", "--hpz_partition_size", "2", "--batch_size", "1",
                              "--seq_len", "32"])
    train_lm.plan_settings(args, 4, 2)
    assert args.zero_stage == 3 and args.hpz_partition_size == 2
    assert args.planned_peak > 0


@pytest.mark.parametrize("given, on_nvme", [
    (["--zero_stage", "auto", "--offload_optimizer", "nvme", "--offload_param", "nvme"], True),
    (["--zero_stage", "3", "--offload_optimizer", "auto"], False),
    (["--zero_stage", "3", "--offload_optimizer", "auto", "--offload_param", "nvme"], True),
], ids=["offloaded to NVMe, the stage planned", "the offload planned",
        "the optimizer's offload planned beside parameters on NVMe (which need it there)"])
def test_zero_stage_auto_plans_with_nvme_and_keeps_the_folder_only_where_the_plan_offloads_there(tmp_path, given,
                                                                                                   on_nvme):
    """The processes start with what the plan chose: the NVMe folder where it offloads there, else none, said to
    them as --nvme_path '' (the last of a repeated option is the one they keep), so that their settings hold."""
    parser = argparse.ArgumentParser()
    train_lm.add_arguments(parser)
    argv = [*given, "--nvme_path", str(tmp_path), "--batch_size", "1", "--seq_len", "32"]
    args = parser.parse_args(argv)
    train_lm.plan_settings(args, 2, 2)
    assert (args.offload_optimizer == "nvme") == on_nvme and args.zero_stage == 3
    started = parser.parse_args(train_lm.concrete_argv(argv, args))
    assert started.nvme_path == (str(tmp_path) if on_nvme else "")
    train_lm.check_args(started, 2, 2)  # the processes' settings hold
    assert not any(tmp_path.iterdir())  # planning wrote nothing there


def test_zero_stage_auto_trains_with_the_plans_choice_and_checks_the_step_against_it(tmp_path):
    """`hf-zero train --zero_stage auto`: the plan runs before the processes start, prints its candidates, and the
    processes train with the chosen setting, each checking its second step's peak against the plan."""
    out = subprocess.run([sys.executable, "-m", "hf_zero", "train", "--zero_stage", "auto", "--max_steps", "3",
                          "--nproc_per_node", "2", "--batch_size", "2", "--seq_len", "32", "--log_every", "1"],
                         capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    chosen = next(line for line in text.splitlines() if line.startswith("chosen: "))
    stage = int(chosen.split()[2].rstrip(","))
    assert f"ZeRO stage {stage}, 2 data-parallel rank(s)" in text  # trained with it
    assert "| stage 0, micro-batch 2 |" in text and "| stage 3, micro-batch 2 |" in text
    assert "rank 0: the step took" in text and "the plan" in text
