"""benchmarks/gpu_evidence.py runs end to end before a GPU is at hand: its dry mode trains the same systems on
CPU at tiny sizes, under hf_zero.device's simulation, and writes the same JSON and table."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import model_zoo

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_evidence_run_works_end_to_end_in_its_dry_mode(tmp_path):
    # The path with the most device-layer work, and FSDP2 as the reference beside it; each is a fresh process.
    systems = ["stage3+cpu", "fsdp2"]
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_evidence", "--dry", "--out", str(tmp_path),
                           "--systems", *systems, "--steps", "1", "--profile", "stage3+cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    rows = evidence["parts"]["systems"]
    assert [row["system"] for row in rows] == systems
    assert all("error" not in row for row in rows), rows
    for row in rows:  # each system trained the zoo's tiny GPT-2, all of it
        assert row["psi"] == model_zoo.parameter_count("gpt2-tiny") and row["tokens_per_second"] > 0
    table = (tmp_path / "evidence.md").read_text()
    assert all(f"| {system} |" in table for system in systems)
    assert "aten::" in (tmp_path / "profile-stage3+cpu.txt").read_text()
    phases = rows[0]["offloaded_step_seconds"]  # the offloaded step's breakdown
    assert set(phases) == {"forward_backward", "norm", "host_update", "copies_back_and_all_gather"}
    assert phases["host_update"] > 0 and "An offloaded step, phase by phase" in table
