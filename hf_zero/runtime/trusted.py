"""Code hf_zero runs from files it is pointed at (a compiled kernel, an optimizer's module named on a command line):
only from places no other account can change, as ssh treats its keys. A folder or file another local user could
write would run their code in this process.

Refused, though possibly harmless: a link inside a package (some editable installs, Nix), a zip import, a folder
another group may write (a shared environment). Allowed: what this user's own private group may write (umask 002).
"""
from __future__ import annotations

import grp
import importlib.util
import os
import pwd
import stat
import sys
from collections.abc import Iterable, Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType


def others_could_change(path: Path, above: bool = False, own_group: bool = True) -> str | None:
    """What would let another account change `path` (not followed if a link), or None: this user or root must own
    it, and no other account may write it (its group may, with `own_group`, where that is this user's own private
    group). A sticky folder (/tmp) is fine `above` what is checked: others cannot replace what is in it."""
    try:
        info = os.lstat(path)
    except OSError as error:  # inside a zip archive, or gone
        return f"cannot be checked ({error.strerror or error})"
    if stat.S_ISLNK(info.st_mode) and not above:
        return "is a symbolic link"
    if info.st_uid not in (0, os.getuid()):
        return f"is owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if stat.S_ISLNK(info.st_mode):  # its own mode means nothing: the folder holding it decides who may replace it
        return None
    writable = info.st_mode & (0o002 if own_group and _private_group(info.st_gid) else 0o022)
    if writable and not (above and info.st_mode & stat.S_ISVTX):
        return f"can be written by other accounts (mode {stat.filemode(info.st_mode)})"
    return None


def _private_group(gid: int) -> bool:
    """Whether `gid` is this user's own group: its primary one, named after it, with no other member."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}


def folder_problem(folder: Path) -> str | None:
    """What would let another account put code in `folder` or replace it, or None: the folder (where it really is,
    and the link to it if it is one), and every folder above it, both as written and where it really is (a link on
    the way can be re-pointed by whoever may write the folder holding it)."""
    return _first_problem([(folder, folder.is_symlink()), (folder.resolve(), False), *_above(folder)])


def _above(path: Path) -> Iterator[tuple[Path, bool]]:
    absolute = Path(os.path.abspath(path))
    yield from ((parent, True) for parent in dict.fromkeys([*absolute.parents, *absolute.resolve().parents]))


def _first_problem(places: Iterable[tuple[Path, bool]]) -> str | None:
    return next((f"{path} {problem}" for path, above in places if (problem := others_could_change(path, above))),
                None)


def code_location(spec: ModuleSpec) -> str:
    """Where a module spec's code is: a package's folder (the first, for a namespace package), a module's file; ''
    for one without a place (built in)."""
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin if spec.has_location and spec.origin else ""


def _code_places(spec: ModuleSpec) -> Iterator[tuple[Path, bool]]:
    """Where importing `spec` reads code from, each with whether it is a folder above (sticky allowed there): its
    file; a package's folders and everything in them (its own imports run those); a module's folder and what is in
    it (its own imports may run its neighbours); and the folders above those."""
    packages = [Path(p) for p in spec.submodule_search_locations or []]
    origin = Path(spec.origin) if spec.has_location and spec.origin else None
    if origin is not None:
        yield origin, False
    for folder in packages:
        for root, folders, files in os.walk(folder, onerror=_unreadable):  # links are listed, not followed
            yield from ((Path(root, name), False) for name in folders + files)
    if origin is not None and not packages:
        packages = [origin.parent]
        for entry in origin.parent.iterdir():
            yield entry, False
            if entry.name == "__pycache__" and entry.is_dir() and not entry.is_symlink():
                yield from ((cached, False) for cached in entry.iterdir())
    for folder in packages:  # reached through a link, that link and where it leads
        yield from [(folder, folder.is_symlink()), (folder.resolve(), False), *_above(folder)]


def _unreadable(error: OSError) -> None:
    raise ValueError(f"{error.filename} cannot be checked ({error.strerror}): the import may run what is in it")


def import_checked(name: str) -> ModuleType:
    """Module `name`, imported one level at a time: each level this process has not imported yet is found (its
    parent is imported by then, so finding it runs nothing new), where it reads code from is checked, and the spec
    checked is the one run. ValueError where it cannot be found or imported, or where another account could change
    what it would run."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in sys.modules:  # its code ran already
            continue
        try:
            spec = importlib.util.find_spec(prefix)
        except (ImportError, ValueError) as error:
            raise ValueError(f"cannot look for the module {prefix}: {error}") from None
        if spec is None or spec.loader is None and not spec.submodule_search_locations:
            raise ValueError(f"no module {prefix} can be imported here")
        if problem := _first_problem(_code_places(spec)):
            raise ValueError(f"{problem}: importing {prefix} would run code from a place another account could "
                             f"change; install it where only you (or root) can write")
        _run(spec, parent=sys.modules[".".join(parts[:depth - 1])] if depth > 1 else None)
    return sys.modules[name]


def _run(spec: ModuleSpec, parent: ModuleType | None) -> None:
    """Imports `spec` itself, as importlib does (in sys.modules while it runs, an attribute of its parent), rather
    than searching again: what was checked is what runs."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
    except Exception as error:  # a library's own import can raise anything
        sys.modules.pop(spec.name, None)
        raise ValueError(f"importing {spec.name} failed ({type(error).__name__}: {error})") from None
    if parent is not None:
        setattr(parent, spec.name.rpartition(".")[2], sys.modules[spec.name])
