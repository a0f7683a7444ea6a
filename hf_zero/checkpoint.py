"""Sharded engine checkpoints: each rank writes its own partition; any world size and stage can load them.

A checkpoint folder holds one safetensors file per writing rank and one `manifest.json`. Tensors are
addressed by parameter name and element offset (`exp_avg/transformer.h.0.attn.c_attn.weight/4096`),
never by flat-buffer position, so a loader with another world size, bucket size or stage finds the
elements it now owns by name and reads only those slices (safetensors reads slices without loading
the file). No rank ever holds more than its own partition.

Saving is all-or-nothing: files go to `<dir>.partial`, every rank reports success or its error, and
only then does rank 0 rename the folder into place. A failure on any rank becomes the same error on
every rank (no rank is left waiting in a collective) and the previous checkpoint stays loadable.
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
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_zero.export import weights_to_save
from hf_zero.tensor_parallel import split_of
from hf_zero.zero.partition import ParamSlice, Piece, is_tp_replicated, local

if TYPE_CHECKING:
    from hf_zero.engine import ZeroEngine

FORMAT, VERSION = "hf_zero.checkpoint", 1
MANIFEST = "manifest.json"
# Where a ZeroTrainer checkpoint-N folder keeps the engine checkpoint, beside the config and tokenizer.
TRAINER_SUBFOLDER = "zero_checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what is wrong."""


def chunk_pieces(engine: "ZeroEngine") -> list[list[list[Piece]]]:
    """pieces[g][k]: the parameter pieces inside chunk k of param group g that this rank owns."""
    return [[flat.pieces_between(lo, hi) for flat, lo, hi in ranges] for ranges in engine.owned_chunk_ranges()]


def tp_part_name(name: str, tp_rank: int) -> str:
    return f"{name}@tp{tp_rank}"


def stored_name(engine: "ZeroEngine", s: ParamSlice) -> str:
    """The name a parameter's elements are stored under: its own, or for a parameter split across the
    tp group, its name and this rank's tp rank."""
    if engine.tp_comm is None or is_tp_replicated(s.param):
        return s.name
    return tp_part_name(s.name, engine.tp_comm.rank)


def writes_piece(engine: "ZeroEngine", piece: Piece) -> bool:
    """Whether this rank stores `piece`: a piece every tp rank holds is stored by tp rank 0 alone."""
    return engine.tp_comm is None or engine.tp_comm.rank == 0 or not is_tp_replicated(piece.slice.param)


def parameter_layout(engine: "ZeroEngine") -> dict[str, dict[str, Any]]:
    """Each stored tensor's shape and optimizer param group: what a checkpoint must match. With tensor
    parallelism it holds every tp rank's parts, gathered over the tp group (every rank must call it)."""
    mine = {stored_name(engine, s): {"shape": list(s.shape), "group": g}
            for g, flats in enumerate(engine.managed_flats()) for flat in flats for s in flat.slices}
    if engine.tp_comm is None:
        return mine
    return {name: entry for part in engine.tp_comm.all_gather_object(mine) for name, entry in part.items()}


def tensor_parallel_layout(engine: "ZeroEngine") -> dict[str, Any]:
    """The tp size, and for each parameter split across the tp group, its whole shape and split."""
    if engine.tp_comm is None:
        return {"size": 1, "split": {}}
    return {"size": engine.tp_comm.world_size,
            "split": {s.name: split_of(s.param) for flats in engine.managed_flats() for flat in flats
                      for s in flat.slices if not is_tp_replicated(s.param)}}


def tp_size(manifest: dict[str, Any]) -> int:
    return manifest.get("tensor_parallel", {"size": 1})["size"]


def tp_split(manifest: dict[str, Any], name: str) -> dict[str, Any] | None:
    """How parameter `name` is split across the tp group (`split_of`), or None when it is stored whole."""
    return manifest.get("tensor_parallel", {"split": {}})["split"].get(name)


def whole_shape(manifest: dict[str, Any], name: str) -> list[int]:
    """A parameter's shape as the model declares it (the whole of its tp parts)."""
    split = tp_split(manifest, name)
    return split["shape"] if split else manifest["parameters"][name]["shape"]


def saved_weights(engine: "ZeroEngine") -> list[list[str]]:
    """[name save_pretrained writes, key of the stored tensor] for every weight, in state_dict order:
    what `hf-zero consolidate` writes, with tied weights once, as save_pretrained does."""
    managed = engine.managed_slices
    return [[name, f"master/{managed[id(t)].name}" if id(t) in managed else f"module/{name}"]
            for name, t in weights_to_save(engine.module).items()]


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


def is_elementwise(value: Any, master: torch.Tensor) -> bool:
    """Optimizer state with one value per element (Adam's moments), as opposed to per-step scalars."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _agree(engine: "ZeroEngine", action: Callable[[], Any], what: str) -> list[Any]:
    """Runs `action` on every rank; if it failed anywhere, raises that rank's error on every rank."""
    try:
        result, error = action(), None
    except Exception as e:  # reported to every rank below, then raised
        result, error = None, f"{type(e).__name__}: {e}"
    outcomes = engine.world_comm.all_gather_object((result, error))
    failed = [(rank, err) for rank, (_, err) in enumerate(outcomes) if err is not None]
    if failed:
        rank, err = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {err}")
    return [res for res, _ in outcomes]


# ---- save ------------------------------------------------------------------------------------
def save(engine: "ZeroEngine", directory: str | os.PathLike, client_state: dict[str, Any] | None = None) -> Path:
    final = Path(directory)
    partial = final.with_name(final.name + ".partial")
    rank = engine.world_comm.rank
    _check_module_state_is_whole(engine)
    layout = parameter_layout(engine)

    def fresh_partial() -> None:
        # Rank 0 alone clears and creates it, and the others wait for that (_agree gathers): a rank
        # creating it while rank 0 removes an interrupted save's folder would lose its files or fail.
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save: never a checkpoint
            partial.mkdir(parents=True)

    try:
        _agree(engine, fresh_partial, f"creating {partial}")
        shards = _agree(engine, lambda: _write_shard(engine, partial), f"writing the shards under {partial}")
        _agree(engine, lambda: _commit(engine, partial, final, shards, layout, client_state) if rank == 0 else None,
               f"committing {final}")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def _check_module_state_is_whole(engine: "ZeroEngine") -> None:
    """Rank 0 stores the module state every rank holds; a frozen parameter split across the tp group
    (not stepped, so not in the engine's shards) has no stored form yet."""
    split = [name for name, t in engine.unmanaged_state().items() if not is_tp_replicated(t)]
    if split:
        raise CheckpointError(f"frozen tensor-parallel parameters cannot be checkpointed yet: {', '.join(split)}; "
                              f"train them (requires_grad=True) or leave their modules out of the tp plan")


def _write_shard(engine: "ZeroEngine", folder: Path) -> dict[str, Any] | None:
    """Writes this rank's partition; returns what the manifest says about the file."""
    writes = engine.zero_stage >= 1 or engine.comm.rank == 0  # stage 0: every rank holds the same state
    if not writes:
        return None
    opt = engine.sharded_optimizer
    tensors: dict[str, torch.Tensor] = {}
    listed = []
    scalars: list[dict[str, float]] = [{} for _ in opt.masters]
    elementwise: set[str] = set()
    for g, chunks in enumerate(chunk_pieces(engine)):
        for k, pieces in enumerate(chunks):
            master, state = opt.chunk_state(g, k)  # read from the files when the states live on NVMe
            for key, value in state.items():
                if is_elementwise(value, master):
                    elementwise.add(key)
                else:
                    scalars[g][key] = float(value)
            for piece in [p for p in pieces if writes_piece(engine, p)]:
                name, lo, hi, at = stored_name(engine, piece.slice), piece.param_lo, piece.param_hi, piece.range_lo
                listed.append([name, lo, hi])
                tensors[f"master/{name}/{lo}"] = master.detach()[at:at + hi - lo].float().clone()
                for key, value in state.items():
                    if is_elementwise(value, master):
                        tensors[f"{key}/{name}/{lo}"] = value[at:at + hi - lo].clone()
    if engine.world_comm.rank == 0:
        for name, tensor in engine.unmanaged_state().items():
            tensors[f"module/{name}"] = local(tensor.detach()).clone()
    file = folder / f"rank{engine.world_comm.rank:05d}-of-{engine.world_comm.world_size:05d}.safetensors"
    save_file(tensors, str(file))
    return {"file": file.name, "bytes": file.stat().st_size, "sha256": _sha256(file), "pieces": listed,
            "optimizer_state": {"scalars": scalars, "elementwise": sorted(elementwise)}}


def _commit(engine: "ZeroEngine", partial: Path, final: Path, shards: list, layout: dict[str, Any],
            client_state: Any) -> None:
    shards = [s for s in shards if s is not None]
    # Every rank saw the same per-group scalars (Adam's step); rank 0's shard always exists.
    optimizer_state = [s.pop("optimizer_state") for s in shards][0]
    manifest = {
        "format": FORMAT, "version": VERSION, "zero_stage": engine.zero_stage,
        "world_size": engine.world_comm.world_size, "dtype": engine.config.dtype,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps, "loss_scaler": engine.scaler.state_dict(),
        "parameters": layout, "tensor_parallel": tensor_parallel_layout(engine),
        "optimizer": _optimizer_manifest(engine, optimizer_state),
        "module_state": sorted(engine.unmanaged_state()),
        "weights": saved_weights(engine),
        "shards": shards,
        "client_state": client_state,
    }
    write_model_files(engine.module, partial)
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    # Swap the new folder in; the old one is removed only once the new one is in place.
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _optimizer_manifest(engine: "ZeroEngine", state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's hyper-parameters, per-step scalars (e.g. Adam's step) and elementwise state names."""
    opt = engine.sharded_optimizer.optimizer
    groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    return {"class": type(opt).__name__, "param_groups": groups, **state}


# ---- load ------------------------------------------------------------------------------------
def load(engine: "ZeroEngine", directory: str | os.PathLike) -> dict[str, Any] | None:
    folder = Path(directory)
    manifest = read_manifest(folder)
    _check_tensor_parallel_size(engine, manifest, folder)
    _check_model(engine, manifest, folder, parameter_layout(engine))
    # Each rank hashes its share of the files; any failure stops every rank before any state changes.
    shards, rank, world = manifest["shards"], engine.world_comm.rank, engine.world_comm.world_size
    _agree(engine, lambda: check_files(shards[rank::world], folder), f"checking {folder}")
    index = index_pieces(manifest)
    opt = engine.sharded_optimizer
    elementwise = manifest["optimizer"]["elementwise"]
    new_state: dict[int, dict[str, Any]] = {}
    position = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        files = {shard["file"]: stack.enter_context(safe_open(str(folder / shard["file"]), framework="pt"))
                 for shard in shards}
        for g, chunks in enumerate(chunk_pieces(engine)):
            for k, pieces in enumerate(chunks):
                master = opt.masters[g][k]
                values = {kind: torch.zeros(master.numel(), dtype=torch.float32) for kind in ["master", *elementwise]}
                for piece in pieces:
                    n = piece.param_hi - piece.param_lo
                    for kind, out in values.items():
                        read_range(files, index, kind, stored_name(engine, piece.slice), piece.param_lo, piece.param_hi,
                                    out[piece.range_lo:piece.range_lo + n])
                master = values.pop("master")
                state = {**manifest["optimizer"]["scalars"][g], **values} if values else {}
                opt.load_chunk(g, k, master, state)
                if state:
                    new_state[position] = state
                position += 1
        # States on NVMe went to their files in load_chunk; the optimizer still takes the hyper-parameters.
        _load_optimizer(opt.optimizer, manifest, {} if opt.nvme is not None else new_state)
        module_state = _read_module_state(files, manifest)
        engine.restore(module_state, manifest)
    return manifest["client_state"]


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        hint = ""
        if folder.with_name(folder.name + ".old").is_dir():
            hint = f"; an interrupted save left the previous checkpoint at {folder.name}.old"
        raise CheckpointError(f"{path}: no checkpoint manifest here{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an {FORMAT} v{VERSION} manifest")
    return manifest


def _check_tensor_parallel_size(engine: "ZeroEngine", manifest: dict[str, Any], folder: Path) -> None:
    saved, mine = tp_size(manifest), engine.tp_comm.world_size if engine.tp_comm else 1
    if saved != mine:
        raise CheckpointError(f"{folder / MANIFEST} was saved with tensor_parallel_size {saved} and this engine runs "
                              f"{mine}: load it with tensor_parallel_size {saved} (any data-parallel size and stage), "
                              f"or consolidate it (hf-zero consolidate) and start from those weights")


def _check_model(engine: "ZeroEngine", manifest: dict[str, Any], folder: Path, layout: dict[str, Any]) -> None:
    mine = {name: (p["shape"], p["group"]) for name, p in layout.items()}
    saved = {name: (p["shape"], p["group"]) for name, p in manifest["parameters"].items()}
    for name in sorted(set(mine) | set(saved)):
        if mine.get(name) != saved.get(name):
            raise CheckpointError(
                f"{folder / MANIFEST} is from another model or optimizer grouping: parameter {name!r} is "
                f"{_describe(saved.get(name))} in the checkpoint and {_describe(mine.get(name))} in this engine")
    if manifest["optimizer"]["class"] != type(engine.sharded_optimizer.optimizer).__name__:
        raise CheckpointError(f"{folder / MANIFEST} holds {manifest['optimizer']['class']} state; this engine "
                              f"steps {type(engine.sharded_optimizer.optimizer).__name__}")


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
        if _sha256(path) != shard["sha256"]:
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
    """Through the optimizer's own load_state_dict, which casts and places the state as it expects."""
    current = optimizer.state_dict()
    for group, saved in zip(current["param_groups"], manifest["optimizer"]["param_groups"]):
        group.update(saved)
    for entry in state.values():
        for key, value in entry.items():
            if not torch.is_tensor(value):
                entry[key] = torch.tensor(value, dtype=torch.float32)
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def module_state_file(manifest: dict[str, Any]) -> str:
    """The shard that holds the replicated module state (rank 0's)."""
    return next(s["file"] for s in manifest["shards"] if s["file"].startswith("rank00000-"))


def _read_module_state(files: dict[str, Any], manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    if not manifest["module_state"]:
        return {}
    writer = files[module_state_file(manifest)]
    return {name: writer.get_tensor(f"module/{name}") for name in manifest["module_state"]}
