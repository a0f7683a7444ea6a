"""Frozen weights recorded by where they came from instead of stored: a LoRA checkpoint holds what training changes.

A frozen base (a peft model's, or any weight with requires_grad False) is most of a model that fine-tunes an adapter,
and training never changes it. When every frozen weight is, bit for bit in the dtype the engine holds it, a tensor of
the safetensors files the model was loaded from (`config.name_or_path`: a local folder, or a Hub id whose files are
in the Hub cache), a checkpoint records that folder (or the Hub id and the commit of its cached snapshot), each
file's size and SHA-256 and which tensor each frozen weight is (the manifest's "frozen_source"), and stores none of
them (`checkpoint_frozen_weights` "by_source", the default; DeepSpeed's `exclude_frozen_parameters`, which leaves
the base to the script). Loading checks the files are still the recorded ones, refusing naming the one that
changed, and re-reads each rank's pieces from them, at any world size and stage. A Hub base's files are read from
the Hub cache at the recorded commit, and downloaded there by huggingface_hub where the cache lacks them (a resume
on another machine), unless HF_HUB_OFFLINE says not to.

A base with no such source is stored as before, with a log line saying why: built from a config, loaded from a Hub
cache other than huggingface_hub's (`cache_dir`) or from a revision other than the cached default branch's, or
changed in memory since it was loaded. The comparison with the files is made once per engine (each rank compares
the pieces it would store), and again only when a file's size or modification time changes, a frozen weight was
changed in place (torch's version counter of the parameter moved: `wpe.weight.add_(1.0)`; a write through `.data`,
which has a counter of its own, is not seen), or a checkpoint was loaded into the engine. A weight changed after a
save is thus stored by the next one, and the log says so once.

A manifest's entry is checked as the files are: loading and `hf-zero consolidate` refuse an entry that reads a
frozen weight from another tensor than the one the model's own loading names (`check_keys`), which files and shapes
alone would let through where two weights have one shape.

What a manifest names stays inside what it names: a source file is a plain `*.safetensors` name in the recorded
folder, never a path, and a Hub id is a valid repository id with a commit of 40 hex digits (never a path in the
cache).
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hf_zero.checkpoint.files import CheckpointError, check_files, open_safetensors, sha256
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.dtypes import TORCH_DTYPES

logger = logging.getLogger("hf_zero")
SOURCE_FILE = re.compile(r"[^/\\]+\.safetensors")


def base_source(module: nn.Module) -> tuple[Path, dict[str, str]] | None:
    """Where the model (a peft model's base) was loaded from with from_pretrained, or None: the local folder and {},
    or the Hub cache's snapshot of its Hub id and {"name_or_path": id, "revision": commit}. transformers keeps no
    commit, so it is the one the cache's default branch points to, as an offline load resolves it; the frozen weights
    are compared with its files before anything is recorded."""
    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    name = getattr(getattr(base, "config", None), "name_or_path", "") or ""
    if not name:
        return None
    if Path(name).is_dir():
        return Path(name).resolve(), {}
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError

    for weights in ("model.safetensors.index.json", "model.safetensors"):
        try:
            cached = try_to_load_from_cache(name, weights)
        except (HFValidationError, ValueError):
            return None
        if isinstance(cached, str):
            snapshot = Path(cached).parent
            return snapshot, {"name_or_path": name, "revision": snapshot.name}
    return None


def source_folder(entry: dict[str, Any], records: list[dict[str, Any]] | None = None) -> Path:
    """The folder a manifest's "frozen_source" entry reads from. For a Hub base, the cache's snapshot at the recorded
    commit, with `records` (default: every file) downloaded into it first where missing; CheckpointError if one
    cannot be."""
    if "revision" not in entry:
        return Path(entry["name_or_path"])
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.file_download import repo_folder_name

    repo, revision = entry["name_or_path"], entry["revision"]
    for record in entry["files"] if records is None else records:
        try:
            hf_hub_download(repo, record["file"], revision=revision)  # where the cache has it: no network
        except Exception as e:  # huggingface_hub's errors (offline, not found, no network) have no common base
            raise CheckpointError(
                f"{record['file']} of the Hub model {repo} at commit {revision} is not in the Hub cache and could not "
                f"be downloaded ({type(e).__name__}: {e}): the checkpoint does not store its frozen weights and reads "
                f"them from the base model it was trained on. Download it (`hf download {repo} --revision "
                f"{revision}`) where the network is reachable") from None
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / revision


def read_flat(handle: Any, key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of tensor `key` flattened, reading only the rows that hold them."""
    stored = handle.get_slice(key)
    shape = stored.get_shape()
    if not shape:
        return handle.get_tensor(key).reshape(1)[lo:hi]
    row = math.prod(shape[1:])
    first, last = lo // row, -(-hi // row)
    return stored[first:last].reshape(-1)[lo - first * row:hi - first * row]


def _file_stats(folder: Path, files: list[str]) -> list[tuple[str, int, int]]:
    stats = [(folder / file).stat() for file in files]
    return [(file, stat.st_size, stat.st_mtime_ns) for file, stat in zip(files, stats)]


class FrozenSources:
    """An engine's record of where its frozen weights come from, found at its first save (`find`) and kept while
    the source files and the frozen weights are unchanged and no checkpoint was loaded."""

    def __init__(self) -> None:
        # The entry (None: stored), and what each rank saw when it was found: its files' stats, its weights' versions.
        self._found: tuple[dict[str, Any] | None, list[tuple[list[tuple[str, int, int]], list[int]]]] | None = None

    def forget(self) -> None:
        """The frozen weights may have been replaced (a checkpoint was loaded): compare them again at the next save."""
        self._found = None

    def find(self, module: nn.Module, layout: Any, comm: Communicator) -> dict[str, Any] | None:
        """The manifest's "frozen_source" entry, or None where the frozen weights must be stored (said in a log line
        on rank 0). Every rank of `comm` calls it, and all get the same answer."""
        if self._found is not None:
            entry, seen = self._found
            if entry is None:
                return None
            files = [f["file"] for f in entry["files"]]
            now = comm.agree(lambda: (_file_stats(source_folder(entry), files), _versions(module, layout)),
                             "checking the base model's files", CheckpointError)
            if now == seen:
                return entry
        reasons = comm.agree(lambda: _why_not(module, layout), "comparing the frozen weights with their source",
                             CheckpointError)
        reason = next((r for r in reasons if r is not None), None)
        if reason is not None:
            if comm.rank == 0:
                logger.info(f"checkpoints store the frozen weights (checkpoint_frozen_weights by_source falls back to "
                            f"stored): {reason}")
            self._found = (None, [])
            return None
        entry = _entry(module, layout)
        files = [f["file"] for f in entry["files"]]
        def hash_share_then_stat() -> tuple[dict[str, str], tuple[list[tuple[str, int, int]], list[int]]]:
            folder = source_folder(entry)
            share = {f: sha256(folder / f) for f in files[comm.rank::comm.world_size]}
            return share, (_file_stats(folder, files), _versions(module, layout))

        hashed = comm.agree(hash_share_then_stat, "hashing the base model's files", CheckpointError)
        digest = {file: h for share, _ in hashed for file, h in share.items()}
        for record in entry["files"]:
            record["sha256"] = digest[record["file"]]
        self._found = (entry, [seen for _, seen in hashed])
        if comm.rank == 0:
            where = f"the Hub's {entry['name_or_path']} at commit {entry['revision']}" if "revision" in entry \
                else entry["name_or_path"]
            logger.info(f"checkpoints record the {len(layout.frozen)} frozen weights by their source, {where} "
                        f"({len(files)} file(s)), instead of storing them")
        return entry


def _versions(module: nn.Module, layout: Any) -> list[int]:
    """Each frozen weight's version counter, which torch advances at every in-place change made through the
    parameter: a weight changed since it was compared with its source shows here without reading either."""
    return [p._version for name, p in module.named_parameters() if name in layout.frozen]


def _source_keys(module: nn.Module, layout: Any) -> tuple[Path, dict[str, str], dict[str, list[str]]]:
    """The pretrained folder, what names it (`base_source`) and, for each frozen weight, [file, tensor] there.
    KeyError or ValueError saying why not."""
    source = base_source(module)
    if source is None:
        raise ValueError("the model was not loaded with from_pretrained from a local folder or from a Hub id whose "
                         "files are in huggingface_hub's cache (built from a config, or loaded with another cache_dir)")
    folder, hub = source
    return folder, hub, _keys_in(folder, module, layout.frozen)


def _keys_in(folder: Path, module: nn.Module, frozen: dict[str, Any]) -> dict[str, list[str]]:
    """For each of `module`'s frozen weights (name -> its "shape"), [file, tensor] of `folder` that its loading reads
    it from (`PretrainedWeights.key_of`). KeyError or ValueError saying why not."""
    from hf_zero.zero.construct import PretrainedWeights

    try:
        weights = PretrainedWeights(folder)
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"{folder} has no readable safetensors weights ({e})") from None
    keys = {}
    for name, entry in frozen.items():
        key = weights.key_of(module, name)
        file = weights.file_of[key].relative_to(folder)
        if not SOURCE_FILE.fullmatch(str(file)):
            raise ValueError(f"{name} is in {file}, not a plain safetensors file of {folder}")
        if list(weights.header_of[key][0]) != entry["shape"]:
            raise ValueError(f"{name} has shape {entry['shape']} and {folder / file}'s {key} "
                             f"{list(weights.header_of[key][0])}")
        keys[name] = [str(file), key]
    return keys


def _why_not(module: nn.Module, layout: Any) -> str | None:
    """Why this rank's frozen weights cannot be recorded by their source, or None: each must be found in the
    pretrained folder with its shape, and the pieces this rank would store must equal the file's, cast as the engine
    holds them."""
    try:
        folder, _, keys = _source_keys(module, layout)
    except (KeyError, ValueError) as e:
        return str(e).strip("'\"")
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for piece in (p for p in layout.frozen_pieces if p.written):
            file, key = keys[piece.name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(folder / file), framework="pt"))
            values = piece.values.detach().reshape(-1)
            if not torch.equal(read_flat(handles[file], key, piece.lo, piece.hi).to(values.dtype), values.cpu()):
                return f"the frozen weight {piece.name} is not {folder / file}'s {key} (changed since it was loaded)"
    return None


def _entry(module: nn.Module, layout: Any) -> dict[str, Any]:
    folder, hub, keys = _source_keys(module, layout)
    files = sorted({file for file, _ in keys.values()})
    return {"name_or_path": str(folder), **hub,
            "files": [{"file": f, "bytes": (folder / f).stat().st_size} for f in files], "keys": keys}


# ---- load ------------------------------------------------------------------------------------
def check_entry(entry: Any, frozen: dict[str, Any]) -> None:
    """Raises ValueError naming what is wrong with a manifest's "frozen_source" entry: a folder, files by plain
    name with their size and SHA-256, and for every frozen weight one of those files and a tensor name."""
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    expect(isinstance(entry, dict) and isinstance(entry.get("name_or_path"), str) and entry["name_or_path"],
           "frozen_source must name the base model's folder or Hub id")
    if "revision" in entry:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        expect(isinstance(entry["revision"], str) and re.fullmatch(r"[0-9a-f]{40}", entry["revision"]) is not None,
               "frozen_source.revision must be a commit: 40 hex digits")
        try:
            validate_repo_id(entry["name_or_path"])
        except HFValidationError as e:
            raise ValueError(f"frozen_source.name_or_path is not a Hub id: {e}") from None
    files = entry["files"]
    expect(isinstance(files, list) and files, "frozen_source.files must list the base model's files")
    for record in files:
        expect(isinstance(record, dict) and isinstance(record.get("file"), str)
               and SOURCE_FILE.fullmatch(record["file"]) is not None,
               f"frozen_source file {record!r} is not a plain safetensors file name")
        expect(type(record["bytes"]) is int and record["bytes"] >= 0, f"{record['file']}: bytes must be a count")
        expect(isinstance(record["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", record["sha256"]) is not None,
               f"{record['file']}: sha256 must be 64 hex digits")
    named = {record["file"] for record in files}
    keys = entry["keys"]
    expect(isinstance(keys, dict) and set(keys) == set(frozen),
           "frozen_source.keys must give the source of every frozen weight, and of nothing else")
    for name, where in keys.items():
        expect(isinstance(where, list) and len(where) == 2 and where[0] in named and isinstance(where[1], str),
               f"frozen_source.keys[{name!r}] must be [one of frozen_source.files, tensor name]; got {where!r}")


def check_source_files(entry: dict[str, Any], records: list[dict[str, Any]] | None = None) -> None:
    """Each of `records` (default: every file the entry names) is in the recorded folder with its size and SHA-256;
    CheckpointError names the first that is not."""
    folder = source_folder(entry, records)

    def explain(path: Path, problem: str, record: dict[str, Any]) -> str:
        if problem == "missing":
            return (f"{path} is missing: the checkpoint does not store its frozen weights and reads them from the "
                    f"base model it was trained on, in {folder}. Put the base model back there")
        return (f"{path} changed since the checkpoint was saved (it is {path.stat().st_size} bytes with another "
                f"SHA-256; the checkpoint recorded {record['bytes']}): the checkpoint reads its frozen weights from "
                f"this base model, and this is not the one it was trained on. Put that base model back, or start a "
                f"new run instead of resuming")

    check_files(folder, entry["files"] if records is None else records, explain, links_may_leave=True)


def check_keys(entry: dict[str, Any], module: nn.Module, frozen: dict[str, Any]) -> None:
    """Each frozen weight's tensor in a manifest's "frozen_source" entry (its files checked) is the one a save of
    `module` records, the tensor the model's own loading reads it from; CheckpointError names the first that is not.
    An entry edited to read a weight from another tensor of its shape passes every check of files and shapes, and
    would load each weight where the other belongs. Loading and consolidation both call it."""
    folder = source_folder(entry)
    try:
        expected = _keys_in(folder, module, frozen)
    except (KeyError, ValueError) as e:
        reason = str(e).strip("'\"")
        raise CheckpointError(f"the base model in {folder} does not hold this model's frozen weights: "
                              f"{reason}") from None
    for name in sorted(frozen):
        if entry["keys"][name] != expected[name]:
            (file, key), (loaded_file, loaded_key) = entry["keys"][name], expected[name]
            raise CheckpointError(
                f"frozen_source.keys reads the frozen weight {name} from {file}'s {key!r}, but the model loads it from "
                f"{loaded_file}'s {loaded_key!r} of {folder}: the manifest was edited or damaged. Use an intact copy "
                f"of the checkpoint")


@contextlib.contextmanager
def opened(entry: dict[str, Any], names: list[str]) -> Iterator[dict[str, Any]]:
    """The source files holding the frozen weights `names`, opened: file -> safe_open handle."""
    needed = sorted({entry["keys"][name][0] for name in names})
    folder = source_folder(entry, [record for record in entry["files"] if record["file"] in needed])
    with contextlib.ExitStack() as stack:
        handles = {}
        for file in needed:
            handles[file] = stack.enter_context(open_safetensors(folder / file))
        yield handles


def read(handles: dict[str, Any], entry: dict[str, Any], frozen: dict[str, Any], name: str, lo: int,
         hi: int | None) -> torch.Tensor | None:
    """Elements [lo, hi) of frozen weight `name` from its source, in the dtype the checkpoint's engine held it (the
    source's values cast as the engine cast them); with `hi` None, only checks the tensor is there with its shape."""
    file, key = entry["keys"][name]
    commit = f" at commit {entry['revision']}" if "revision" in entry else ""
    where = f"{file} of {entry['name_or_path']}{commit}"
    try:
        shape = handles[file].get_slice(key).get_shape()
    except SafetensorError:
        raise CheckpointError(f"{where} has no tensor {key!r}, which the checkpoint reads frozen weight {name} "
                              f"from") from None
    if list(shape) != frozen[name]["shape"]:
        raise CheckpointError(f"{where}: {key!r} has shape {list(shape)}; the checkpoint's frozen weight {name} is "
                              f"{frozen[name]['shape']}")
    if hi is None:
        return None
    return read_flat(handles[file], key, lo, hi).to(TORCH_DTYPES[frozen[name]["dtype"]])
