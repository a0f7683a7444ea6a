"""Block-wise quantization for ZeRO++ (hf_zero/ops/quantize.py, csrc/quantize.cpp): the round trip is within
half a quantization step of every element, the C++ kernel gives the torch reference's bits, and the bytes
sent are the values plus one fp32 scale per block."""
from __future__ import annotations

import math

import pytest
import torch

from hf_zero.ops import quantize as q

F32_EPS = torch.finfo(torch.float32).eps
CASES = [(bits, n, block) for bits in (8, 4) for n, block in ((4096, 64), (10_000, 256), (1001, 2048), (9, 4))]


def weights_with_outliers(n: int, block: int, seed: int = 0) -> torch.Tensor:
    """Normal values with heavy-tailed magnitudes; the first block all zeros when there are several."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 10
    if n > block:
        x[:block] = 0.0
    return x


@pytest.mark.parametrize("bits, n, block", CASES)
def test_the_round_trip_is_within_half_a_step_of_every_element(bits, n, block):
    x = weights_with_outliers(n, block)
    packed = q.quantize(x, bits, block)
    back = q.dequantize(packed)
    scale = packed.scales.repeat_interleave(block)[:n]
    # Rounding to the nearest step errs by at most half of it; x / scale and q * scale each round once more.
    bound = scale / 2 + 4 * F32_EPS * x.abs()
    assert torch.all((back - x).abs() <= bound)
    # The bound is tight: among a thousand elements some are off by more than a quarter step.
    if n >= 1000:
        assert torch.any((back - x).abs() > scale / 4)
    # The scales are absmax / qmax, and a zero block (scale 0) comes back as zeros.
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    assert torch.equal(packed.scales, blocks.abs().amax(dim=1) / q.QMAX[bits])
    if n > block:
        assert packed.scales[0] == 0 and torch.equal(back[:block], torch.zeros(block))


@pytest.mark.parametrize("bits, n, block", CASES)
def test_the_kernel_gives_the_torch_references_bits(bits, n, block):
    if q.quantize_kernel() is None:
        pytest.skip("no C++ compiler: the kernel cannot be compared (not evidence)")
    x = weights_with_outliers(n, block, seed=1)
    if n > 2 * block:  # a half-step tie (up to rounding) in block 1, where rounding half to even decides
        x[block + 1] = 0.5 * x[block:2 * block].abs().max() / q.QMAX[bits]
    ours, reference = q.quantize(x, bits, block), q.quantize_reference(x, bits, block)
    assert torch.equal(ours.values, reference.values) and torch.equal(ours.scales, reference.scales)
    assert torch.equal(q.dequantize(ours), q.dequantize_reference(reference))


@pytest.mark.parametrize("bits", [8, 4])
def test_int4_and_int8_hold_every_value_in_range_and_signs(bits):
    qmax = q.QMAX[bits]
    x = torch.arange(-qmax, qmax + 1, dtype=torch.float32)  # one block: scale 1, every value exact
    for packed in (q.quantize(x, bits, 2 * qmax + 2), q.quantize_reference(x, bits, 2 * qmax + 2)):
        assert torch.equal(q.dequantize(packed), x) and torch.equal(q.dequantize_reference(packed), x)


def test_the_bytes_sent_are_a_half_or_a_quarter_of_bf16_plus_the_scales():
    n, block = 1 << 20, 2048
    x = torch.randn(n, dtype=torch.bfloat16)
    for bits, fraction_of_bf16 in ((8, 1 / 2), (4, 1 / 4)):
        packed = q.quantize(x, bits, block)
        assert packed.nbytes == q.quantized_bytes(n, bits, block) == n * 2 * fraction_of_bf16 + 4 * n // block
    assert math.isclose(q.quantized_bytes(n, 8, block) / (4 * n), 0.25 + 1 / block)  # a quarter of fp32


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="bits must be 8 or 4; got 2"):
        q.quantize(torch.ones(4), 2, 4)
    with pytest.raises(ValueError, match="block size must be a positive even integer; got 3"):
        q.quantize(torch.ones(4), 8, 3)


@pytest.mark.parametrize("bits, n, block", CASES)
def test_the_torch_implementation_in_pieces_gives_the_kernels_bits(monkeypatch, bits, n, block):
    """The torch implementation works a piece of PIECE_NUMEL elements at a time: a block a piece here, so
    that pieces end inside an int4 byte's pair and the last piece is short."""
    x = weights_with_outliers(n, block, seed=2)
    kernel = q.quantize_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler: the kernel cannot be compared (not evidence)")
    ours = q.quantize(x, bits, block)
    monkeypatch.setattr(q, "PIECE_NUMEL", block)
    pieces = q.quantize_reference(x, bits, block)
    assert torch.equal(pieces.values, ours.values) and torch.equal(pieces.scales, ours.scales)
    out = torch.empty(n, dtype=torch.bfloat16)
    assert torch.equal(q.dequantize_reference(pieces, out=out), q.dequantize(ours).to(torch.bfloat16))


TRANSIENT = r"""
import json, sys, torch
from hf_zero.ops import quantize as q

q.PIECE_NUMEL = 1 << 20
def status(key):  # bytes; VmHWM is the peak resident set since the last reset
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
n = 1 << 23
x = torch.randn(n).to(torch.bfloat16)
q.dequantize_reference(q.quantize_reference(x[:1 << 16], 4, 128))  # first calls' one-time costs, not measured
transient = {}
for bits in (8, 4):
    reset_peak(); before = status("VmRSS:")
    packed = q.quantize_reference(x, bits, 128)
    transient[f"quantize int{bits}"] = (status("VmHWM:") - before - packed.nbytes) / n
    out = torch.empty(n, dtype=torch.bfloat16).fill_(0.5)  # resident before the measurement
    reset_peak(); before = status("VmRSS:")
    q.dequantize_reference(packed, out=out)
    transient[f"dequantize int{bits}"] = (status("VmHWM:") - before) / n
print(json.dumps(transient))
"""


def test_the_torch_implementations_temporaries_are_bounded_by_its_piece_not_by_the_tensor():
    """Measured by peak RSS in a fresh process, every allocation of 64 KiB or more its own mapping (so freed
    memory leaves the resident set at once): 8M bf16 elements in pieces of 1M, beyond the output. In one pass
    the temporaries were about 12 bytes an element of the tensor (the issue measured 16 on a GPU: 770 MiB for
    50M elements); in pieces, about 9 bytes an element of the piece to quantize and 5 to dequantize (the same
    at 32M elements)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TRANSIENT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    transient = json.loads(done.stdout)
    assert all(per_element * (1 << 23) <= 16 * (1 << 20) for per_element in transient.values()), transient


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators run inside it: on a GPU, each is a kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_gathers_senders_are_dequantized_together_in_launches_that_do_not_grow_with_the_ranks(monkeypatch, bits):
    monkeypatch.setattr(q, "quantize_kernel", lambda: None)  # the torch implementation, as on a GPU
    launches = {}
    for senders in (2, 16):
        numel = 4096 // senders + 3  # parts that end inside a block (and an int4 byte)
        parts = [q.quantize_reference(weights_with_outliers(numel, 64, seed=r), bits, 64) for r in range(senders)]
        values, scales = torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts])
        out = torch.empty(senders * numel)
        with CountOps() as ops:
            q.dequantize_senders(values, scales, senders, bits, 64, numel, out)
        assert torch.equal(out, torch.cat([q.dequantize_reference(p) for p in parts]))
        launches[senders] = ops.count
    assert launches[2] == launches[16] <= 25, launches  # the same operators (most of them views)
