"""Transformers-format weights written as the tensors arrive, so no process ever holds the whole model.

`save_pretrained` takes a complete state dict, and safetensors writes a file only from a complete dict
of tensors: there is no streaming writer. The format itself is simple, though: a JSON header giving
each tensor's dtype, shape and byte range, then the raw bytes. So once the shapes and dtypes are known
the headers can be written first and each tensor copied into its byte range whenever it arrives, in
any order; that is all `ShardedWeightsWriter` does by hand. The split into files is huggingface_hub's
(`split_into_shards`, as save_pretrained splits) and the files are read back by
safetensors and `from_pretrained` unchanged.

Two writers feed it: `hf-zero consolidate` (one parameter at a time, read from a checkpoint's shards)
and `weights.save_weights`, the engine's (at stage 3 one unit at a time, gathered across the ranks). Both write the
checkpoint layout save_pretrained writes (`SavedLayout`), not the one transformers converts it into in memory.
This file knows safetensors and transformers' folder layout, nothing of the engine.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from huggingface_hub import get_torch_storage_size, split_state_dict_into_shards_factory
from torch import nn

from hf_zero.runtime.device import bytes_of, in_host_memory
from hf_zero.runtime.dtypes import SAFETENSORS_DTYPES

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


class SavedLayout:
    """The tensors save_pretrained writes for a model's state dict, made from it as its tensors arrive.

    transformers 5 converts some checkpoints while loading (Mixtral's experts, stored one tensor per expert and
    projection, become one 3-D `gate_up_proj` and `down_proj` per layer; legacy names are renamed) and
    save_pretrained reverts those conversions (`revert_weight_conversion`), so the files keep the layout that
    older transformers, inference servers and converters read by name. This does the same with transformers' own
    reversal, applied to each of its conversions as soon as all the model tensors it reads have arrived: one
    fused tensor gives its per-expert tensors at once; several tensors concatenated into one (LaraMini's
    `in_proj`) wait for the last of them, copied, since a unit's gathered memory is reused by the next. In the
    mappings tested (Mixtral, Qwen2-MoE, LaraMini, ViT) a conversion reads tensors of one module, so nothing waits
    past its unit; one whose tensors spanned units would be held until the last arrived. `planned` (meta
    tensors: names, shapes and dtypes) is in the model's names; `saved` is in save_pretrained's, in its order."""

    def __init__(self, model: nn.Module, planned: dict[str, torch.Tensor]) -> None:
        from transformers.core_model_loading import revert_weight_conversion

        self.model = model
        try:
            self.saved = revert_weight_conversion(model, planned)
        except Exception as e:
            raise ValueError(f"transformers could not revert its conversions of {type(model).__name__}'s weights "
                             f"to the layout save_pretrained writes ({type(e).__name__}: {e})") from e
        # Which of the model's tensors each reversal reads, keyed as revert_weight_conversion keys them.
        self.reversal_of = _reversal_keys(model, list(planned))
        self.reads: dict[str, set[str]] = {}
        for name, key in self.reversal_of.items():
            self.reads.setdefault(key, set()).add(name)
        self.waiting: dict[str, dict[str, torch.Tensor]] = {}

    def convert(self, arrived: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The saved tensors that `arrived` (model tensors by name) completes, by their saved names."""
        from transformers.core_model_loading import revert_weight_conversion

        started = set()
        for name, tensor in arrived.items():
            if name not in self.reversal_of:
                raise ValueError(f"{name} is not one of the {type(self.model).__name__} tensors planned for saving")
            key = self.reversal_of[name]
            self.waiting.setdefault(key, {})[name] = tensor
            started.add(key)
            if self.waiting[key].keys() == self.reads[key]:
                yield from revert_weight_conversion(self.model, self.waiting.pop(key)).items()
        # A batch's tensors may be a gathered unit's memory, reused by the next: what still waits is copied.
        for key in started & self.waiting.keys():
            self.waiting[key] = {name: t.clone() if name in arrived else t for name, t in self.waiting[key].items()}

    def check_complete(self) -> None:
        """Every reversal had all its tensors."""
        if self.waiting:
            key, waiting = next(iter(self.waiting.items()))
            missing = sorted(self.reads[key] - waiting.keys())
            raise RuntimeError(f"{key} is saved from {sorted(self.reads[key])}, and {missing[0]} never arrived")


def _reversal_keys(model: nn.Module, names: list[str]) -> dict[str, str]:
    """For each of the model's tensor names, the key revert_weight_conversion gathers it under: tensors under one
    key are reverted together (concatenated, say), each key independently of the others. It picks the conversions
    and keys them as revert_weight_conversion does (transformers 5.24, core_model_loading.py), which has no function
    of its own for it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
    )

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # not loaded by from_pretrained: the model type's own, as save_pretrained takes them
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    reversed_ = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reversed_ if isinstance(c, WeightConverter)]
    renamings = [c for c in reversed_ if isinstance(c, WeightRenaming)]
    keys = {}
    for name in names:
        key, pattern = apply_converters(name, converters)
        keys[name] = key if pattern is not None else apply_renamings(name, renamings)
    return keys


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


def split_into_shards(planned: dict[str, torch.Tensor], max_shard_size: int | str) -> Any:
    """huggingface_hub's split of `planned` into files, as save_pretrained splits the tensors it writes. Tensors that
    share storage are kept in one file and counted once: save_pretrained's per-expert tensors are views of the fused
    tensor they are reverted from, and so are their stand-ins. huggingface_hub's own split tells no meta tensors
    apart (`get_torch_storage_id`), so they are told apart here by the tensor whose storage they view."""
    def storage_of(tensor: torch.Tensor) -> int:
        return id(tensor if tensor._base is None else tensor._base)  # a view's `_base` is the tensor it views

    return split_state_dict_into_shards_factory(planned, filename_pattern="model{suffix}.safetensors",
                                                max_shard_size=max_shard_size, get_storage_id=storage_of,
                                                get_storage_size=get_torch_storage_size)


class ShardedWeightsWriter:
    """Writes `model.safetensors` (or `model-0000k-of-0000N.safetensors` and the index) for tensors
    described up front by `planned` (meta tensors do: only shape and dtype are read), accepting each
    tensor's values later, in any order. Files appear under their final names only on `close()`."""

    def __init__(self, folder: str | os.PathLike, planned: dict[str, torch.Tensor],
                 max_shard_size: int | str = SAVE_PRETRAINED_MAX_SHARD_SIZE) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.split = split_into_shards(planned, max_shard_size)
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
def write_as_they_arrive(folder: str | os.PathLike, model: nn.Module, planned: dict[str, torch.Tensor],
                         arrivals: Iterable[dict[str, torch.Tensor]], write: bool,
                         max_shard_size: int | str = SAVE_PRETRAINED_MAX_SHARD_SIZE) -> Exception | None:
    """Writes each batch of `model`'s tensors `arrivals` yields, in the layout save_pretrained writes
    (`SavedLayout`), into its place in the files planned for `planned` (the model's names, shapes and dtypes).
    Every batch is taken from `arrivals` even after a failure, or when this process does not `write`: on
    several ranks producing a batch is a collective that the others join. Returns the first error."""
    layout: SavedLayout | None = None
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
        nonlocal layout, writer
        layout = SavedLayout(model, planned)
        writer = ShardedWeightsWriter(folder, layout.saved, max_shard_size)

    def write_saved(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in layout.convert(tensors):
            writer.write(name, tensor)

    def close() -> None:
        layout.check_complete()
        writer.close()

    attempt(open_writer)
    for tensors in arrivals:
        attempt(lambda: write_saved(tensors))
    attempt(close)
    if writer is not None and error is not None:
        writer.abort()
    return error
