"""What a checkpoint's manifest.json holds: built by a save (`manifest_of`), checked whole by a load or a
consolidation before anything is read by it (`read_manifest`), and the questions asked of it later.

The manifest names each shard file with its size, SHA-256 and the pieces (parameter, first element, end) it stores;
the parameters' shapes and param groups; how tp parts make each split parameter whole; the optimizer's class, param
groups and per-group scalars; the module state's names; the frozen weights' shapes and dtypes (or, under
"frozen_source", where they are read from); and the training state (step counters, loss scale, client_state).
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_zero.checkpoint import frozen_source
from hf_zero.checkpoint.files import CheckpointError, inside
from hf_zero.settings.config import DTYPES

if TYPE_CHECKING:
    import torch

    from hf_zero.checkpoint.layout import ShardLayout

FORMAT, VERSION = "hf_zero.checkpoint", 1
MANIFEST = "manifest.json"
# What a shard file is called (`shard_file`): a plain name, so the files a manifest names stay in its folder.
SHARD_NAME = re.compile(r"rank\d{5}-of-\d{5}\.safetensors")


def shard_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def manifest_of(layout: ShardLayout, optimizer: torch.optim.Optimizer, world_size: int,
                training_state: dict[str, Any], shards: list[dict[str, Any] | None],
                client_state: Any) -> dict[str, Any]:
    """The manifest of a save whose ranks wrote `shards` (None: a rank that stores no states, at stage 0)."""
    written = [s for s in shards if s is not None]
    # Every rank saw the same per-group scalars (Adam's step); rank 0's shard always exists.
    optimizer_state = [s.pop("optimizer_state") for s in written][0]
    return {
        "format": FORMAT, "version": VERSION, "zero_stage": layout.zero_stage, "world_size": world_size,
        "dtype": layout.dtype, **training_state,
        "parameters": layout.parameters, "tensor_parallel": layout.tensor_parallel,
        "optimizer": {"class": type(optimizer).__name__, **optimizer_state,
                      "param_groups": [{k: v for k, v in group.items() if k != "params"}
                                       for group in optimizer.param_groups]},
        "module_state": sorted(layout.module_state), "frozen": layout.frozen, "weights": layout.weights,
        "shards": written,
        "client_state": client_state,
    }


# ---- questions asked of a checked manifest -------------------------------------------------------
def tp_size(manifest: dict[str, Any]) -> int:
    return manifest.get("tensor_parallel", {"size": 1})["size"]


def tp_split(manifest: dict[str, Any], name: str) -> dict[str, Any] | None:
    """How parameter `name` is split across the tp group (`split_of`), or None when it is stored whole."""
    return manifest.get("tensor_parallel", {"split": {}})["split"].get(name)


def whole_shape(manifest: dict[str, Any], name: str) -> list[int]:
    """A parameter's shape as the model declares it (the whole of its tp parts)."""
    split = tp_split(manifest, name)
    return split["shape"] if split else manifest["parameters"][name]["shape"]


def stored_entry(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """The shape (and group, or dtype) of a parameter or frozen weight stored in pieces."""
    return manifest["parameters"].get(name) or manifest.get("frozen", {})[name]


def module_state_file(manifest: dict[str, Any]) -> str:
    """The shard that holds the replicated module state (rank 0's; `read_manifest` made sure there is one)."""
    return next(s["file"] for s in manifest["shards"] if s["file"].startswith("rank00000-"))


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


# ---- reading and checking ------------------------------------------------------------------------
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


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _all_finite(value: Any) -> bool:
    """Whether the numbers in a hyper-parameter, however nested (betas), are finite."""
    if isinstance(value, (list, tuple)):
        return all(map(_all_finite, value))
    return type(value) not in (int, float) or finite_number(value)


def _check_manifest(manifest: dict[str, Any]) -> dict[str, list[tuple[int, int, str]]]:
    """Raises ValueError naming the first entry that is missing, of the wrong type or out of range. Numbers
    must be finite (JSON lets NaN through), and the saved pieces must tile each parameter exactly once:
    returns them by parameter (`index_pieces`)."""
    for key in ("zero_stage", "world_size", "global_steps", "micro_steps", "skipped_steps"):
        _expect(_count(manifest[key]), f"{key} must be a count; got {manifest[key]!r}")
    _expect(manifest["dtype"] in DTYPES, f"dtype must be one of {', '.join(DTYPES)}; got {manifest['dtype']!r}")
    scaler = manifest["loss_scaler"]
    _expect(isinstance(scaler, dict) and finite_number(scaler["scale"]) and scaler["scale"] > 0
            and _count(scaler["clean_steps"]),
            f"loss_scaler must hold a positive finite scale and a count of clean steps; got {scaler!r}")
    parameters = manifest["parameters"]
    _expect(isinstance(parameters, dict), "parameters must be an object")
    groups = _check_optimizer(manifest["optimizer"])
    for name, entry in parameters.items():
        _expect(isinstance(entry["shape"], list) and all(map(_count, entry["shape"])),
                f"parameter {name!r} has shape {entry['shape']!r}")
        _expect(_count(entry["group"]) and entry["group"] < len(groups),
                f"parameter {name!r} is in param group {entry['group']!r}, of {len(groups)}")
    tp = manifest.get("tensor_parallel", {"size": 1, "split": {}})  # absent before tensor parallelism
    _expect(_count(tp["size"]) and tp["size"] >= 1 and isinstance(tp["split"], dict) and all(
        isinstance(split["shape"], list) and all(map(_count, split["shape"])) and _count(split["dim"])
        and split["dim"] < len(split["shape"]) and _count(split["split_factor"]) and split["split_factor"] >= 1
        for split in tp["split"].values()), "tensor_parallel must give a size and, per split parameter, its shape, "
                                            "dimension and split_factor")
    module_state = manifest["module_state"]
    _expect(isinstance(module_state, list) and all(isinstance(n, str) for n in module_state),
            "module_state must be a list of names")
    frozen = manifest.get("frozen", {})  # absent before frozen weights were stored apart
    _expect(isinstance(frozen, dict) and all(
        isinstance(entry["shape"], list) and all(map(_count, entry["shape"]))
        and entry["dtype"] in ("F64", "F32", "F16", "BF16") and name not in parameters
        for name, entry in frozen.items()), "frozen must give each frozen weight's shape and dtype")
    if "frozen_source" in manifest:  # absent where the frozen weights are stored
        frozen_source.check_entry(manifest["frozen_source"], frozen)
    for entry in manifest["weights"]:
        _expect(isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry),
                f"weights entries must be [name, stored key]; got {entry!r}")
        kind, _, stored = entry[1].partition("/")
        _expect((kind == "master" and (stored in parameters or stored in tp["split"]))
                or (kind == "module" and stored in module_state) or (kind == "frozen" and stored in frozen),
                f"weight {entry[0]!r} is stored as unknown {entry[1]!r}")
    _check_shards(manifest["shards"], parameters, frozen)
    return index_pieces(manifest)


def _check_optimizer(optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifest's "optimizer" entry: its class, param groups and scalars; returns the param groups."""
    groups = optimizer["param_groups"]
    _expect(isinstance(optimizer["class"], str), "optimizer.class must be a name")
    _expect(isinstance(groups, list) and all(isinstance(g, dict) and all(map(_all_finite, g.values()))
                                             for g in groups),
            "optimizer.param_groups must be a list of objects with finite numbers")
    # A group's parameters are the engine's (its masters), never the checkpoint's: torch's load_state_dict would
    # refuse a list of another length only after the masters were set.
    _expect(all("params" not in g for g in groups), "optimizer.param_groups must not list params (the engine's "
                                                    "parameters are matched by name, under parameters)")
    scalars = optimizer["scalars"]
    _expect(isinstance(scalars, list) and len(scalars) == len(groups) and all(
        isinstance(g, dict) and all(finite_number(v) for v in g.values()) for g in scalars),
        "optimizer.scalars must hold finite numbers, one object per param group")
    for where, entries in (("param_groups", groups), ("scalars", scalars)):
        for g, entry in enumerate(entries):
            for key, value in entry.items():
                problem = hyper_parameter_problem(key, value)
                _expect(problem is None, f"optimizer.{where}[{g}].{key} {problem}; got {value!r}")
    _expect(isinstance(optimizer["elementwise"], list) and all(isinstance(k, str) and "/" not in k
                                                               for k in optimizer["elementwise"]),
            "optimizer.elementwise must be a list of state names")
    return groups


def _check_shards(shards: Any, parameters: dict[str, Any], frozen: dict[str, Any]) -> None:
    _expect(isinstance(shards, list) and shards, "shards must list the checkpoint's files")
    for shard in shards:
        _expect(isinstance(shard["file"], str) and SHARD_NAME.fullmatch(shard["file"]) is not None,
                f"shard file {shard['file']!r} is not a file name of this folder (rankNNNNN-of-NNNNN.safetensors)")
        _expect(_count(shard["bytes"]), f"{shard['file']}: bytes must be a count")
        _expect(isinstance(shard["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", shard["sha256"]) is not None,
                f"{shard['file']}: sha256 must be 64 hex digits")
        for pieces, table in ((shard["pieces"], parameters), (shard.get("frozen_pieces", []), frozen)):
            for piece in pieces:
                _expect(isinstance(piece, list) and len(piece) == 3 and piece[0] in table and _count(piece[1])
                        and _count(piece[2]), f"{shard['file']}: piece {piece!r} is not [parameter, first, end]")
    _expect(any(s["file"].startswith("rank00000-") for s in shards),
            "no shard of rank 0, which holds the module state")


# ---- the optimizer's hyper-parameters ------------------------------------------------------------
# What the hyper-parameters and counters of torch's optimizers may be, by name: a loaded learning rate of -1 trains
# backwards, "0.1" fails at the next step, a step of -3 makes Adam's bias correction complex. Other names are
# checked finite only (`_check_optimizer`).
_AT_LEAST_ZERO = {"lr", "initial_lr", "max_lr", "min_lr", "weight_decay", "eps", "momentum", "lr_decay",
                  "initial_accumulator_value", "alpha", "lambd", "t0", "max_eval", "tolerance_grad",
                  "tolerance_change", "history_size"}
# Flags that choose another update or other states: a checkpoint may not change them. The kernel flags choose only
# which of torch's implementations runs, and stay this run's (a GPU run's fused=True resumes on a CPU).
UPDATE_FLAGS = {"amsgrad", "nesterov", "maximize", "capturable", "differentiable", "centered", "decoupled_weight_decay"}
KERNEL_FLAGS = {"foreach", "fused"}
_FLAGS = UPDATE_FLAGS | KERNEL_FLAGS
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
