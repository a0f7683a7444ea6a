"""hf_zero.environment: every environment variable hf_zero reads is checked before any rank starts, and refused
in one line naming it and what is allowed; inside a rank the same value is the same one-line error."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_zero import environment, run
from hf_zero.config import ZeroConfigError

DEEPSPEED_FROM_ACCELERATE = {"ACCELERATE_USE_DEEPSPEED": "true"}
# (variable, bad value, what the one line says, other variables the case needs). Issue 53's items 5 and 6: each
# was a traceback per rank (a ValueError read inside the ranks) or before launch (a bare int()).
BAD = [
    ("HF_ZERO_COLLECTIVE_TIMEOUT", "abc", "must be a number of seconds from 1 to 2,592,000", {}),
    ("HF_ZERO_CHECK_COLLECTIVES", "2", r"must be one of 1 \(compare every collective", {}),
    ("HF_ZERO_SIMULATE_ASYNC", "junk", "must be one of late, early; 0 means off; 1 means late", {}),
    ("HF_ZERO_EXTENSIONS_DIR", "", "is set but empty: name a folder for the compiled kernels", {}),
    ("HF_ZERO_CPU_ADAM_ISA", "avx9", "must be one of avx512, avx2, scalar", {}),
    ("HF_ZERO_CPU_ADAM_THREADS", "0", "must be a whole number of at least 1", {}),
    ("HF_ZERO_CUDA_DELAY", "compute", "must be STREAM:CYCLES", {}),
    ("LOCAL_WORLD_SIZE", "abc", "must be a whole number of at least 1", {}),
    ("WORLD_SIZE", "abc", "must be a whole number of at least 1", {}),
    ("RANK", "-1", "must be a whole number of at least 0", {}),
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "abc", "must be a whole number of at least 0", DEEPSPEED_FROM_ACCELERATE),
    ("ACCELERATE_GRADIENT_CLIPPING", "abc", "must be a finite number of at least 0", DEEPSPEED_FROM_ACCELERATE),
    ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "abc", "must be a whole number of at least 1",
     DEEPSPEED_FROM_ACCELERATE),
]


@pytest.mark.parametrize("command", ["train", "run"])
@pytest.mark.parametrize("variable, value, says, beside", BAD, ids=[case[0] for case in BAD])
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
    """What a rank reads itself (hf_zero.run's main under torchrun, or launched another way) stops it with the
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
