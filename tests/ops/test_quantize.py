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
