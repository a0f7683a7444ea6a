"""hf_zero.settings.environment: every environment variable hf_zero reads is checked before any rank starts, and refused
in one line naming it and what is allowed; inside a rank the same value is the same one-line error."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from hf_zero.cli import run
from hf_zero.settings import environment
from hf_zero.settings.config import ZeroConfigError

DEEPSPEED_FROM_ACCELERATE = {"ACCELERATE_USE_DEEPSPEED": "true"}
# (variable, bad value, what the one line says, other variables the case needs). Each
# was a traceback per rank (a ValueError read inside the ranks) or before launch (a bare int()).
BAD = [
    ("HF_ZERO_COLLECTIVE_TIMEOUT", "abc", "must be a number of seconds from 1 to 2,592,000", {}),
    ("HF_ZERO_CHECK_COLLECTIVES", "2", r"must be one of 1 \(compare every collective", {}),
    ("HF_ZERO_SIMULATE_ASYNC", "junk", "must be one of late, early; 0 means off; 1 means late", {}),
    ("HF_ZERO_EXTENSIONS_DIR", "", "is set but empty: name a folder for the compiled kernels", {}),
    ("HF_ZERO_CPU_ADAM_ISA", "avx9", "must be one of avx512, avx2, scalar", {}),
    ("HF_ZERO_CPU_ADAM_THREADS", "0", "must be a whole number from 1 to 4,096", {}),
    ("HF_ZERO_CUDA_DELAY", "compute", "must be STREAM:CYCLES", {}),
    # "²" passed str.isdigit() and failed int() in every rank; 1e20 threads overflowed
    # torch.set_num_threads in every rank.
    ("HF_ZERO_CUDA_DELAY", "compute:²", "must be STREAM:CYCLES, STREAM one of compute, comm, copy and CYCLES a whole "
                                        "number; got 'compute:²'", {}),
    ("HF_ZERO_CPU_ADAM_THREADS", "99999999999999999999", "must be a whole number from 1 to 4,096", {}),
    ("LOCAL_WORLD_SIZE", "abc", "must be a whole number of at least 1", {}),
    ("WORLD_SIZE", "abc", "must be a whole number of at least 1", {}),
    ("RANK", "-1", "must be a whole number of at least 0", {}),
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "abc", "must be a whole number of at least 0", DEEPSPEED_FROM_ACCELERATE),
    ("ACCELERATE_GRADIENT_CLIPPING", "abc", "must be a finite number of at least 0", DEEPSPEED_FROM_ACCELERATE),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "abc", "must be a whole number of at least 1",
     DEEPSPEED_FROM_ACCELERATE),
    # Read as accelerate and transformers read a truth value ("1" is true, as "true" is).
    ("ACCELERATE_USE_DEEPSPEED", "maybe", "must be a truth value as accelerate reads it: y, yes, t, true, on or 1; n, "
                                          "no, f, false, off or 0; got 'maybe'", {}),
    ("ACCELERATE_DEEPSPEED_ZERO3_INIT", "maybe", "must be a truth value as accelerate reads it",
     DEEPSPEED_FROM_ACCELERATE),
]


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("variable, value, says, beside", BAD, ids=[f"{case[0]}={case[1]}" for case in BAD])
def test_a_bad_environment_variable_is_refused_before_launch_in_one_line_naming_it(
        refused_before_launch, monkeypatch, tmp_path, command, variable, value, says, beside):
    for name, setting in {**beside, variable: value}.items():
        monkeypatch.setenv(name, setting)
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    args = ["--nproc_per_node", "2"] + ([str(script), "--use_cpu"] if command == "run" else [])
    code, err = refused_before_launch(command, *args)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"hf-zero {command}: {variable} ") and re.search(says, err), err


def test_a_bad_variable_met_inside_a_rank_is_the_same_one_line(monkeypatch, tmp_path, capsys):
    """What a rank reads itself (hf_zero.cli.run's main under torchrun, or launched another way) stops it with the
    one-line error hf_zero's own errors take, before the script runs."""
    monkeypatch.setenv("HF_ZERO_SIMULATE_ASYNC", "junk")
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    assert run.main([str(script)]) == 2
    assert capsys.readouterr().err == ("script.py: HF_ZERO_SIMULATE_ASYNC must be one of late, early; 0 means off; 1 "
                                       "means late; got 'junk'\n")


def test_the_good_values_are_read_as_given(monkeypatch):
    for name, value in {"HF_ZERO_COLLECTIVE_TIMEOUT": "1.5", "HF_ZERO_CHECK_COLLECTIVES": "0",
                        "HF_ZERO_SIMULATE_ASYNC": "1", "HF_ZERO_EXTENSIONS_DIR": "~/kernels",
                        "HF_ZERO_CUDA_DELAY": "copy:1000", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    environment.check_environment()
    assert environment.collective_timeout(None).total_seconds() == 1.5
    assert not environment.check_collectives() and environment.simulation() == "late"
    assert environment.extensions_dir() == Path.home() / "kernels"
    assert environment.cuda_delay() == ("copy", 1000)
    assert environment.processes_per_node(environment.world_size()) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert environment.processes_per_node(environment.world_size()) == 4


def test_errors_are_the_configuration_error_the_launchers_report_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "many")
    with pytest.raises(ZeroConfigError, match="WORLD_SIZE must be a whole number of at least 1; got 'many'"):
        environment.world_size()


def test_the_stage_accelerate_hands_over_is_checked_when_deepspeed_is_on_by_any_truth_value(
        refused_before_launch, monkeypatch):
    """ACCELERATE_USE_DEEPSPEED=1 is on for transformers, so its ACCELERATE_DEEPSPEED_* are
    checked as with "true"."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "1")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "abc")
    code, err = refused_before_launch("train", "--nproc_per_node", "2")
    assert (code, err) == (2, "hf-zero train: ACCELERATE_DEEPSPEED_ZERO_STAGE must be a whole number of at least 0; "
                              "got 'abc'\n")


AVX2_AT_MOST = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\nvmx flags\t: ept\n\n"


@pytest.mark.parametrize("command", ["train", "run"])
def test_an_instruction_set_this_cpu_lacks_is_refused_before_launch_naming_what_it_has(
        refused_before_launch, monkeypatch, tmp_path, command):
    """HF_ZERO_CPU_ADAM_ISA=avx512 on a CPU with AVX2 at most was the kernel's error, 91 lines
    from every rank's first step."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(AVX2_AT_MOST)
    monkeypatch.setattr(environment, "CPU_INFO", cpuinfo)
    monkeypatch.setenv("HF_ZERO_CPU_ADAM_ISA", "avx512")
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    code, err = refused_before_launch(command, "--nproc_per_node", "2", *([str(script)] if command == "run" else []))
    assert (code, err) == (2, f"hf-zero {command}: HF_ZERO_CPU_ADAM_ISA must be one this CPU has: avx2, scalar; got "
                              f"'avx512'\n")
    monkeypatch.setenv("HF_ZERO_CPU_ADAM_ISA", "avx2")
    assert environment.cpu_adam_isa() == "avx2"
    monkeypatch.setattr(environment, "CPU_INFO", tmp_path / "absent")  # not Linux: the kernel checks it itself
    monkeypatch.setenv("HF_ZERO_CPU_ADAM_ISA", "avx512")
    assert environment.cpu_adam_isa() == "avx512"


def test_the_instruction_sets_read_before_launch_are_those_the_kernel_finds():
    """csrc/isa.h asks the CPU itself; environment.cpu_isas reads /proc/cpuinfo for the same flags: the kernel runs
    the best of them, or where HF_ZERO_CPU_ADAM_ISA chose one (the suite run under each ISA), one of them."""
    from hf_zero.ops import cpu_adam_kernel

    has, kernel = environment.cpu_isas(), cpu_adam_kernel()
    if has is None or kernel is None:
        pytest.skip("no /proc/cpuinfo, or no compiler for the kernel")
    if os.environ.get(environment.CPU_ADAM_ISA_ENV):
        assert kernel.isa() == os.environ[environment.CPU_ADAM_ISA_ENV] and kernel.isa() in has
    else:
        assert has[0] == kernel.isa()


def test_a_leftover_world_size_with_one_process_is_ignored_and_said_in_one_line(
        refused_before_launch, monkeypatch, tmp_path):
    """WORLD_SIZE=2 left in the environment with --nproc_per_node 1 had the one process set up
    as one of two (28 lines about RANK, or MASTER_ADDR, unset). torchrun sets these for the processes it starts;
    one process runs here without it, so the leftovers are dropped, and said to be."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(run, "patch_transformers", lambda: None)  # this process's transformers left as it is
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = tmp_path / "script.py"
    script.write_text("import pathlib, sys\nfrom transformers import TrainingArguments\n"
                      "args = TrainingArguments(sys.argv[1], use_cpu=True, report_to='none')\n"
                      "pathlib.Path(sys.argv[1], 'world').write_text(str(args.world_size))\n")
    code, err = refused_before_launch("run", "--nproc_per_node", "1", str(script), str(tmp_path), "--use_cpu")
    assert (code, err) == (0, "hf-zero run: ignoring WORLD_SIZE=2, LOCAL_RANK=1 from the environment: this launch is "
                              "one process, run here without torchrun (which sets them for the processes it starts)\n")
    assert (tmp_path / "world").read_text() == "1"
