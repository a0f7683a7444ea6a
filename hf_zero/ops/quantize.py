"""Block-wise symmetric quantization for ZeRO++ (qwZ weights, qgZ gradients): `block` elements go as int8
or int4 values with one fp32 scale each, absmax / qmax. `quantize_reference` / `dequantize_reference` are
the torch implementation (used on CUDA tensors, and the reference the tests hold csrc/quantize.cpp to);
`quantize` / `dequantize` run the C++ kernel on CPU tensors when it builds, the reference otherwise (with a
warning, once, as CPUAdam falls back).

Layout: int8 values one a byte (torch.int8, n of them); int4 two a byte (torch.uint8, ceil(n / 2)), the
even element in the low nibble, two's complement; scales fp32, ceil(n / block). An all-zero block has
scale 0. The round trip is exact to half a step: |x - dequantize(quantize(x))| <= scale / 2 per element
(plus the two fp32 roundings of x / scale and q * scale).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hf_zero.ops.build import load_extension

logger = logging.getLogger("hf_zero")
QMAX = {8: 127, 4: 7}
_warned_fallback = False


@dataclass(frozen=True)
class Quantized:
    """What goes over the wire for `numel` elements: the values and one scale per block."""
    values: torch.Tensor  # int8 (bits 8) or uint8 nibble pairs (bits 4)
    scales: torch.Tensor  # fp32, one per block
    bits: int
    block: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * 4


def senders_parts(values: torch.Tensor, scales: torch.Tensor, senders: int, bits: int, block: int,
                  numel: int) -> list[Quantized]:
    """What a gather or an all-to-all of `senders` equal Quantized parts of `numel` elements delivered, one
    part per sender in rank order."""
    return [Quantized(v, s, bits, block, numel) for v, s in zip(values.chunk(senders), scales.chunk(senders))]


def quantized_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes sent for `numel` elements: the values and an fp32 scale per block."""
    check_settings(bits, block)
    return (numel * bits + 7) // 8 + 4 * -(-numel // block)


def check_settings(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization bits must be 8 or 4; got {bits!r}")
    if not isinstance(block, int) or block <= 0 or block % 2:
        raise ValueError(f"quantization block size must be a positive even integer; got {block!r}")


def quantize_kernel():
    """The compiled kernel module, or None (with a warning, once) when it cannot be built."""
    global _warned_fallback
    try:
        return load_extension("hf_zero_quantize")
    except RuntimeError as error:
        if not _warned_fallback:
            logger.warning("%s; quantization falls back to its torch implementation (same results, slower)", error)
            _warned_fallback = True
        return None


def quantize_reference(x: torch.Tensor, bits: int, block: int) -> Quantized:
    check_settings(bits, block)
    flat = x.detach().reshape(-1).float()
    n, qmax = flat.numel(), QMAX[bits]
    padded = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    scales = padded.abs().amax(dim=1) / qmax
    # A true division, as the kernel divides; an all-zero block (scale 0) quantizes to zeros.
    q = torch.where(scales[:, None] == 0, 0.0, torch.round(padded / scales[:, None])).clamp_(-qmax, qmax)
    q = q.reshape(-1)[:n].to(torch.int8)
    if bits == 4:
        nibbles = torch.nn.functional.pad(q, (0, n % 2)).view(-1, 2).view(torch.uint8) & 0xF
        q = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized(q, scales, bits, block, n)


def dequantize_reference(packed: Quantized) -> torch.Tensor:
    q, n = packed.values, packed.numel
    if packed.bits == 4:
        # Each nibble to the top of a byte, then an arithmetic shift back: two's complement sign-extended.
        pairs = torch.stack([q << 4, q & 0xF0], dim=1).view(torch.int8) >> 4
        q = pairs.reshape(-1)[:n]
    values = torch.nn.functional.pad(q.float(), (0, -n % packed.block)).view(-1, packed.block)
    return (values * packed.scales[:, None]).reshape(-1)[:n]


def quantize(x: torch.Tensor, bits: int, block: int) -> Quantized:
    """`x` (any float dtype and shape) quantized block by block; the C++ kernel for CPU tensors."""
    check_settings(bits, block)
    kernel = quantize_kernel() if x.device.type == "cpu" else None
    if kernel is None:
        return quantize_reference(x, bits, block)
    flat = x.detach().reshape(-1).float().contiguous()
    n = flat.numel()
    values = torch.empty(n if bits == 8 else (n + 1) // 2, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(-(-n // block), dtype=torch.float32)
    kernel.quantize(flat, values, scales, bits, block)
    return Quantized(values, scales, bits, block, n)


def dequantize(packed: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values (into `out`, of any float dtype with `numel` elements, when given)."""
    kernel = quantize_kernel() if packed.values.device.type == "cpu" else None
    if kernel is None:
        values = dequantize_reference(packed)
    else:
        values = torch.empty(packed.numel, dtype=torch.float32)
        kernel.dequantize(packed.values, packed.scales, values, packed.bits, packed.block)
    if out is None:
        return values
    return out.view(-1).copy_(values).view(out.shape)
