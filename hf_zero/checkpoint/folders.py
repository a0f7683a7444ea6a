"""The all-or-nothing checkpoint folder: when one is complete, how a save puts a new one in place of the old without
ever leaving neither, and which folder a load reads after a crash.

A checkpoint folder is complete when its manifest is there: the manifest is written last, through a temporary file
and a rename. A save writes `<dir>.partial`, then moves `<dir>` to `<dir>.old`, the partial folder to `<dir>`, and
removes `<dir>.old`. A crash between any two of these leaves at least one complete folder;
`recover_interrupted_save` finishes the interrupted save (it was complete) or drops its partial folder (it was not),
and loading reads the same folder recovering would keep (`readable_folder`).

A save moves or removes only folders this library made: each carries MARKER from its creation, and a removal takes
it last, so a folder half removed by a crash is still recognised. A folder in the way that has neither MARKER nor an
hf_zero manifest (a user's `ckpt.old`, or `ckpt` holding a training log) is refused, naming what it holds; an empty
one is taken. A save holds the file lock `<dir>.lock` throughout (`SaveLock`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from filelock import FileLock, Timeout

from hf_zero.checkpoint.files import CheckpointError
from hf_zero.checkpoint.manifest import FORMAT, MANIFEST

logger = logging.getLogger("hf_zero")
MARKER = ".hf_zero_checkpoint"
# Where a ZeroTrainer checkpoint-N folder keeps the engine checkpoint, beside the config and tokenizer.
TRAINER_SUBFOLDER = "zero_checkpoint"


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


def newest_complete(final: Path) -> Path | None:
    """The folder holding the newest complete checkpoint saved as `final`, whatever point an interrupted
    save stopped at: a complete `.partial` is newer than `final`, which is newer than `.old`."""
    partial, old = save_folders(final)
    return next((f for f in (partial, final, old) if is_complete(f)), None)


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


def recover_interrupted_save(final: Path) -> None:
    """Leaves `final` the newest complete checkpoint and nothing beside it, finishing or undoing an
    interrupted save. Each move is one a save makes, in the same order, so a crash in here is one too."""
    check_save_target(final)
    partial, old = save_folders(final)
    if is_complete(partial):
        swap_in(partial, final)
        return
    remove_folder(partial)  # an interrupted save's files, never a checkpoint
    if not final.exists() and is_complete(old):
        rename(old, final)
    remove_folder(old)


def swap_in(partial: Path, final: Path) -> None:
    """Puts the complete `partial` in place of `final`, which is moved aside until then."""
    _, old = save_folders(final)
    if final.exists():
        if old.exists():  # a copy as old as `final` or older: `final` stays in place meanwhile
            remove_folder(old)
        rename(final, old)
    rename(partial, final)
    remove_folder(old)


# Every change a save makes to the folders goes through these two, so the tests can stop it at each.
def rename(source: Path, target: Path) -> None:
    source.rename(target)  # atomic, and replaces a file in the way


def remove_folder(folder: Path) -> None:
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


def start_partial(final: Path) -> Path:
    """Recovers what an interrupted save of `final` left, then creates its empty partial folder, marked as ours."""
    recover_interrupted_save(final)
    partial, _ = save_folders(final)
    partial.mkdir(parents=True)
    (partial / MARKER).write_text(f"{FORMAT}: a checkpoint folder, moved and removed by later saves\n")
    return partial


class SaveLock:
    """The file lock `<dir>.lock`, held by a save of `<dir>` to its end: another process's save of the same folder
    would mix their files. The lock file is removed after only where this save created it (none of a user's)."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.path = final.with_name(final.name + ".lock")
        self.lock = FileLock(self.path, timeout=0)
        self.made = False

    @property
    def held(self) -> bool:
        return self.lock.is_locked

    def acquire(self) -> None:
        self.made = not self.path.exists()
        try:
            self.lock.acquire()
        except Timeout:
            raise CheckpointError(f"another save of {self.final} is in progress (it holds {self.lock.lock_file}); wait "
                                  f"for it to end, or save to another folder") from None
        except OSError as error:  # filelock opens the lock without following links: a link was ELOOP
            what = "a symbolic link" if self.path.is_symlink() else f"not a file it can lock ({error.strerror})"
            raise CheckpointError(f"{self.path}, the save's lock, is {what}: it must be a plain file or absent; "
                                  f"remove it, or save to another folder") from None

    def release(self) -> None:
        if self.lock.is_locked:
            if self.made:  # before the release: another save then finds no file, or a new one of its own
                self.path.unlink(missing_ok=True)
            self.lock.release()
