"""Code hf_zero runs from files it is pointed at (a compiled kernel, an optimizer's module named on a command line):
only from places no other account can change, as ssh treats its keys. A folder or file another local user could
write would run their code in this process."""
from __future__ import annotations

import importlib
import importlib.util
import os
import stat
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType


def others_could_change(path: Path, above: bool = False) -> str | None:
    """What would let another account change `path` (not followed if a link), or None: this user or root must own
    it and no other account may write it. A sticky folder (/tmp) is fine `above` what is checked: others cannot
    replace what is in it."""
    try:
        info = os.lstat(path)
    except OSError as error:  # inside a zip archive, or gone
        return f"cannot be checked ({error.strerror or error})"
    if stat.S_ISLNK(info.st_mode) and not above:
        return "is a symbolic link"
    if info.st_uid not in (0, os.getuid()):
        return f"is owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if info.st_mode & 0o022 and not (above and info.st_mode & stat.S_ISVTX):
        return f"can be written by other accounts (mode {stat.filemode(info.st_mode)})"
    return None


def folder_problem(folder: Path) -> str | None:
    """What would let another account put code in `folder` or replace it, or None: the folder itself, and every
    folder above where it really is."""
    return _first_problem([(folder, False), *((parent, True) for parent in folder.resolve().parents)])


def _first_problem(places: Iterator[tuple[Path, bool]] | list[tuple[Path, bool]]) -> str | None:
    return next((f"{path} {problem}" for path, above in places if (problem := others_could_change(path, above))),
                None)


def _code_places(spec: ModuleSpec) -> Iterator[tuple[Path, bool]]:
    """Where importing `spec` reads code from, each with whether it is a folder above (sticky allowed there): its
    file; a package's folders and everything in them (its own imports run those); a module's folder and its
    __pycache__; and the folders above those, where they really are."""
    packages = [Path(p) for p in spec.submodule_search_locations or []]
    origin = Path(spec.origin) if spec.has_location and spec.origin else None
    if origin is not None:
        yield origin, False
    for folder in packages:
        yield folder, False
        for root, folders, files in os.walk(folder):  # links are listed, not followed
            yield from ((Path(root, name), False) for name in folders + files)
    if origin is not None and not packages:
        packages = [origin.parent]
        yield origin.parent, False
        cache = origin.parent / "__pycache__"
        if cache.is_dir():
            yield cache, False
            yield from ((path, False) for path in cache.iterdir())
    for folder in packages:
        yield from ((parent, True) for parent in folder.resolve().parents)


def import_checked(name: str) -> ModuleType:
    """Module `name`, imported one level at a time: each level this process has not imported yet is found (its
    parent is imported by then, so finding it runs nothing new) and where it reads code from checked before it runs.
    ValueError where it cannot be found or imported, or where another account could change what it would run."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in sys.modules:  # its code ran already
            continue
        try:
            spec = importlib.util.find_spec(prefix)
        except (ImportError, ValueError) as error:
            raise ValueError(f"cannot look for the module {prefix}: {error}") from None
        if spec is None:
            raise ValueError(f"no module {prefix} can be imported here")
        if problem := _first_problem(_code_places(spec)):
            raise ValueError(f"{problem}: importing {prefix} would run code from a place another account could "
                             f"change; install it where only you (or root) can write")
        try:
            importlib.import_module(prefix)
        except Exception as error:  # a library's own import can raise anything
            raise ValueError(f"importing {prefix} failed ({type(error).__name__}: {error})") from None
    return sys.modules[name]
