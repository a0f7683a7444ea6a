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
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hf_zero.comm import Communicator
from hf_zero.device import LatestCopy, to_host
from hf_zero.export import weights_to_save
from hf_zero.tensor_parallel import split_of
from hf_zero.zero.partition import FlatParamBuffer, ParamSlice, copy_cut_into, is_tp_replicated, local
from hf_zero.zero.update import is_elementwise

if TYPE_CHECKING:
    from hf_zero.zero.update import UpdateBackend

logger = logging.getLogger("hf_zero")
FORMAT, VERSION = "hf_zero.checkpoint", 1
MANIFEST = "manifest.json"
# Where a ZeroTrainer checkpoint-N folder keeps the engine checkpoint, beside the config and tokenizer.
TRAINER_SUBFOLDER = "zero_checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class StoredPiece:
    """The part of one parameter inside one of this rank's chunks, under the name it is stored by."""

    name: str       # the parameter's name, or for a part split across the tp group, `<name>@tp<r>`
    param_lo: int   # first element of the piece within the (local part of the) parameter
    param_hi: int
    chunk_lo: int   # where the piece starts within the chunk
    written: bool   # whether this rank stores it (a piece every tp rank holds is stored by tp rank 0 alone)


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
    module_state: dict[str, torch.Tensor]      # frozen parameters and buffers, replicated on every rank


def tp_part_name(name: str, tp_rank: int) -> str:
    return f"{name}@tp{tp_rank}"


def describe_layout(module: nn.Module, flats_by_group: list[list[FlatParamBuffer]],
                    owned_ranges: list[list[tuple[FlatParamBuffer, int, int]]], zero_stage: int, dtype: str,
                    rank: int, tp_comm: Communicator | None) -> ShardLayout:
    """The layout of an engine's partition. With tensor parallelism every rank must call it (the parameter
    table holds every tp rank's parts, gathered over the tp group)."""
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
    managed = {id(s.param): s for _, s in slices}
    weights = [[name, f"master/{managed[id(t)].name}" if id(t) in managed else f"module/{name}"]
               for name, t in weights_to_save(module).items()]
    module_state = {name: t for name, t in module.state_dict(keep_vars=True).items() if id(t) not in managed}
    return ShardLayout(zero_stage, dtype, [[hi - lo for _, lo, hi in chunks] for chunks in owned_ranges], pieces,
                       zero_stage >= 1 or rank == 0, parameters, tensor_parallel, weights, module_state)


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
    into a folder from_pretrained can load without the training script."""
    config = getattr(module, "config", None)
    if not hasattr(config, "save_pretrained"):
        return
    config.architectures = [type(module).__name__]  # as save_pretrained records it
    config.save_pretrained(folder)
    if getattr(module, "can_generate", lambda: False)() and getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(folder)


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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- save ------------------------------------------------------------------------------------
# A checkpoint folder is complete when its manifest is there: the manifest is written last, through a
# temporary file and a rename. A save writes `<dir>.partial`, then moves `<dir>` to `<dir>.old`, the
# partial folder to `<dir>`, and removes `<dir>.old`. A crash between any two of these leaves at least
# one complete folder; `settle` finishes the interrupted save (it was complete) or drops its partial
# folder (it was not), and loading reads the same folder settling would keep.
def save_folders(final: Path) -> tuple[Path, Path]:
    """Where a save of `final` writes its files, and where it moves the previous checkpoint meanwhile."""
    return final.with_name(final.name + ".partial"), final.with_name(final.name + ".old")


def is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def newest_complete(final: Path) -> Path | None:
    """The folder holding the newest complete checkpoint saved as `final`, whatever point an interrupted
    save stopped at: a complete `.partial` is newer than `final`, which is newer than `.old`."""
    partial, old = save_folders(final)
    return next((f for f in (partial, final, old) if is_complete(f)), None)


def settle(final: Path) -> None:
    """Leaves `final` the newest complete checkpoint and nothing beside it, finishing or undoing an
    interrupted save. Each move is one a save makes, in the same order, so a crash in here is one too."""
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
    shutil.rmtree(folder, ignore_errors=True)


def save(directory: str | os.PathLike, layout: ShardLayout, backend: "UpdateBackend", comm: Communicator,
         module: nn.Module, training_state: dict[str, Any], client_state: Any = None) -> Path:
    """Every rank of `comm` (all ranks holding part of the model's state) writes its partition, rank 0 the
    manifest; `training_state` (step counters, loss scale) goes into the manifest as it is."""
    final = Path(directory)
    partial, _ = save_folders(final)
    layout = _with_whole_module_state(layout)

    def fresh_partial() -> None:
        # Rank 0 alone settles and creates it, and the others wait for that (agree gathers): a rank
        # creating it while rank 0 removes an interrupted save's folder would lose its files or fail.
        if comm.rank == 0:
            settle(final)
            partial.mkdir(parents=True)

    def commit(shards: list[dict[str, Any] | None]) -> None:
        if comm.rank == 0:
            write_model_files(module, partial)
            manifest = _manifest(layout, backend, comm, training_state, shards, client_state)
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
        if comm.rank == 0 and not is_complete(partial):
            _remove(partial)
        raise
    return final


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
    # Every piece goes to the file from host memory: a piece on the device is queued into a host buffer of
    # its own (pinned, non-blocking), and one wait covers them all. A clone on the device would hold about
    # 12 bytes per parameter / Nd of extra device memory for the duration of the save.
    tensors: dict[str, torch.Tensor] = {}
    copies, starts = LatestCopy(), set()

    def on_host(key: str, value: torch.Tensor) -> None:
        host, copy = to_host(value, f"checkpoint piece {key}")
        if host.numel() and host.data_ptr() in starts:
            host = host.clone()  # a tied tensor already in host memory: the file stores each name apart
        starts.add(host.data_ptr())
        tensors[key] = host
        copies.add(copy)

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
    if comm.rank == 0:
        for name, tensor in layout.module_state.items():
            on_host(f"module/{name}", local(tensor.detach()).contiguous())
    copies.wait()
    file = folder / f"rank{comm.rank:05d}-of-{comm.world_size:05d}.safetensors"
    save_file(tensors, str(file))
    file.chmod(0o666 & ~_umask())  # safetensors creates it 0600; other accounts read it like the manifest
    return {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256(file), "pieces": listed,
            "optimizer_state": {"scalars": scalars, "elementwise": sorted(elementwise)}}


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
        "module_state": sorted(layout.module_state), "weights": layout.weights, "shards": written,
        "client_state": client_state,
    }


# ---- load ------------------------------------------------------------------------------------
def load(directory: str | os.PathLike, layout: ShardLayout, backend: "UpdateBackend",
         comm: Communicator) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Sets the backend's masters and optimizer state from a checkpoint saved at any data-parallel size and
    stage; returns the manifest (training state, client_state) and the module state for the caller to restore.
    Nothing changes unless every rank's checks passed."""
    folder = readable_folder(Path(directory), comm.rank == 0)
    manifest = read_manifest(folder)
    _check_tensor_parallel_size(layout, manifest, folder)
    _check_model(layout, backend, manifest, folder)
    # Each rank hashes its share of the files; any failure stops every rank before any state changes.
    shards = manifest["shards"]
    comm.agree(lambda: check_files(shards[comm.rank::comm.world_size], folder), f"checking {folder}",
               CheckpointError)
    index = index_pieces(manifest)
    elementwise = manifest["optimizer"]["elementwise"]
    new_state: dict[int, dict[str, Any]] = {}
    position = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = {shard["file"]: stack.enter_context(safe_open(str(folder / shard["file"]), framework="pt"))
                 for shard in shards}
        for g, chunks in enumerate(layout.pieces):
            for k, pieces in enumerate(chunks):
                values = {kind: torch.zeros(layout.chunk_numels[g][k], dtype=torch.float32)
                          for kind in ["master", *elementwise]}
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
        module_state = _read_module_state(files, manifest)
    return manifest, module_state


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


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint manifest here")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an {FORMAT} v{VERSION} manifest")
    return manifest


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


def _describe(entry: tuple[list[int], int] | None) -> str:
    return "absent" if entry is None else f"shape {entry[0]} in param group {entry[1]}"


def check_files(shards: list[dict[str, Any]], folder: Path) -> None:
    for shard in shards:
        path = folder / shard["file"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing; the checkpoint is incomplete")
        if path.stat().st_size != shard["bytes"]:
            raise CheckpointError(f"{path} is {path.stat().st_size} bytes, the manifest says {shard['bytes']}: "
                                  f"the file is truncated or was replaced")
        if sha256(path) != shard["sha256"]:
            raise CheckpointError(f"{path} does not match its SHA-256 in the manifest: the file is corrupted")


def index_pieces(manifest: dict[str, Any]) -> dict[str, list[tuple[int, int, str]]]:
    """name -> the saved pieces (lo, hi, file) covering it; refuses a checkpoint with a gap."""
    index: dict[str, list[tuple[int, int, str]]] = {name: [] for name in manifest["parameters"]}
    for shard in manifest["shards"]:
        for name, lo, hi in shard["pieces"]:
            index[name].append((lo, hi, shard["file"]))
    for name, pieces in index.items():
        numel = math.prod(manifest["parameters"][name]["shape"])
        covered = sum(hi - lo for lo, hi, _ in pieces)
        if covered != numel:
            raise CheckpointError(f"the checkpoint's shards hold {covered} of the {numel} elements of {name!r}")
        pieces.sort()
    return index


def read_range(files: dict[str, Any], index: dict, kind: str, name: str, lo: int, hi: int,
                out: torch.Tensor) -> None:
    """Fills `out` with elements [lo, hi) of `kind` for parameter `name`, reading only overlapping slices."""
    for a, b, file in index[name]:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            out[s - lo:e - lo].copy_(files[file].get_slice(f"{kind}/{name}/{a}")[s - a:e - a])


def _load_optimizer(optimizer: torch.optim.Optimizer, manifest: dict[str, Any], state: dict[int, dict]) -> None:
    """Through the optimizer's own load_state_dict, which casts and places the state as it expects. The
    checkpoint's hyper-parameters win, as they do in torch's load_state_dict; where they differ from the
    optimizer's, a warning says so."""
    current = optimizer.state_dict()
    for g, (group, saved) in enumerate(zip(current["param_groups"], manifest["optimizer"]["param_groups"])):
        _warn_of_replaced_hyper_parameters(g, group, saved)
        group.update(saved)
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
    """The shard that holds the replicated module state (rank 0's)."""
    return next(s["file"] for s in manifest["shards"] if s["file"].startswith("rank00000-"))


def _read_module_state(files: dict[str, Any], manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not manifest["module_state"]:
        return {}
    writer = files[module_state_file(manifest)]
    return {name: writer.get_tensor(f"module/{name}") for name in manifest["module_state"]}
