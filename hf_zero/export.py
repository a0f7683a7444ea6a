"""Transformers-format weights written as the tensors arrive, so no process ever holds the whole model.

`save_pretrained` takes a complete state dict, and safetensors writes a file only from a complete dict
of tensors: there is no streaming writer. The format itself is simple, though: a JSON header giving
each tensor's dtype, shape and byte range, then the raw bytes. So once the shapes and dtypes are known
the headers can be written first and each tensor copied into its byte range whenever it arrives, in
any order; that is all `ShardedWeightsWriter` does by hand. The split into files is huggingface_hub's
(`split_torch_state_dict_into_shards`, the one save_pretrained uses) and the files are read back by
safetensors and `from_pretrained` unchanged.

Two writers feed it: `hf-zero consolidate` (one parameter at a time, read from a checkpoint's shards)
and the engine's `save_weights` (at stage 3 one unit at a time, gathered across the ranks). This file
knows safetensors and transformers' folder layout, nothing of the engine.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from torch import nn

from hf_zero.device import bytes_of, in_host_memory

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # as safetensors' get_dtype() spells them
WEIGHTS_INDEX = "model.safetensors.index.json"
# Weight files a previous save may have left; from_pretrained prefers model.safetensors over an index.
STALE_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
SAVE_PRETRAINED_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default


def weights_to_save(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict entries save_pretrained writes, in state_dict order: a tensor known under several
    names (tied embeddings) once, under the name that is not a tied target, as from_pretrained expects."""
    entries = module.state_dict(keep_vars=True)
    tied_targets = set(getattr(module, "all_tied_weights_keys", None) or {})
    names_of: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        names_of.setdefault(id(tensor), []).append(name)
    kept = set()
    for names in names_of.values():
        kept.add(([n for n in names if n not in tied_targets] or names)[0])
    return {name: tensor for name, tensor in entries.items() if name in kept}


def _header(entries: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, dict[str, int], int]:
    """A safetensors header for `entries` laid end to end; returns it, each tensor's start in the file
    and the file's size."""
    described: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in entries.items():
        nbytes = t.numel() * t.element_size()
        described[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(described, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(header)
    starts = {name: start + d["data_offsets"][0] for name, d in described.items() if name != "__metadata__"}
    return struct.pack("<Q", len(header)) + header, starts, start + offset


class ShardedWeightsWriter:
    """Writes `model.safetensors` (or `model-0000k-of-0000N.safetensors` and the index) for tensors
    described up front by `planned` (meta tensors do: only shape and dtype are read), accepting each
    tensor's values later, in any order. Files appear under their final names only on `close()`."""

    def __init__(self, folder: str | os.PathLike, planned: dict[str, torch.Tensor],
                 max_shard_size: int | str = SAVE_PRETRAINED_MAX_SHARD_SIZE) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.split = split_torch_state_dict_into_shards(planned, filename_pattern="model{suffix}.safetensors",
                                                        max_shard_size=max_shard_size)
        self.planned = planned
        self.place: dict[str, tuple[Any, int]] = {}  # name -> (open partial file, byte offset)
        self.files = {}
        for filename, names in self.split.filename_to_tensors.items():
            header, starts, size = _header({n: planned[n] for n in names}, {"format": "pt"})
            f = open(self.folder / (filename + ".partial"), "wb")
            f.write(header)
            f.truncate(size)
            self.files[filename] = f
            self.place.update({n: (f, starts[n]) for n in names})
        self.written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copies `tensor`, cast to the planned dtype, into its place in its file."""
        want = self.planned[name]
        if tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{name}: got shape {list(tensor.shape)}, planned {list(want.shape)}")
        f, start = self.place[name]
        # Through the device layer: a synchronous copy into host memory, after the stream that computed it.
        data = in_host_memory(tensor.detach(), want.dtype)
        f.seek(start)
        f.write(bytes_of(data, writing=False))
        self.written.add(name)

    def close(self) -> list[str]:
        """Checks that every planned tensor was written, then puts the files in place; returns their names."""
        missing = [n for n in self.planned if n not in self.written]
        if missing:
            self.abort()
            raise RuntimeError(f"{len(missing)} planned tensors were never written (first: {missing[0]!r})")
        for f in self.files.values():
            f.close()
        for filename in os.listdir(self.folder):
            if STALE_WEIGHTS.fullmatch(filename) and filename not in self.files:
                (self.folder / filename).unlink()
        for filename in self.files:
            os.replace(self.folder / (filename + ".partial"), self.folder / filename)
        if self.split.is_sharded:
            index = {"metadata": self.split.metadata, "weight_map": self.split.tensor_to_filename}
            (self.folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            return [*self.files, WEIGHTS_INDEX]
        return list(self.files)

    def abort(self) -> None:
        """Removes the partial files; whatever the folder held before is untouched."""
        for filename, f in self.files.items():
            f.close()
            (self.folder / (filename + ".partial")).unlink(missing_ok=True)


def meta_like(shape: torch.Size | list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@torch.no_grad()
def write_as_they_arrive(folder: str | os.PathLike, planned: dict[str, torch.Tensor],
                         arrivals: Iterable[dict[str, torch.Tensor]], write: bool,
                         max_shard_size: int | str = SAVE_PRETRAINED_MAX_SHARD_SIZE) -> Exception | None:
    """Writes each batch of tensors `arrivals` yields into its place in the files planned for `planned`.
    Every batch is taken from `arrivals` even after a failure, or when this process does not `write`: on
    several ranks producing a batch is a collective that the others join. Returns the first error."""
    writer: ShardedWeightsWriter | None = None
    error: Exception | None = None

    def attempt(action: Callable[[], Any]) -> None:
        nonlocal error
        if write and error is None:
            try:
                action()
            except Exception as e:  # returned to the caller, who raises it on every rank
                error = e

    def open_writer() -> None:
        nonlocal writer
        writer = ShardedWeightsWriter(folder, planned, max_shard_size)

    attempt(open_writer)
    for tensors in arrivals:
        for name, tensor in tensors.items():
            attempt(lambda: writer.write(name, tensor))
    attempt(lambda: writer.close())
    if writer is not None and error is not None:
        writer.abort()
    return error
