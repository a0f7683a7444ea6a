"""hf_zero.ops.CPUAdam against torch.optim.Adam / AdamW: every instruction set, fp32 and mixed precision."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from hf_zero.ops import CPUAdam, cpu_adam, cpu_adam_kernel

N = 10_007  # several threads' grains plus a tail no vector width divides
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def run_against_torch(adamw: bool, grad_dtype: torch.dtype, out_dtype: torch.dtype | None, grad_scale: float,
                      steps: int = 5) -> dict:
    """CPUAdam on fp32 masters with `grad_dtype` gradients, and torch's optimizer on the same values."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(N, generator=gen)
    master.grad_dtype = None  # torch >= 2.13 refuses a gradient of another dtype unless told
    reference = master.clone()
    ours = CPUAdam([master], adamw_mode=adamw, **HYPER)
    theirs = (torch.optim.AdamW if adamw else torch.optim.Adam)([reference], **HYPER)
    out = None if out_dtype is None else torch.empty(N, dtype=out_dtype)
    if out is not None:
        ours.mirror(master, out)
    worst = 0.0
    for _ in range(steps):
        grad = (torch.randn(N, generator=gen) * 3).to(grad_dtype)
        master.grad = grad
        reference.grad = grad.float() * grad_scale
        ours.step(grad_scale=grad_scale)
        theirs.step()
        # Relative to the tensor's scale: an element crossing zero makes any per-element ratio meaningless.
        worst = max(worst, ((master - reference).abs().max() / reference.abs().max()).item())
    return {"worst_relative": worst, "bitwise": torch.equal(master, reference),
            "out_is_cast": out is None or torch.equal(out, reference.to(out_dtype))}


ISA_SCRIPT = """
import json, torch
from hf_zero.ops import cpu_adam_kernel
from tests.ops.test_cpu_adam import run_against_torch
results = [run_against_torch(adamw, g, o, s) for adamw in (True, False)
           for g, o, s in ((torch.float32, None, 1.0), (torch.bfloat16, torch.bfloat16, 0.5),
                           (torch.float16, torch.float16, 2.0 ** -8))]
print(json.dumps({"isa": cpu_adam_kernel().isa(), "results": results}))
"""


def supported_isas() -> list[str]:
    best = cpu_adam_kernel().isa()
    return ["scalar", "avx2", "avx512"][:["scalar", "avx2", "avx512"].index(best) + 1]


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_every_instruction_set_equals_torch_adam_and_adamw(isa):
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ, HF_ZERO_CPU_ADAM_ISA=isa)
    done = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["isa"] == isa
    for result in report["results"]:
        # The kernel rounds as ATen does: most elements are bitwise equal, the rest an ulp apart.
        assert result["worst_relative"] <= 1e-6, result
        assert result["out_is_cast"], result


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_fp32_equals_torch_within_1e6_relative(adamw):
    result = run_against_torch(adamw, torch.float32, None, 1.0)
    assert result["worst_relative"] <= 1e-6, result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mixed_precision_step_reads_low_precision_grads_and_writes_the_cast_parameter(dtype):
    result = run_against_torch(True, dtype, dtype, grad_scale=0.25)
    assert result["worst_relative"] <= 1e-6, result
    assert result["out_is_cast"]  # exactly master.to(dtype): round to nearest even, as torch casts


def test_without_a_compiler_it_falls_back_to_torch_fused_adamw_and_says_so_once(monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise RuntimeError("could not build hf_zero's hf_zero_cpu_adam extension: no C++ compiler on PATH")

    monkeypatch.setattr(cpu_adam, "load_extension", fail)
    monkeypatch.setattr(cpu_adam, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        first = CPUAdam([torch.zeros(3)])
        second = CPUAdam([torch.zeros(3)])
    assert first.kernel is None and second.kernel is None
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "falls back to torch's fused AdamW" in caplog.records[0].getMessage()
    result = run_against_torch(True, torch.bfloat16, torch.bfloat16, grad_scale=0.5)
    assert result["worst_relative"] <= 1e-6 and result["out_is_cast"], result


def test_a_bad_instruction_set_request_names_the_allowed_ones():
    env = dict(os.environ, HF_ZERO_CPU_ADAM_ISA="sse9")
    done = subprocess.run([sys.executable, "-c", "from hf_zero.ops import CPUAdam; import torch\n"
                           "p = torch.zeros(4); p.grad = torch.ones(4); CPUAdam([p]).step()"],
                          env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "HF_ZERO_CPU_ADAM_ISA must be one of avx512, avx2, scalar; got sse9" in done.stderr


@pytest.mark.parametrize("kwargs, message", [
    ({"amsgrad": True}, r"CPUAdam does not support \['amsgrad'\]"),
    ({"betas": (0.9, 1.0)}, r"CPUAdam needs betas in \[0, 1\)"),
])
def test_unsupported_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CPUAdam([torch.zeros(2)], **kwargs)


def test_parameters_must_be_fp32_on_cpu():
    p = torch.zeros(4, dtype=torch.bfloat16)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPUAdam steps contiguous fp32 CPU parameters; got torch.bfloat16"):
        CPUAdam([p]).step()
