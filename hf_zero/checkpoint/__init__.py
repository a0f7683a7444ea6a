"""Sharded engine checkpoints: each rank writes its own partition; any world size and stage can load them.

A checkpoint folder holds one safetensors file per writing rank and one `manifest.json`. Tensors are
addressed by parameter name and element offset (`exp_avg/transformer.h.0.attn.c_attn.weight/4096`),
never by flat-buffer position, so a loader with another world size, bucket size or stage finds the
elements it now owns by name and reads only those slices (safetensors reads slices without loading
the file). No rank ever holds more than its own partition.

Saving is all-or-nothing: files go to `<dir>.partial`, every rank reports success or its error, and
only then does rank 0 write the manifest and rename the folder into place. A failure on any rank becomes
the same error on every rank (no rank is left waiting in a collective), and a crash at any point leaves
the newest complete checkpoint loadable (see `settle`).
Loading checks the manifest against the model and every file's size and SHA-256 before it changes
any state.

With tensor parallelism each rank's flat buffers hold local parts of DTensors. A parameter split
across the tp group is stored as one tensor per tp rank (`<name>@tp<r>`, the local part), addressed by
offset like any other, so the checkpoint loads at any dp size and stage with the same tp size; the
manifest's "tensor_parallel" entry says how the parts make the whole, for `hf-zero consolidate`.
Parameters every tp rank holds whole are written by tp rank 0 alone.

Frozen weights (a LoRA base) are stored the same way, by name and offset (`frozen/<name>/<lo>`), in the dtype the
model holds them: at stage 3 each rank writes the elements it holds of them, at stages 0-2 rank 0 writes them
whole, and any stage reads its own. Buffers and frozen tp parts are the module state, written whole by rank 0.
A frozen weight that is a tensor of the pretrained folder the model was loaded from is not stored: the manifest records
that source (`frozen_source`), and loading re-reads it from there.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from hf_zero.checkpoint import frozen_source
from hf_zero.checkpoint.export import weights_to_save
from hf_zero.checkpoint.files import CheckpointError, sha256
from hf_zero.optim.update import is_elementwise
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import in_host_memory
from hf_zero.runtime.dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES
from hf_zero.runtime.tensor_parallel import split_of
from hf_zero.settings.config import DTYPES
from hf_zero.zero.partition import (
    FlatParamBuffer,
    ParamSlice,
    copy_cut_into,
    is_tp_replicated,
    local,
    partitioned_frozen,
)

if TYPE_CHECKING:
    from hf_zero.optim.update import UpdateBackend

logger = logging.getLogger("hf_zero")
FORMAT, VERSION = "hf_zero.checkpoint", 1
MANIFEST = "manifest.json"
# Where a ZeroTrainer checkpoint-N folder keeps the engine checkpoint, beside the config and tokenizer.
TRAINER_SUBFOLDER = "zero_checkpoint"


@dataclass(frozen=True)
class StoredPiece:
    """The part of one parameter inside one of this rank's chunks, under the name it is stored by."""

    name: str       # the parameter's name, or for a part split across the tp group, `<name>@tp<r>`
    param_lo: int   # first element of the piece within the (local part of the) parameter
    param_hi: int
    chunk_lo: int   # where the piece starts within the chunk
    written: bool   # whether this rank stores it (a piece every tp rank holds is stored by tp rank 0 alone)


@dataclass(frozen=True)
class FrozenPiece:
    """Elements [lo, hi) of a frozen weight as this rank holds them (stage 3: inside its chunk of a unit's frozen
    weights; stages 0-2: the whole weight), viewed where the engine keeps them."""

    name: str
    lo: int
    hi: int
    values: torch.Tensor
    written: bool   # whether this rank stores it (at stages 0-2, where every rank holds it whole, rank 0 alone)


@dataclass(frozen=True)
class ShardLayout:
    """What a checkpoint needs to know of how an engine partitions its model, and nothing of the engine:
    the engine describes itself with `describe_layout`, and saving and loading work from this."""

    zero_stage: int
    dtype: str
    chunk_numels: list[list[int]]              # [group][chunk]: this rank's chunks, in the optimizer's order
    pieces: list[list[list[StoredPiece]]]      # [group][chunk]: the parameter pieces in each
    writes_states: bool                        # False where another rank writes the same states (stage 0)
    parameters: dict[str, dict[str, Any]]      # stored name -> shape and param group, every tp rank's
    tensor_parallel: dict[str, Any]            # tp size, and how each split parameter's parts make it whole
    weights: list[list[str]]                   # [name save_pretrained writes, key of the stored tensor]
    module_state: dict[str, torch.Tensor]      # buffers and frozen tp parts, replicated on every rank
    frozen: dict[str, dict[str, Any]]          # frozen weight -> shape and dtype
    frozen_pieces: list[FrozenPiece]           # what this rank holds of them


def tp_part_name(name: str, tp_rank: int) -> str:
    return f"{name}@tp{tp_rank}"


def describe_layout(module: nn.Module, flats_by_group: list[list[FlatParamBuffer]],
                    owned_ranges: list[list[tuple[FlatParamBuffer, int, int]]],
                    frozen_chunks: list[tuple[FlatParamBuffer, int, int, torch.Tensor]], zero_stage: int, dtype: str,
                    rank: int, tp_comm: Communicator | None) -> ShardLayout:
    """The layout of an engine's partition. `frozen_chunks`: the flat buffers of frozen weights the engine
    partitions (stage 3), each with the element range [lo, hi) this rank holds and the chunk holding it. With
    tensor parallelism every rank must call it (the parameter table holds every tp rank's parts, gathered over
    the tp group)."""
    def stored_name(s: ParamSlice) -> str:
        return s.name if tp_comm is None or is_tp_replicated(s.param) else tp_part_name(s.name, tp_comm.rank)

    slices = [(g, s) for g, flats in enumerate(flats_by_group) for flat in flats for s in flat.slices]
    pieces = [[[StoredPiece(stored_name(p.slice), p.param_lo, p.param_hi, p.range_lo,
                            tp_comm is None or tp_comm.rank == 0 or not is_tp_replicated(p.slice.param))
                for p in flat.pieces_between(lo, hi)] for flat, lo, hi in chunks] for chunks in owned_ranges]
    parameters = {stored_name(s): {"shape": list(s.shape), "group": g} for g, s in slices}
    tensor_parallel: dict[str, Any] = {"size": 1, "split": {}}
    if tp_comm is not None:
        parameters = {name: entry for part in tp_comm.all_gather_object(parameters) for name, entry in part.items()}
        tensor_parallel = {"size": tp_comm.world_size,
                           "split": {s.name: split_of(s.param) for _, s in slices if not is_tp_replicated(s.param)}}
    frozen_pieces = [FrozenPiece(p.slice.name, p.param_lo, p.param_hi,
                                 chunk[p.range_lo:p.range_lo + p.param_hi - p.param_lo], True)
                     for flat, lo, hi, chunk in frozen_chunks for p in flat.pieces_between(lo, hi)]
    frozen_slices = {id(s.param): s for flat, *_ in frozen_chunks for s in flat.slices}
    frozen = {s.name: {"shape": list(s.shape), "dtype": SAFETENSORS_DTYPES[s.param.dtype]}
              for s in frozen_slices.values()}
    stored_as = {id(s.param): f"master/{s.name}" for _, s in slices} | {i: f"frozen/{s.name}"
                                                                         for i, s in frozen_slices.items()}
    for name, p in module.named_parameters():
        if partitioned_frozen(p) and id(p) not in frozen_slices:  # held whole on every rank (stages 0-2)
            frozen[name] = {"shape": list(p.shape), "dtype": SAFETENSORS_DTYPES[p.dtype]}
            frozen_pieces.append(FrozenPiece(name, 0, p.numel(), p.data.view(-1), rank == 0))
            stored_as[id(p)] = f"frozen/{name}"
    weights = [[name, stored_as.get(id(t), f"module/{name}")] for name, t in weights_to_save(module).items()]
    module_state = {name: t for name, t in module.state_dict(keep_vars=True).items() if id(t) not in stored_as}
    return ShardLayout(zero_stage, dtype, [[hi - lo for _, lo, hi in chunks] for chunks in owned_ranges], pieces,
                       zero_stage >= 1 or rank == 0, parameters, tensor_parallel, weights, module_state, frozen,
                       frozen_pieces)


def tp_size(manifest: dict[str, Any]) -> int:
    return manifest.get("tensor_parallel", {"size": 1})["size"]


def tp_split(manifest: dict[str, Any], name: str) -> dict[str, Any] | None:
    """How parameter `name` is split across the tp group (`split_of`), or None when it is stored whole."""
    return manifest.get("tensor_parallel", {"split": {}})["split"].get(name)


def whole_shape(manifest: dict[str, Any], name: str) -> list[int]:
    """A parameter's shape as the model declares it (the whole of its tp parts)."""
    split = tp_split(manifest, name)
    return split["shape"] if split else manifest["parameters"][name]["shape"]


def write_model_files(module: torch.nn.Module, folder: Path) -> None:
    """config.json (and generation_config.json) of a transformers model, so the checkpoint consolidates
    into a folder from_pretrained can load without the training script. For a peft model, its base model's
    and the active adapter's adapter_config.json."""
    peft_config = getattr(module, "peft_config", None)
    base = module.get_base_model() if peft_config is not None else module
    config = getattr(base, "config", None)
    if not hasattr(config, "save_pretrained"):
        return
    config.architectures = [type(base).__name__]  # as save_pretrained records it
    config.save_pretrained(folder)
    if getattr(base, "can_generate", lambda: False)() and getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    if peft_config is not None:
        peft_config[module.active_adapter].save_pretrained(folder)


def _umask() -> int:
    """The process's umask, which new files get their permissions from. Linux shows it in /proc; elsewhere
    setting it is the only way to read it (and sets it back)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


# ---- save ------------------------------------------------------------------------------------
# A checkpoint folder is complete when its manifest is there: the manifest is written last, through a
# temporary file and a rename. A save writes `<dir>.partial`, then moves `<dir>` to `<dir>.old`, the
# partial folder to `<dir>`, and removes `<dir>.old`. A crash between any two of these leaves at least
# one complete folder; `settle` finishes the interrupted save (it was complete) or drops its partial
# folder (it was not), and loading reads the same folder settling would keep.
#
# A save moves or removes only folders this library made: each carries MARKER from its creation, and a
# removal takes it last, so a folder half removed by a crash is still recognised. A folder in the way that
# has neither MARKER nor an hf_zero manifest (a user's `ckpt.old`, or `ckpt` holding a training log) is
# refused, naming what it holds; an empty one is taken.
MARKER = ".hf_zero_checkpoint"


def save_folders(final: Path) -> tuple[Path, Path]:
    """Where a save of `final` writes its files, and where it moves the previous checkpoint meanwhile."""
    return final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")


def is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def numbered_folders(parent: str | os.PathLike, prefix: str) -> list[Path]:
    """The folders `prefix`-N in `parent` (a training run's checkpoints), by N, oldest first; none where `parent` is
    absent."""
    parent = Path(parent)
    found = [(int(m.group(1)), entry) for entry in parent.iterdir()
             if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)", entry.name)) and entry.is_dir()] \
        if parent.is_dir() else []
    return [entry for _, entry in sorted(found)]


def made_here(folder: Path) -> bool:
    """Whether `folder` is a checkpoint folder this library made (also one saved before MARKER existed)."""
    if (folder / MARKER).is_file():
        return True
    try:
        return json.loads((folder / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_save_target(final: Path) -> None:
    """Refuses to save to `final` when that would replace or remove something this library did not write."""
    for folder in (final, *save_folders(final)):
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise CheckpointError(f"{folder} exists and is not a folder; a checkpoint save would replace it. Move "
                                  f"it, or save the checkpoint elsewhere")
        if folder.is_dir() and not made_here(folder) and any(folder.iterdir()):
            held = sorted(p.name for p in folder.iterdir())
            listed = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise CheckpointError(f"{folder} holds files that are not an hf_zero checkpoint ({listed}); a checkpoint "
                                  f"save would replace them. Save the checkpoint to a folder of its own (a new one, "
                                  f"or one an earlier save_checkpoint wrote)")


def newest_complete(final: Path) -> Path | None:
    """The folder holding the newest complete checkpoint saved as `final`, whatever point an interrupted
    save stopped at: a complete `.partial` is newer than `final`, which is newer than `.old`."""
    partial, old = save_folders(final)
    return next((f for f in (partial, final, old) if is_complete(f)), None)


def settle(final: Path) -> None:
    """Leaves `final` the newest complete checkpoint and nothing beside it, finishing or undoing an
    interrupted save. Each move is one a save makes, in the same order, so a crash in here is one too."""
    check_save_target(final)
    partial, old = save_folders(final)
    if is_complete(partial):
        _swap_in(partial, final)
        return
    _remove(partial)  # an interrupted save's files, never a checkpoint
    if not final.exists() and is_complete(old):
        _rename(old, final)
    _remove(old)


def _swap_in(partial: Path, final: Path) -> None:
    _, old = save_folders(final)
    if final.exists():
        if old.exists():  # a copy as old as `final` or older: `final` stays in place meanwhile
            _remove(old)
        _rename(final, old)
    _rename(partial, final)
    _remove(old)


# Every change a save makes to the folders goes through these two, so the tests can stop it at each.
def _rename(source: Path, target: Path) -> None:
    source.rename(target)  # atomic, and replaces a file in the way


def _remove(folder: Path) -> None:
    """Removes a folder this library made (`check_save_target` refused any other), or an empty one. The
    manifest goes first (a folder half removed is never taken for a complete checkpoint), MARKER last."""
    if not folder.is_dir():
        return
    if made_here(folder):
        (folder / MARKER).touch()  # a checkpoint saved before MARKER existed gets one, to be removed last
        (folder / MANIFEST).unlink(missing_ok=True)
        for entry in folder.iterdir():
            if entry.name != MARKER:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        (folder / MARKER).unlink()
    folder.rmdir()  # fails on a folder that is not ours and not empty: nothing of it was removed


def save(directory: str | os.PathLike, layout: ShardLayout, backend: "UpdateBackend", comm: Communicator,
         module: nn.Module, training_state: dict[str, Any], client_state: Any = None,
         source: dict[str, Any] | None = None) -> Path:
    """Every rank of `comm` (all ranks holding part of the model's state) writes its partition, rank 0 the
    manifest; `training_state` (step counters, loss scale) goes into the manifest as it is. With `source` (a
    `frozen_source` entry), the frozen weights are recorded by it instead of stored."""
    final = Path(directory)
    if final.name in ("", ".", ".."):  # every rank refuses alike, before any collective
        raise CheckpointError(f"save_checkpoint needs a folder to create or replace, such as 'ckpt' or "
                              f"'out/step-100'; got {str(directory)!r}")
    partial, _ = save_folders(final)
    check_name_length(final)
    layout = _with_whole_module_state(layout)
    if source is not None:
        layout = replace(layout, frozen_pieces=[replace(p, written=False) for p in layout.frozen_pieces])
    lock_path = final.with_name(final.name + ".lock")
    lock = FileLock(lock_path, timeout=0)
    made_lock = False  # whether this save created the lock file, which it then removes (none of a user's)

    def fresh_partial() -> None:
        # Rank 0 alone settles and creates it, and the others wait for that (agree gathers): a rank
        # creating it while rank 0 removes an interrupted save's folder would lose its files or fail.
        if comm.rank == 0:
            nonlocal made_lock
            final.parent.mkdir(parents=True, exist_ok=True)
            made_lock = not lock_path.exists()
            try:  # held until the save ends: another process's save of the same folder would mix their files
                lock.acquire()
            except Timeout:
                raise CheckpointError(f"another save of {final} is in progress (it holds {lock.lock_file}); wait "
                                      f"for it to end, or save to another folder") from None
            except OSError as error:  # filelock opens the lock without following links: a link was ELOOP
                what = "a symbolic link" if lock_path.is_symlink() else f"not a file it can lock ({error.strerror})"
                raise CheckpointError(f"{lock_path}, the save's lock, is {what}: it must be a plain file or absent; "
                                      f"remove it, or save to another folder") from None
            settle(final)
            partial.mkdir(parents=True)
            (partial / MARKER).write_text(f"{FORMAT}: a checkpoint folder, moved and removed by later saves\n")

    def commit(shards: list[dict[str, Any] | None]) -> None:
        if comm.rank == 0:
            write_model_files(module, partial)
            manifest = _manifest(layout, backend, comm, training_state, shards, client_state)
            if source is not None:
                manifest["frozen_source"] = source
            written = partial / (MANIFEST + ".tmp")
            written.write_text(json.dumps(manifest, indent=1))
            _rename(written, partial / MANIFEST)  # from here on the new checkpoint is complete
            _swap_in(partial, final)

    try:
        comm.agree(fresh_partial, f"creating {partial}", CheckpointError)
        shards = comm.agree(lambda: _write_shard(layout, backend, comm, partial), f"writing the shards under {partial}",
                            CheckpointError)
        comm.agree(lambda: commit(shards), f"committing {final}", CheckpointError)
    except CheckpointError:
        if comm.rank == 0 and lock.is_locked:
            with contextlib.suppress(OSError):  # the cleanup's own failure must not hide why the save failed
                if made_here(partial) and not is_complete(partial):
                    _remove(partial)
        raise
    finally:
        if lock.is_locked:
            if made_lock:  # before the release: another save then finds no file, or a new one of its own
                lock_path.unlink(missing_ok=True)
            lock.release()
    return final


def check_name_length(final: Path) -> None:
    """Refuses a folder name whose save folders and lock (`<name>.partial`, `.old`, `.lock`) the file system cannot
    name."""
    existing = next(p for p in (final.parent, *final.parent.parents) if p.exists())
    limit = os.pathconf(existing, "PC_NAME_MAX")
    if len(os.fsencode(final.name + ".partial")) > limit:  # the longest of the save's names (".lock", ".old")
        raise CheckpointError(f"the checkpoint folder name {final.name!r} is {len(os.fsencode(final.name))} bytes; a "
                              f"save also writes {final.name + '.partial'!r}, which this file system cannot name "
                              f"(names are at most {limit} bytes): use a name of at most {limit - len('.partial')} "
                              f"bytes")


def _with_whole_module_state(layout: ShardLayout) -> ShardLayout:
    """Rank 0 stores the module state, as the model holds it without tensor parallelism. A frozen parameter
    split across the tp group (not stepped, so not in the engine's shards) is stored whole: every rank joins
    its all-gather (`full_tensor`, the same names in the same order everywhere), for the save's duration."""
    whole = {name: t if is_tp_replicated(t) else t.detach().full_tensor() for name, t in layout.module_state.items()}
    return replace(layout, module_state=whole)


@torch.no_grad()
def restore_module_state(layout: ShardLayout, module_state: dict[str, torch.Tensor]) -> None:
    """Copies the stored module state into the model; a split frozen parameter takes its own tp part of the
    stored whole tensor (cut locally, as `distribute_tensor` cut it when the model was made parallel)."""
    for name, value in module_state.items():
        copy_cut_into(layout.module_state[name], value)


def _write_shard(layout: ShardLayout, backend: "UpdateBackend", comm: Communicator,
                 folder: Path) -> dict[str, Any] | None:
    """Writes this rank's partition; returns what the manifest says about the file."""
    if not layout.writes_states:
        return None
    # Every piece goes to the file from host memory: a piece on the device is copied into a host buffer of
    # its own, in ordinary memory (pinned, the 12 bytes per parameter / Nd of a save would stay page-locked
    # in the caching host allocator for the rest of the run). A clone on the device would hold as much
    # extra device memory for the duration of the save.
    tensors: dict[str, torch.Tensor] = {}
    starts = set()

    def on_host(key: str, value: torch.Tensor) -> None:
        host = in_host_memory(value)
        if host.numel() and host.data_ptr() in starts:
            host = host.clone()  # a tied tensor already in host memory: the file stores each name apart
        starts.add(host.data_ptr())
        tensors[key] = host

    listed = []
    scalars: list[dict[str, float]] = [{} for _ in layout.pieces]
    elementwise: set[str] = set()
    for g, chunks in enumerate(layout.pieces):
        for k, pieces in enumerate(chunks):
            master, state = backend.chunk_state(g, k)  # read from the files when the states live on NVMe
            for key, value in state.items():
                if is_elementwise(value, master):
                    elementwise.add(key)
                else:
                    scalars[g][key] = float(value)
            for piece in [p for p in pieces if p.written]:
                name, lo, hi, at = piece.name, piece.param_lo, piece.param_hi, piece.chunk_lo
                listed.append([name, lo, hi])
                on_host(f"master/{name}/{lo}", master.detach()[at:at + hi - lo].float())
                for key, value in state.items():
                    if is_elementwise(value, master):
                        on_host(f"{key}/{name}/{lo}", value[at:at + hi - lo])
    frozen_listed = []
    for piece in (p for p in layout.frozen_pieces if p.written):
        frozen_listed.append([piece.name, piece.lo, piece.hi])
        on_host(f"frozen/{piece.name}/{piece.lo}", piece.values.detach())
    if comm.rank == 0:
        for name, tensor in layout.module_state.items():
            on_host(f"module/{name}", local(tensor.detach()).contiguous())
    file = folder / f"rank{comm.rank:05d}-of-{comm.world_size:05d}.safetensors"
    save_file(tensors, str(file))
    file.chmod(0o666 & ~_umask())  # safetensors creates it 0600; other accounts read it like the manifest
    return {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256(file), "pieces": listed,
            "frozen_pieces": frozen_listed, "optimizer_state": {"scalars": scalars, "elementwise": sorted(elementwise)}}


def _manifest(layout: ShardLayout, backend: "UpdateBackend", comm: Communicator, training_state: dict[str, Any],
              shards: list[dict[str, Any] | None], client_state: Any) -> dict[str, Any]:
    written = [s for s in shards if s is not None]
    # Every rank saw the same per-group scalars (Adam's step); rank 0's shard always exists.
    optimizer_state = [s.pop("optimizer_state") for s in written][0]
    optimizer = backend.optimizer
    return {
        "format": FORMAT, "version": VERSION, "zero_stage": layout.zero_stage, "world_size": comm.world_size,
        "dtype": layout.dtype, **training_state,
        "parameters": layout.parameters, "tensor_parallel": layout.tensor_parallel,
        "optimizer": {"class": type(optimizer).__name__, **optimizer_state,
                      "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                       for group in optimizer.param_groups]},
        "module_state": sorted(layout.module_state), "frozen": layout.frozen, "weights": layout.weights,
        "shards": written,
        "client_state": client_state,
    }


# ---- load ------------------------------------------------------------------------------------
def load(directory: str | os.PathLike, layout: ShardLayout, backend: "UpdateBackend", comm: Communicator,
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
    shards = manifest["shards"]
    source = manifest.get("frozen_source")

    def check_all_files() -> None:
        check_files(shards[comm.rank::comm.world_size], folder)
        if source is not None:  # the base the frozen weights are read from must be the one they were saved from
            frozen_source.check_files(source, source["files"][comm.rank::comm.world_size])

    comm.agree(check_all_files, f"checking {folder}", CheckpointError)
    kinds = ["master", *manifest["optimizer"]["elementwise"]]
    with contextlib.ExitStack() as stack, torch.no_grad():
        files: dict[str, Any] = {}
        sources: dict[str, Any] = {}

        def open_and_check() -> None:
            ranges = [(piece.name, piece.param_lo, piece.param_hi) for chunks in layout.pieces for pieces in chunks
                      for piece in pieces] + [(p.name, p.lo, p.hi) for p in layout.frozen_pieces if p.name in index]
            needed = {file for name, first, end in ranges for lo, hi, file in index[name] if lo < end and first < hi}
            for file in sorted(needed | {module_state_file(manifest)}):
                files[file] = stack.enter_context(open_shard(folder, file))
            if source is not None:
                frozen_source.check_keys(source, module, manifest["frozen"])
                frozen_names = [p.name for p in layout.frozen_pieces]
                sources.update(stack.enter_context(frozen_source.opened(source, frozen_names)))
            for chunks in layout.pieces:
                for pieces in chunks:
                    for piece, kind in ((piece, kind) for piece in pieces for kind in kinds):
                        read_range(files, index, kind, piece.name, piece.param_lo, piece.param_hi, None)
            for piece in layout.frozen_pieces:
                _read_frozen(files, sources, index, manifest, piece, "compare" if frozen_must_match else "check")
            _check_module_state(files[module_state_file(manifest)], manifest, layout)

        comm.agree(open_and_check, f"reading the shard headers under {folder}", CheckpointError)
        loaded: dict[str, Any] = {}

        def read_and_set() -> None:
            new_state: dict[int, dict[str, Any]] = {}
            position = 0
            for g, chunks in enumerate(layout.pieces):
                for k, pieces in enumerate(chunks):
                    values = {kind: torch.zeros(layout.chunk_numels[g][k], dtype=torch.float32) for kind in kinds}
                    for piece in pieces:
                        n = piece.param_hi - piece.param_lo
                        for kind, out in values.items():
                            read_range(files, index, kind, piece.name, piece.param_lo, piece.param_hi,
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
                _read_frozen(files, sources, index, manifest, piece, "fill")
            loaded.update(_read_module_state(files, manifest, layout))

        comm.agree(read_and_set, f"reading {folder}", CheckpointError)
    return manifest, loaded


def readable_folder(final: Path, report: bool = True) -> Path:
    """The folder to load for a checkpoint saved as `final`: `final`, or where an interrupted save left the
    newest complete one (the one the next save puts in place)."""
    found = newest_complete(final)
    if found is None or found == final:
        return final
    if report:
        logger.warning(f"{final}: a save was interrupted; loading the newest complete checkpoint, {found} (the next "
                       f"save to {final} puts it in place first)")
    return found


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON side file (config.json, adapter_config.json), as the object it must hold."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); the checkpoint is damaged") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object; it holds a {type(value).__name__}")
    return value


def read_manifest(folder: Path) -> tuple[dict[str, Any], dict[str, list[tuple[int, int, str]]]]:
    """The manifest of the checkpoint in `folder`, checked whole (`_check_manifest`), and its pieces by parameter
    (`index_pieces`): anything a crafted or damaged one holds is one CheckpointError naming the file, never a
    traceback from deeper in."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint manifest here")
    inside(folder, MANIFEST)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an {FORMAT} v{VERSION} manifest")
    try:
        return manifest, _check_manifest(manifest)
    except KeyError as e:
        raise CheckpointError(f"{path} is damaged: an entry {e} is missing") from None
    except (ValueError, TypeError, AttributeError, CheckpointError) as e:
        raise CheckpointError(f"{path} is damaged: {e}") from None


# What a shard file is called (`_write_shard`): a plain name, so the files a manifest names stay in its folder.
SHARD_NAME = re.compile(r"rank\d{5}-of-\d{5}\.safetensors")


def _check_manifest(manifest: dict[str, Any]) -> dict[str, list[tuple[int, int, str]]]:
    """Raises ValueError naming the first entry that is missing, of the wrong type or out of range. Numbers
    must be finite (JSON lets NaN through), and the saved pieces must tile each parameter exactly once:
    returns them by parameter (`index_pieces`)."""
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    def count(value: Any) -> bool:
        return type(value) is int and value >= 0

    def all_finite(value: Any) -> bool:  # the numbers in hyper-parameters, however nested (betas)
        if isinstance(value, (list, tuple)):
            return all(map(all_finite, value))
        return type(value) not in (int, float) or finite_number(value)

    for key in ("zero_stage", "world_size", "global_steps", "micro_steps", "skipped_steps"):
        expect(count(manifest[key]), f"{key} must be a count; got {manifest[key]!r}")
    expect(manifest["dtype"] in DTYPES, f"dtype must be one of {', '.join(DTYPES)}; got {manifest['dtype']!r}")
    scaler = manifest["loss_scaler"]
    expect(isinstance(scaler, dict) and finite_number(scaler["scale"]) and scaler["scale"] > 0
           and count(scaler["clean_steps"]),
           f"loss_scaler must hold a positive finite scale and a count of clean steps; got {scaler!r}")
    parameters = manifest["parameters"]
    expect(isinstance(parameters, dict), "parameters must be an object")
    optimizer = manifest["optimizer"]
    groups = optimizer["param_groups"]
    expect(isinstance(optimizer["class"], str), "optimizer.class must be a name")
    expect(isinstance(groups, list) and all(isinstance(g, dict) and all(map(all_finite, g.values())) for g in groups),
           "optimizer.param_groups must be a list of objects with finite numbers")
    # A group's parameters are the engine's (its masters), never the checkpoint's: torch's load_state_dict would
    # refuse a list of another length only after the masters were set.
    expect(all("params" not in g for g in groups), "optimizer.param_groups must not list params (the engine's "
                                                   "parameters are matched by name, under parameters)")
    scalars = optimizer["scalars"]
    expect(isinstance(scalars, list) and len(scalars) == len(groups) and all(
        isinstance(g, dict) and all(finite_number(v) for v in g.values()) for g in scalars),
        "optimizer.scalars must hold finite numbers, one object per param group")
    for where, entries in (("param_groups", groups), ("scalars", scalars)):
        for g, entry in enumerate(entries):
            for key, value in entry.items():
                problem = hyper_parameter_problem(key, value)
                expect(problem is None, f"optimizer.{where}[{g}].{key} {problem}; got {value!r}")
    expect(isinstance(optimizer["elementwise"], list) and all(isinstance(k, str) and "/" not in k
                                                              for k in optimizer["elementwise"]),
           "optimizer.elementwise must be a list of state names")
    for name, entry in parameters.items():
        expect(isinstance(entry["shape"], list) and all(map(count, entry["shape"])),
               f"parameter {name!r} has shape {entry['shape']!r}")
        expect(count(entry["group"]) and entry["group"] < len(groups),
               f"parameter {name!r} is in param group {entry['group']!r}, of {len(groups)}")
    tp = manifest.get("tensor_parallel", {"size": 1, "split": {}})  # absent before tensor parallelism
    expect(count(tp["size"]) and tp["size"] >= 1 and isinstance(tp["split"], dict) and all(
        isinstance(split["shape"], list) and all(map(count, split["shape"])) and count(split["dim"])
        and split["dim"] < len(split["shape"]) and count(split["split_factor"]) and split["split_factor"] >= 1
        for split in tp["split"].values()), "tensor_parallel must give a size and, per split parameter, its shape, "
                                            "dimension and split_factor")
    module_state = manifest["module_state"]
    expect(isinstance(module_state, list) and all(isinstance(n, str) for n in module_state),
           "module_state must be a list of names")
    frozen = manifest.get("frozen", {})  # absent before frozen weights were stored apart
    expect(isinstance(frozen, dict) and all(
        isinstance(entry["shape"], list) and all(map(count, entry["shape"]))
        and entry["dtype"] in ("F64", "F32", "F16", "BF16") and name not in parameters
        for name, entry in frozen.items()), "frozen must give each frozen weight's shape and dtype")
    if "frozen_source" in manifest:  # absent where the frozen weights are stored
        frozen_source.check_entry(manifest["frozen_source"], frozen)
    for entry in manifest["weights"]:
        expect(isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry),
               f"weights entries must be [name, stored key]; got {entry!r}")
        kind, _, stored = entry[1].partition("/")
        expect((kind == "master" and (stored in parameters or stored in tp["split"]))
               or (kind == "module" and stored in module_state) or (kind == "frozen" and stored in frozen),
               f"weight {entry[0]!r} is stored as unknown {entry[1]!r}")
    shards = manifest["shards"]
    expect(isinstance(shards, list) and shards, "shards must list the checkpoint's files")
    for shard in shards:
        expect(isinstance(shard["file"], str) and SHARD_NAME.fullmatch(shard["file"]) is not None,
               f"shard file {shard['file']!r} is not a file name of this folder (rankNNNNN-of-NNNNN.safetensors)")
        expect(count(shard["bytes"]), f"{shard['file']}: bytes must be a count")
        expect(isinstance(shard["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", shard["sha256"]) is not None,
               f"{shard['file']}: sha256 must be 64 hex digits")
        for pieces, table in ((shard["pieces"], parameters), (shard.get("frozen_pieces", []), frozen)):
            for piece in pieces:
                expect(isinstance(piece, list) and len(piece) == 3 and piece[0] in table and count(piece[1])
                       and count(piece[2]), f"{shard['file']}: piece {piece!r} is not [parameter, first, end]")
    expect(any(s["file"].startswith("rank00000-") for s in shards), "no shard of rank 0, which holds the module state")
    return index_pieces(manifest)


# What the hyper-parameters and counters of torch's optimizers may be, by name: a loaded learning rate of -1 trains
# backwards, "0.1" fails at the next step, a step of -3 makes Adam's bias correction complex. Other names are
# checked finite only (`_check_manifest`).
_AT_LEAST_ZERO = {"lr", "initial_lr", "max_lr", "min_lr", "weight_decay", "eps", "momentum", "lr_decay",
                  "initial_accumulator_value", "alpha", "lambd", "t0", "max_eval", "tolerance_grad",
                  "tolerance_change", "history_size"}
# Flags that choose another update or other states: a checkpoint may not change them. The kernel flags choose only
# which of torch's implementations runs, and stay this run's (a GPU run's fused=True resumes on a CPU).
_UPDATE_FLAGS = {"amsgrad", "nesterov", "maximize", "capturable", "differentiable", "centered", "decoupled_weight_decay"}
_KERNEL_FLAGS = {"foreach", "fused"}
_FLAGS = _UPDATE_FLAGS | _KERNEL_FLAGS
_COUNTS = {"step"}


def finite_number(value: Any) -> bool:
    """A JSON number a float holds: not NaN or infinite, and no integer beyond a float's range (10**400, which
    math.isfinite cannot even take)."""
    if type(value) is int:
        return abs(value) <= sys.float_info.max
    return type(value) is float and math.isfinite(value)


def hyper_parameter_problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` as hyper-parameter or counter `key` of a checkpoint's optimizer, or None."""
    if key in _AT_LEAST_ZERO and not (finite_number(value) and value >= 0):
        return "must be a finite number of at least 0"
    if key in _COUNTS and not (finite_number(value) and value >= 0 and float(value).is_integer()):
        return "must be a whole number of at least 0 (a count)"
    if key == "dampening" and not (finite_number(value) and 0 <= value <= 1):
        return "must be a number from 0 to 1"
    if key == "betas" and not (isinstance(value, list) and len(value) == 2
                               and all(finite_number(b) and 0 <= b < 1 for b in value)):
        return "must be two numbers, each at least 0 and below 1"
    if key in _FLAGS and value is not None and type(value) is not bool:
        return "must be true, false or null"
    return None


def inside(folder: Path, name: str) -> Path:
    """folder / name, refused when a link takes it out of `folder` (a checkpoint received from elsewhere must
    not make us read, or copy into an upload, a file of this machine's)."""
    path = folder / name
    if path.is_symlink() and folder.resolve() not in path.resolve().parents:
        raise CheckpointError(f"{path} is a link to {path.resolve()}, outside the checkpoint folder; refusing to "
                              f"read it")
    return path


@contextlib.contextmanager
def open_shard(folder: Path, file: str) -> Iterator[Any]:
    """safe_open of a shard file, whose damaged or crafted header is a CheckpointError naming it."""
    path = inside(folder, file)
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    with handle:
        yield handle


def _check_tensor_parallel_size(layout: ShardLayout, manifest: dict[str, Any], folder: Path) -> None:
    saved, mine = tp_size(manifest), layout.tensor_parallel["size"]
    if saved != mine:
        raise CheckpointError(f"{folder / MANIFEST} was saved with tensor_parallel_size {saved} and this engine runs "
                              f"{mine}: load it with tensor_parallel_size {saved} (any data-parallel size and stage), "
                              f"or consolidate it (hf-zero consolidate) and start from those weights")


def _check_model(layout: ShardLayout, backend: "UpdateBackend", manifest: dict[str, Any], folder: Path) -> None:
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
        for flag in sorted(_UPDATE_FLAGS & saved.keys()):
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


def _read_frozen(files: dict[str, Any], sources: dict[str, Any], index: dict, manifest: dict[str, Any],
                 piece: FrozenPiece, mode: str) -> None:
    """The elements a frozen piece views, from the checkpoint: "fill" copies them in, "check" checks they are there,
    "compare" that they are the values the piece holds (the base a resumed adapter was trained on). A checkpoint
    saved before frozen weights were stored apart holds them whole in its module state; one that records them by
    their source reads them from its files (`sources`, opened)."""
    entry = manifest.get("frozen", {}).get(piece.name)
    if "frozen_source" in manifest:
        stored = frozen_source.read(sources, manifest["frozen_source"], manifest["frozen"], piece.name, piece.lo,
                                    None if mode == "check" else piece.hi)
    elif entry is None:
        if mode == "check":
            return
        stored = files[module_state_file(manifest)].get_tensor(f"module/{piece.name}").reshape(-1)[piece.lo:piece.hi]
    else:
        stored = None if mode == "check" else torch.empty(piece.hi - piece.lo, dtype=TORCH_DTYPES[entry["dtype"]])
        read_range(files, index, "frozen", piece.name, piece.lo, piece.hi, stored, entry["dtype"])
    if mode == "fill":
        piece.values.copy_(stored)
    elif mode == "compare" and not torch.equal(stored, piece.values.reshape(-1).to(stored.dtype)):
        differs = (stored.double() - piece.values.reshape(-1).double()).abs().max().item()
        raise CheckpointError(f"the frozen weight {piece.name} differs from the checkpoint's (by up to {differs:.3g}): "
                              f"the adapter was trained on another base model. Resume with the base it was trained "
                              f"on, or start a new run instead of resuming")


def check_files(shards: list[dict[str, Any]], folder: Path) -> None:
    for shard in shards:
        path = inside(folder, shard["file"])
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
        if path.stat().st_size != shard["bytes"]:
            raise CheckpointError(f"{path} is {path.stat().st_size} bytes, the manifest says {shard['bytes']}: "
                                  f"the file is truncated or was replaced")
        if sha256(path) != shard["sha256"]:
            raise CheckpointError(f"{path} does not match its SHA-256 in the manifest: the file is corrupted")


def stored_entry(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """The shape (and group, or dtype) of a parameter or frozen weight stored in pieces."""
    return manifest["parameters"].get(name) or manifest.get("frozen", {})[name]


def index_pieces(manifest: dict[str, Any]) -> dict[str, list[tuple[int, int, str]]]:
    """name -> the saved pieces (lo, hi, file) covering it, which must tile it: every element exactly once. The
    names are the parameters' and the stored frozen weights' (not those recorded by their source)."""
    stored_frozen = [] if "frozen_source" in manifest else list(manifest.get("frozen", {}))
    index: dict[str, list[tuple[int, int, str]]] = {name: [] for name in [*manifest["parameters"], *stored_frozen]}
    for shard in manifest["shards"]:
        for name, lo, hi in shard["pieces"] + shard.get("frozen_pieces", []):
            index[name].append((lo, hi, shard["file"]))
    for name, pieces in index.items():
        numel = math.prod(stored_entry(manifest, name)["shape"])
        pieces.sort()
        ends = [0] + [hi for _, hi, _ in pieces]
        if any(lo != end or hi <= lo for (lo, hi, _), end in zip(pieces, ends)) or ends[-1] != numel:
            held = ", ".join(f"[{lo}, {hi}) in {file}" for lo, hi, file in pieces[:6])
            raise CheckpointError(f"the checkpoint's shards do not hold each of the {numel} elements of {name!r} "
                                  f"exactly once: {held or 'none'}")
    return index


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


def _load_optimizer(optimizer: torch.optim.Optimizer, manifest: dict[str, Any], state: dict[int, dict]) -> None:
    """Through the optimizer's own load_state_dict, which casts and places the state as it expects. The
    checkpoint's hyper-parameters win, as they do in torch's load_state_dict; where they differ from the
    optimizer's, a warning says so."""
    current = optimizer.state_dict()
    for g, (group, saved) in enumerate(zip(current["param_groups"], manifest["optimizer"]["param_groups"])):
        _warn_of_replaced_hyper_parameters(g, group, saved)
        kernels = {flag: group[flag] for flag in _KERNEL_FLAGS & group.keys()}
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


def module_state_file(manifest: dict[str, Any]) -> str:
    """The shard that holds the replicated module state (rank 0's; `_check_manifest` made sure there is one)."""
    return next(s["file"] for s in manifest["shards"] if s["file"].startswith("rank00000-"))


def _read_module_state(files: dict[str, Any], manifest: dict[str, Any],
                       layout: ShardLayout) -> dict[str, torch.Tensor]:
    names = [name for name in manifest["module_state"] if name in layout.module_state]  # not frozen weights
    if not names:
        return {}
    writer = files[module_state_file(manifest)]
    return {name: writer.get_tensor(f"module/{name}") for name in names}
