"""What checkpoint.py and frozen_source.py both check a checkpoint's files with, kept below both: the error every
refusal raises, and a file's hash."""
from __future__ import annotations

import hashlib
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file and what is wrong."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
