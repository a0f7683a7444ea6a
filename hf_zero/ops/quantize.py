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
from hf_zero.runtime.device import timeline

logger = logging.getLogger("hf_zero")
QMAX = {8: 127, 4: 7}
# Elements the torch implementation works on at once: its temporaries (measured by peak RSS: about 9 bytes an
# element of the piece to quantize, 5 to dequantize) are then bounded by this, not by the tensor (about 36 MiB
# whatever its size; in one pass they were 12 bytes an element of the tensor), for about 10 kernel launches a
# piece.
PIECE_NUMEL = 1 << 22
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


def _kernel_for(tensor: torch.Tensor):
    """The C++ kernel where it can read `tensor`: a host tensor with memory (a plan's fake tensors have none, and
    torch's implementation stands in); else None."""
    return quantize_kernel() if tensor.device.type == "cpu" and timeline().host_kernels else None


def quantize_reference(x: torch.Tensor, bits: int, block: int) -> Quantized:
    check_settings(bits, block)
    flat = x.detach().reshape(-1)
    n = flat.numel()
    values = torch.empty(n if bits == 8 else (n + 1) // 2, dtype=torch.int8 if bits == 8 else torch.uint8,
                         device=flat.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=flat.device)
    step = _piece_numel(block)  # a multiple of the block, and even: pieces start on a block and a byte
    for start in range(0, n, step):
        piece = flat[start:start + step]
        first_value = start if bits == 8 else start // 2
        q, piece_scales = _quantize_piece(piece, bits, block)
        values[first_value:first_value + q.numel()] = q
        scales[start // block:start // block + piece_scales.numel()] = piece_scales
    return Quantized(values, scales, bits, block, n)


def _piece_numel(block: int) -> int:
    return max(block, PIECE_NUMEL // block * block)


def _quantize_piece(piece: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    # In place where the values are this function's own: one fp32 copy of the piece, not one per operation.
    n, qmax = piece.numel(), QMAX[bits]
    padded = _padded_to_blocks(piece.float(), block).view(-1, block)
    scales = torch.maximum(padded.amax(dim=1), -padded.amin(dim=1)) / qmax  # absmax, without an |x| copy
    # A true division, as the kernel divides; an all-zero block (scale 0) quantizes to zeros.
    q = (padded / scales[:, None]).masked_fill_(scales[:, None] == 0, 0.0).round_().clamp_(-qmax, qmax)
    q = q.view(-1)[:n].to(torch.int8)
    if bits == 4:
        nibbles = torch.nn.functional.pad(q, (0, n % 2)).view(-1, 2).view(torch.uint8) & 0xF
        q = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return q, scales


def dequantize_reference(packed: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values in fp32, or into `out` (any float dtype, `numel` elements), a piece at a time."""
    n = packed.numel
    out = torch.empty(n, dtype=torch.float32, device=packed.values.device) if out is None else out
    _dequantize_rows_in_pieces(packed.values[None], packed.scales[None], packed.bits, packed.block, out.view(1, n))
    return out


def _dequantize_rows_in_pieces(rows_q: torch.Tensor, rows_scales: torch.Tensor, bits: int, block: int,
                               rows_out: torch.Tensor) -> None:
    """Each row of `rows_q` (with its row of `rows_scales`) into its row of `rows_out`, every row at once, a
    piece of PIECE_NUMEL elements in all at a time: the launches depend on the size, not on the rows."""
    rows, numel = rows_out.shape
    step = max(block, _piece_numel(block) // rows // block * block)  # whole blocks of every row at once
    per_byte = 1 if bits == 8 else 2
    for start in range(0, numel, step):
        count = min(step, numel - start)
        q = rows_q[:, start // per_byte:(start + count + per_byte - 1) // per_byte]
        piece_scales = rows_scales[:, start // block:(start + count + block - 1) // block]
        rows_out[:, start:start + count] = _dequantize_rows(q, piece_scales, bits, block, count)


def _padded_to_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """`values` with zeros after each row's end up to a whole block; itself when it ends on one (torch's pad
    would copy it even then)."""
    short = -values.shape[-1] % block
    return torch.nn.functional.pad(values, (0, short)) if short else values


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int) -> torch.Tensor:
    """Each row of `q` (values of `numel` elements, quantized with the row of `scales`) in fp32: rows of
    equal parts dequantized together, in the same few kernels whatever their number."""
    if bits == 4:
        # Each nibble to the top of a byte, then an arithmetic shift back: two's complement sign-extended.
        q = torch.stack([q << 4, q & 0xF0], dim=2).view(torch.int8) >> 4
        q = q.reshape(q.shape[0], -1)[:, :numel]
    values = _padded_to_blocks(q.float(), block).view(q.shape[0], -1, block)
    return values.mul_(scales[:, :, None]).view(q.shape[0], -1)[:, :numel]


def quantize(x: torch.Tensor, bits: int, block: int) -> Quantized:
    """`x` (any float dtype and shape) quantized block by block; the C++ kernel for CPU tensors."""
    check_settings(bits, block)
    kernel = _kernel_for(x)
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
    kernel = _kernel_for(packed.values)
    if kernel is None:
        return dequantize_reference(packed, out)
    values = torch.empty(packed.numel, dtype=torch.float32)
    kernel.dequantize(packed.values, packed.scales, values, packed.bits, packed.block)
    if out is None:
        return values
    return out.view(-1).copy_(values).view(out.shape)


def dequantize_senders(values: torch.Tensor, scales: torch.Tensor, senders: int, bits: int, block: int,
                       numel: int, out: torch.Tensor) -> None:
    """What a gather of `senders` equal Quantized parts of `numel` elements delivered, dequantized into `out`
    (`senders` x `numel` elements, sender by sender). `values` and `scales` hold the senders' parts one after
    the other, whole or as (senders, part) views whose rows may lie apart (a packed gather's). The torch
    implementation (the GPU's) takes every sender's part at once: its kernel launches depend on the size, not
    on the number of ranks (one dequantization per sender would be some 4 launches each, 1,500 per buffer at
    384 ranks)."""
    values, scales = values.reshape(senders, -1), scales.reshape(senders, -1)  # views: one row per sender
    kernel = _kernel_for(values)
    if kernel is not None:
        for r in range(senders):
            dequantize(Quantized(values[r], scales[r], bits, block, numel),
                       out=out.view(-1)[r * numel:(r + 1) * numel])
        return
    _dequantize_rows_in_pieces(values, scales, bits, block, out.view(senders, numel))
