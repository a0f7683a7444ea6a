"""Loading a sharded checkpoint saved at any data-parallel size and stage.

A loader with another world size, bucket size or stage finds the elements it now owns by name and reads only those
slices (safetensors reads slices without loading the file): no rank ever holds more than its own partition. Loading
checks the manifest against the model and every file's size and SHA-256 before it changes any state. Frozen weights
are read back by any stage as its own pieces of them; those the manifest records by their source (`frozen_source`)
are re-read from that pretrained folder.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from torch import nn

from hf_zero.checkpoint import frozen_source
from hf_zero.checkpoint.files import CheckpointError, check_files, open_shard
from hf_zero.checkpoint.folders import readable_folder
from hf_zero.checkpoint.frozen_source import FrozenSources
from hf_zero.checkpoint.layout import FrozenPiece, PartitionedModel, ShardLayout, layout_of
from hf_zero.checkpoint.manifest import KERNEL_FLAGS, MANIFEST, UPDATE_FLAGS, module_state_file, read_manifest, tp_size
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.dtypes import TORCH_DTYPES
from hf_zero.runtime.trace import spanned
from hf_zero.zero.partition import copy_cut_into

if TYPE_CHECKING:
    from hf_zero.optim.update import UpdateBackend

logger = logging.getLogger("hf_zero")


@torch.no_grad()
@spanned("load_checkpoint")
def load_partitioned(model: PartitionedModel, directory: str | os.PathLike, sources: FrozenSources,
                     frozen_must_match: bool = False) -> dict[str, Any]:
    """Sets `model`'s masters, optimizer state and module state from a checkpoint (`load`); returns its manifest,
    whose training state the caller takes in. `sources` compare the frozen weights again at the next save: they
    may now be the checkpoint's."""
    layout = layout_of(model)
    manifest, module_state = load(directory, layout, model.backend, model.world_comm, model.module,
                                  frozen_must_match)
    sources.forget()
    restore_module_state(layout, module_state)
    return manifest


@dataclass
class _Opened:
    """A checkpoint being loaded: its folder, its checked manifest and pieces by name, and the shard files and
    frozen-weight source files opened so far."""

    folder: Path
    manifest: dict[str, Any]
    index: dict[str, list[tuple[int, int, str]]]
    files: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)


def load(directory: str | os.PathLike, layout: ShardLayout, backend: UpdateBackend, comm: Communicator,
         module: nn.Module, frozen_must_match: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Sets the backend's masters and optimizer state from a checkpoint saved at any data-parallel size and
    stage; returns the manifest (training state, client_state) and the module state for the caller to restore.
    Nothing changes unless every rank's checks passed: the whole manifest, every file's size and hash, and
    every stored tensor this rank will read (present, fp32, of the size the manifest gives), frozen weights recorded
    by their source read from the tensors `module`'s own loading names (`frozen_source.check_keys`), and with
    `frozen_must_match` that the frozen weights are the model's already (a peft base that resumes must be the one its
    adapter was trained on). What can still fail after that is the disk itself; that too fails on every rank, never
    leaving one waiting."""
    folder = readable_folder(Path(directory), comm.rank == 0)
    manifest, index = read_manifest(folder)
    _check_tensor_parallel_size(layout, manifest, folder)
    _check_model(layout, backend, manifest, folder)
    # Each rank hashes its share of the files; any failure stops every rank before any state changes.
    source = manifest.get("frozen_source")

    def check_all_files() -> None:
        check_shard_files(manifest["shards"][comm.rank::comm.world_size], folder)
        if source is not None:  # the base the frozen weights are read from must be the one they were saved from
            frozen_source.check_source_files(source, source["files"][comm.rank::comm.world_size])

    comm.agree(check_all_files, f"checking {folder}", CheckpointError)
    opened = _Opened(folder, manifest, index)
    with contextlib.ExitStack() as stack, torch.no_grad():
        comm.agree(lambda: _open_and_check(opened, stack, layout, module, frozen_must_match),
                   f"reading the shard headers under {folder}", CheckpointError)
        loaded: dict[str, torch.Tensor] = {}
        comm.agree(lambda: loaded.update(_read_and_set(opened, layout, backend)), f"reading {folder}",
                   CheckpointError)
    return manifest, loaded


def check_shard_files(shards: list[dict[str, Any]], folder: Path) -> None:
    """Each of the checkpoint's shard files is in `folder` with the size and SHA-256 its manifest gives."""
    def explain(path: Path, problem: str, shard: dict[str, Any]) -> str:
        if problem == "missing":
            return f"{path} is missing; the checkpoint is incomplete"
        if problem == "bytes":
            return (f"{path} is {path.stat().st_size} bytes, the manifest says {shard['bytes']}: the file is "
                    f"truncated or was replaced")
        return f"{path} does not match its SHA-256 in the manifest: the file is corrupted"

    check_files(folder, shards, explain)


def _open_and_check(opened: _Opened, stack: contextlib.ExitStack, layout: ShardLayout, module: nn.Module,
                    frozen_must_match: bool) -> None:
    """Opens the files this rank reads and checks every stored tensor it will read is there, as the manifest says."""
    manifest, index = opened.manifest, opened.index
    kinds = ["master", *manifest["optimizer"]["elementwise"]]
    ranges = [(piece.name, piece.param_lo, piece.param_hi) for chunks in layout.pieces for pieces in chunks
              for piece in pieces] + [(p.name, p.lo, p.hi) for p in layout.frozen_pieces if p.name in index]
    needed = {file for name, first, end in ranges for lo, hi, file in index[name] if lo < end and first < hi}
    for file in sorted(needed | {module_state_file(manifest)}):
        opened.files[file] = stack.enter_context(open_shard(opened.folder, file))
    source = manifest.get("frozen_source")
    if source is not None:
        frozen_source.check_keys(source, module, manifest["frozen"])
        frozen_names = [p.name for p in layout.frozen_pieces]
        opened.sources.update(stack.enter_context(frozen_source.opened(source, frozen_names)))
    for chunks in layout.pieces:
        for pieces in chunks:
            for piece, kind in ((piece, kind) for piece in pieces for kind in kinds):
                read_range(opened.files, index, kind, piece.name, piece.param_lo, piece.param_hi, None)
    for piece in layout.frozen_pieces:
        _read_frozen(opened, piece, "compare" if frozen_must_match else "check")
    _check_module_state(opened.files[module_state_file(manifest)], manifest, layout)


def _read_and_set(opened: _Opened, layout: ShardLayout, backend: UpdateBackend) -> dict[str, torch.Tensor]:
    """Reads this rank's chunks into the backend and the frozen pieces into the model; returns the module state."""
    manifest = opened.manifest
    kinds = ["master", *manifest["optimizer"]["elementwise"]]
    new_state: dict[int, dict[str, Any]] = {}
    position = 0
    for g, chunks in enumerate(layout.pieces):
        for k, pieces in enumerate(chunks):
            values = {kind: torch.zeros(layout.chunk_numels[g][k], dtype=torch.float32) for kind in kinds}
            for piece in pieces:
                n = piece.param_hi - piece.param_lo
                for kind, out in values.items():
                    read_range(opened.files, opened.index, kind, piece.name, piece.param_lo, piece.param_hi,
                               out[piece.chunk_lo:piece.chunk_lo + n])
            master = values.pop("master")
            state = {**manifest["optimizer"]["scalars"][g], **values} if values else {}
            backend.load_chunk(g, k, master, state)
            if state:
                new_state[position] = state
            position += 1
    # States on NVMe went to their files in load_chunk; the optimizer still takes the hyper-parameters.
    _load_optimizer(backend.optimizer, manifest, new_state if backend.states_in_optimizer else {})
    for piece in layout.frozen_pieces:
        _read_frozen(opened, piece, "fill")
    return _read_module_state(opened.files, manifest, layout)


@torch.no_grad()
def restore_module_state(layout: ShardLayout, module_state: dict[str, torch.Tensor]) -> None:
    """Copies the stored module state into the model; a split frozen parameter takes its own tp part of the
    stored whole tensor (cut locally, as `distribute_tensor` cut it when the model was made parallel)."""
    for name, value in module_state.items():
        copy_cut_into(layout.module_state[name], value)


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON side file (config.json, adapter_config.json), as the object it must hold."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is damaged") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object; it holds a {type(value).__name__}")
    return value


# ---- checks against the model ---------------------------------------------------------------------
def _check_tensor_parallel_size(layout: ShardLayout, manifest: dict[str, Any], folder: Path) -> None:
    saved, mine = tp_size(manifest), layout.tensor_parallel["size"]
    if saved != mine:
        raise CheckpointError(f"{folder / MANIFEST} was saved with tensor_parallel_size {saved} and this engine runs "
                              f"{mine}: load it with tensor_parallel_size {saved} (any data-parallel size and stage), "
                              f"or consolidate it (hf-zero consolidate) and start from those weights")


def _check_model(layout: ShardLayout, backend: UpdateBackend, manifest: dict[str, Any], folder: Path) -> None:
    mine = {name: (p["shape"], p["group"]) for name, p in layout.parameters.items()}
    saved = {name: (p["shape"], p["group"]) for name, p in manifest["parameters"].items()}
    for name in sorted(set(mine) | set(saved)):
        if mine.get(name) != saved.get(name):
            raise CheckpointError(
                f"{folder / MANIFEST} is from another model or optimizer grouping: parameter {name!r} is "
                f"{_describe(saved.get(name))} in the checkpoint and {_describe(mine.get(name))} in this engine")
    if manifest["optimizer"]["class"] != type(backend.optimizer).__name__:
        raise CheckpointError(f"{folder / MANIFEST} holds {manifest['optimizer']['class']} state; this engine "
                              f"steps {type(backend.optimizer).__name__}")
    if len(manifest["optimizer"]["param_groups"]) != len(backend.optimizer.param_groups):
        raise CheckpointError(f"{folder / MANIFEST} holds {len(manifest['optimizer']['param_groups'])} param groups; "
                              f"this engine's optimizer has {len(backend.optimizer.param_groups)}")
    _check_optimizer_flags(backend.optimizer, manifest, folder)
    saved_frozen = {name: entry["shape"] for name, entry in manifest.get("frozen", {}).items()}
    # Saved before frozen weights were stored apart: they are in the module state.
    saved_frozen |= {name: layout.frozen[name]["shape"] for name in manifest["module_state"] if name in layout.frozen}
    for name in sorted(set(saved_frozen) | set(layout.frozen)):
        if saved_frozen.get(name) != (layout.frozen[name]["shape"] if name in layout.frozen else None):
            raise CheckpointError(
                f"{folder / MANIFEST} is from another model or another choice of trained parameters: frozen weight "
                f"{name!r} is {_describe_frozen(saved_frozen.get(name))} in the checkpoint and "
                f"{_describe_frozen(layout.frozen[name]['shape'] if name in layout.frozen else None)} in this engine "
                f"(a parameter frozen on one side and trained on the other is both)")
    differ = sorted((set(manifest["module_state"]) - set(layout.frozen)) ^ set(layout.module_state))
    if differ:
        where = "the checkpoint" if differ[0] in manifest["module_state"] else "this model"
        raise CheckpointError(f"{folder / MANIFEST} is from another model: only {where} has the frozen parameter or "
                              f"buffer {differ[0]!r}")


def _check_optimizer_flags(optimizer: torch.optim.Optimizer, manifest: dict[str, Any], folder: Path) -> None:
    """The checkpoint's hyper-parameters replace the optimizer's at load (as torch's load_state_dict does), but its
    update flags (amsgrad, maximize, capturable, ...) may not: they choose another update (gradient ascent), states
    the checkpoint does not hold (amsgrad's max_exp_avg_sq), or a device the states are not on (capturable). Such a
    flag must be what the run built."""
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, manifest["optimizer"]["param_groups"])):
        for flag in sorted(UPDATE_FLAGS & saved.keys()):
            if saved[flag] != group.get(flag):
                raise CheckpointError(
                    f"{folder / MANIFEST}: param group {g} has {flag}={json.dumps(saved[flag])} in the checkpoint and "
                    f"{flag}={json.dumps(group.get(flag))} in this run's {type(optimizer).__name__}; a flag must "
                    f"be the one the states were trained with. Build the optimizer with {flag}="
                    f"{saved[flag]!r} to resume this checkpoint")


def _describe_frozen(shape: list[int] | None) -> str:
    return "absent" if shape is None else f"frozen, of shape {shape}"


def _describe(entry: tuple[list[int], int] | None) -> str:
    return "absent" if entry is None else f"shape {entry[0]} in param group {entry[1]}"


def _check_module_state(writer: Any, manifest: dict[str, Any], layout: ShardLayout) -> None:
    stored = set(writer.keys())
    for name in manifest["module_state"]:
        key = f"module/{name}"
        if key not in stored:
            raise CheckpointError(f"{module_state_file(manifest)} has no tensor {key!r}, which the manifest lists")
        shape = writer.get_slice(key).get_shape()
        want = layout.frozen[name]["shape"] if name in layout.frozen else list(layout.module_state[name].shape)
        if shape != want:
            raise CheckpointError(f"{module_state_file(manifest)}: {key!r} has shape {shape}; the model's is {want}")


# ---- reading tensors ------------------------------------------------------------------------------
def read_range(files: dict[str, Any], index: dict, kind: str, name: str, lo: int, hi: int,
               out: torch.Tensor | None, dtype: str = "F32") -> None:
    """Fills `out` with elements [lo, hi) of `kind` for parameter `name`, reading only overlapping slices;
    each stored tensor must be `dtype` (fp32 but for frozen weights) of its piece's size. With `out` None, only
    checks that."""
    for a, b, file in index[name]:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            key = f"{kind}/{name}/{a}"
            try:  # (not `key in keys()`: that builds the list of every key in the file, once per piece)
                stored = files[file].get_slice(key)
            except SafetensorError:
                raise CheckpointError(f"{file} has no tensor {key!r}, which the manifest places there") from None
            if stored.get_dtype() != dtype or stored.get_shape() != [b - a]:
                raise CheckpointError(f"{file}: {key!r} is {stored.get_dtype()} of shape {stored.get_shape()}; the "
                                      f"manifest's piece is {dtype} of shape [{b - a}]")
            if out is not None:
                out[s - lo:e - lo].copy_(stored[s - a:e - a])


def _read_frozen(opened: _Opened, piece: FrozenPiece, mode: str) -> None:
    """The elements a frozen piece views, from the checkpoint: "fill" copies them in, "check" checks they are there,
    "compare" that they are the values the piece holds (the base a resumed adapter was trained on). A checkpoint
    saved before frozen weights were stored apart holds them whole in its module state; one that records them by
    their source reads them from its files (`opened.sources`)."""
    manifest = opened.manifest
    entry = manifest.get("frozen", {}).get(piece.name)
    if "frozen_source" in manifest:
        stored = frozen_source.read(opened.sources, manifest["frozen_source"], manifest["frozen"], piece.name,
                                    piece.lo, None if mode == "check" else piece.hi)
    elif entry is None:
        if mode == "check":
            return
        module_state = opened.files[module_state_file(manifest)]
        stored = module_state.get_tensor(f"module/{piece.name}").reshape(-1)[piece.lo:piece.hi]
    else:
        stored = None if mode == "check" else torch.empty(piece.hi - piece.lo, dtype=TORCH_DTYPES[entry["dtype"]])
        read_range(opened.files, opened.index, "frozen", piece.name, piece.lo, piece.hi, stored, entry["dtype"])
    if mode == "fill":
        piece.values.copy_(stored)
    elif mode == "compare" and not torch.equal(stored, piece.values.reshape(-1).to(stored.dtype)):
        differs = (stored.double() - piece.values.reshape(-1).double()).abs().max().item()
        raise CheckpointError(f"the frozen weight {piece.name} differs from the checkpoint's (by up to {differs:.3g}): "
                              f"the adapter was trained on another base model. Resume with the base it was trained "
                              f"on, or start a new run instead of resuming")


def _read_module_state(files: dict[str, Any], manifest: dict[str, Any],
                       layout: ShardLayout) -> dict[str, torch.Tensor]:
    names = [name for name in manifest["module_state"] if name in layout.module_state]  # not frozen weights
    if not names:
        return {}
    writer = files[module_state_file(manifest)]
    return {name: writer.get_tensor(f"module/{name}") for name in names}


# ---- the optimizer --------------------------------------------------------------------------------
def _load_optimizer(optimizer: torch.optim.Optimizer, manifest: dict[str, Any], state: dict[int, dict]) -> None:
    """Through the optimizer's own load_state_dict, which casts and places the state as it expects. The
    checkpoint's hyper-parameters win, as they do in torch's load_state_dict; where they differ from the
    optimizer's, a warning says so."""
    current = optimizer.state_dict()
    for g, (group, saved) in enumerate(zip(current["param_groups"], manifest["optimizer"]["param_groups"])):
        _warn_of_replaced_hyper_parameters(g, group, saved)
        kernels = {flag: group[flag] for flag in KERNEL_FLAGS & group.keys()}
        for flag, mine in kernels.items():
            if flag in saved and saved[flag] != mine:
                logger.warning(f"load_checkpoint: param group {g} has {flag}={mine} in this optimizer and "
                               f"{saved[flag]} in the checkpoint; this run's is kept (it chooses torch's kernel only)")
        group.update(saved)
        group.update(kernels)
    for entry in state.values():
        for key, value in entry.items():
            if not torch.is_tensor(value):
                entry[key] = torch.tensor(value, dtype=torch.float32)
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def _warn_of_replaced_hyper_parameters(g: int, current: dict[str, Any], saved: dict[str, Any]) -> None:
    """The learning rate and weight decay the script set, against the checkpoint's. With an lr scheduler
    the groups carry `initial_lr`: the scheduled lr moves every step and the scheduler's own state restores
    it, so the script's setting is compared as `initial_lr`."""
    lr_key = "initial_lr" if "initial_lr" in current and "initial_lr" in saved else "lr"
    for key in (lr_key, "weight_decay"):
        if key in current and key in saved and current[key] != saved[key]:
            logger.warning(f"load_checkpoint: param group {g} has {key} {current[key]} in this optimizer and "
                           f"{saved[key]} in the checkpoint; the checkpoint's value is used (as torch's "
                           f"Optimizer.load_state_dict does). Set it after loading to train with another.")
