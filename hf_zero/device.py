"""Where tensors live: host memory and the compute device, and the bytes of host tensors for file I/O.

Host buffers that a device copies to and from are pinned when there is an accelerator. File I/O reads
and writes the memory of host tensors only: a device address handed to the operating system is a crash
or silent garbage, so `bytes_of` refuses anything else.
"""
from __future__ import annotations

import ctypes

import torch

HOST = torch.device("cpu")


def to_host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, pinned when there is an accelerator to copy to and from."""
    tensor = tensor.to(HOST)
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A host tensor's memory as bytes, without a copy. Not through numpy: a storage handed to numpy can no
    longer be resized, and stage 3 frees gathered buffers by resizing their storage to zero."""
    if tensor.device.type != "cpu":
        raise ValueError(f"bytes_of reads host memory; got a tensor on {tensor.device} (copy it to the host first)")
    if not tensor.is_contiguous():
        raise ValueError("bytes_of needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
