"""Saving a sharded checkpoint: each rank writes its own partition, rank 0 the manifest, all or nothing.

Files go to `<dir>.partial`, every rank reports success or its error, and only then does rank 0 write the manifest
and put the folder in place (folders.py). A failure on any rank becomes the same error on every rank (no rank is
left waiting in a collective), and a crash at any point leaves the newest complete checkpoint loadable.

Frozen weights (a LoRA base) are stored the same way, by name and offset (`frozen/<name>/<lo>`), in the dtype the
model holds them: at stage 3 each rank writes the elements it holds of them, at stages 0-2 rank 0 writes them whole.
Buffers and frozen tp parts are the module state, written whole by rank 0. A frozen weight that is a tensor of the
pretrained folder the model was loaded from is not stored: the manifest records that source (`frozen_source`).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from hf_zero.checkpoint import folders
from hf_zero.checkpoint.files import CheckpointError, sha256
from hf_zero.checkpoint.frozen_source import FrozenSources
from hf_zero.checkpoint.layout import PartitionedModel, ShardLayout, layout_of
from hf_zero.checkpoint.manifest import MANIFEST, manifest_of, shard_file
from hf_zero.optim.update import is_elementwise
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import in_host_memory
from hf_zero.runtime.trace import spanned
from hf_zero.zero.partition import is_tp_replicated, local

if TYPE_CHECKING:
    from hf_zero.optim.update import UpdateBackend


@spanned("save_checkpoint")
def save_partitioned(model: PartitionedModel, directory: str | os.PathLike, training_state: dict[str, Any],
                     client_state: Any = None, sources: FrozenSources | None = None) -> Path:
    """A checkpoint of `model`, every rank of its world_comm writing its partition. With `sources`, frozen weights
    are recorded by the pretrained files they came from where they all are (`FrozenSources.find`), else stored."""
    layout = layout_of(model)
    source = sources.find(model.module, layout, model.world_comm) if sources is not None and layout.frozen else None
    return save(directory, layout, model.backend, model.world_comm, model.module, training_state, client_state,
                source)


def save(directory: str | os.PathLike, layout: ShardLayout, backend: UpdateBackend, comm: Communicator,
         module: nn.Module, training_state: dict[str, Any], client_state: Any = None,
         source: dict[str, Any] | None = None) -> Path:
    """Every rank of `comm` (all ranks holding part of the model's state) writes its partition, rank 0 the
    manifest; `training_state` (step counters, loss scale) goes into the manifest as it is. With `source` (a
    `frozen_source` entry), the frozen weights are recorded by it instead of stored."""
    final = Path(directory)
    if final.name in ("", ".", ".."):  # every rank refuses alike, before any collective
        raise CheckpointError(f"save_checkpoint needs a folder to create or replace, such as 'ckpt' or "
                              f"'out/step-100'; got {str(directory)!r}")
    partial, _ = folders.save_folders(final)
    folders.check_name_length(final)
    layout = _with_whole_module_state(layout)
    if source is not None:
        layout = replace(layout, frozen_pieces=[replace(p, written=False) for p in layout.frozen_pieces])
    lock = folders.SaveLock(final)

    def fresh_partial() -> None:
        # Rank 0 alone recovers an interrupted save and creates the folder, and the others wait for that (agree
        # gathers): a rank creating it while rank 0 removes an interrupted save's folder would lose its files or fail.
        if comm.rank == 0:
            final.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            folders.start_partial(final)

    def commit(shards: list[dict[str, Any] | None]) -> None:
        if comm.rank == 0:
            write_model_files(module, partial)
            manifest = manifest_of(layout, backend.optimizer, comm.world_size, training_state, shards, client_state)
            if source is not None:
                manifest["frozen_source"] = source
            written = partial / (MANIFEST + ".tmp")
            written.write_text(json.dumps(manifest, indent=1))
            folders.rename(written, partial / MANIFEST)  # from here on the new checkpoint is complete
            folders.swap_in(partial, final)

    try:
        comm.agree(fresh_partial, f"creating {partial}", CheckpointError)
        shards = comm.agree(lambda: _write_shard(layout, backend, comm, partial), f"writing the shards under {partial}",
                            CheckpointError)
        comm.agree(lambda: commit(shards), f"committing {final}", CheckpointError)
    except CheckpointError:
        if comm.rank == 0 and lock.held:
            with contextlib.suppress(OSError):  # the cleanup's own failure must not hide why the save failed
                if folders.made_here(partial) and not folders.is_complete(partial):
                    folders.remove_folder(partial)
        raise
    finally:
        lock.release()
    return final


def _with_whole_module_state(layout: ShardLayout) -> ShardLayout:
    """Rank 0 stores the module state, as the model holds it without tensor parallelism. A frozen parameter
    split across the tp group (not stepped, so not in the engine's shards) is stored whole: every rank joins
    its all-gather (`full_tensor`, the same names in the same order everywhere), for the save's duration."""
    whole = {name: t if is_tp_replicated(t) else t.detach().full_tensor() for name, t in layout.module_state.items()}
    return replace(layout, module_state=whole)


def _write_shard(layout: ShardLayout, backend: UpdateBackend, comm: Communicator,
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
    file = folder / shard_file(comm.rank, comm.world_size)
    save_file(tensors, str(file))
    file.chmod(0o666 & ~_umask())  # safetensors creates it 0600; other accounts read it like the manifest
    return {"file": file.name, "bytes": file.stat().st_size, "sha256": sha256(file), "pieces": listed,
            "frozen_pieces": frozen_listed, "optimizer_state": {"scalars": scalars, "elementwise": sorted(elementwise)}}


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
