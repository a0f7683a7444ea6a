"""A checkpoint's files, as every other checkpoint module and frozen_source.py handle them: the error every refusal
raises, a file's hash, a name kept inside its folder, a safetensors file opened, and files checked against the sizes
and hashes recorded for them."""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from safetensors import SafetensorError, safe_open


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what is wrong."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def inside(folder: Path, name: str) -> Path:
    """folder / name, refused when a link takes it out of `folder` (a checkpoint received from elsewhere must
    not make us read, or copy into an upload, a file of this machine's)."""
    path = folder / name
    if path.is_symlink() and folder.resolve() not in path.resolve().parents:
        raise CheckpointError(f"{path} is a link to {path.resolve()}, outside the checkpoint folder; refusing to "
                              f"read it")
    return path


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safe_open of `path`, whose damaged or crafted header is a CheckpointError naming it."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    with handle:
        yield handle


def open_shard(folder: Path, file: str) -> contextlib.AbstractContextManager[Any]:
    """A shard file of the checkpoint in `folder`, opened (`open_safetensors`), never through a link out of it."""
    return open_safetensors(inside(folder, file))


def check_files(folder: Path, records: Iterable[dict[str, Any]], explain: Callable[[Path, str, dict[str, Any]], str],
                links_may_leave: bool = False) -> None:
    """Each record ({"file", "bytes", "sha256"}) names a file of `folder` of that size and SHA-256. The first that
    does not raises CheckpointError(explain(path, problem, record)), `problem` being "missing", "bytes" or "sha256"
    (its hash is computed only when its size is right). A link out of `folder` is refused unless `links_may_leave`
    (a Hub cache's snapshot is links into its blobs)."""
    for record in records:
        path = folder / record["file"] if links_may_leave else inside(folder, record["file"])
        if not path.is_file():
            problem = "missing"
        elif path.stat().st_size != record["bytes"]:
            problem = "bytes"
        elif sha256(path) != record["sha256"]:
            problem = "sha256"
        else:
            continue
        raise CheckpointError(explain(path, problem, record))
