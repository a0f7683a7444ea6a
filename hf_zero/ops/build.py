"""Builds csrc/ with torch's C++ extension tooling (ninja) on first use, cached per torch version and sources.

Ahead of time: `hf-zero build-ops`. Nothing here needs CUDA: the kernels are CPU code, compiled
against whichever torch is installed, so building never pulls a different torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from hf_zero.runtime.trusted import others_could_change
from hf_zero.settings.environment import EXTENSIONS_DIR_ENV, extensions_dir

logger = logging.getLogger("hf_zero")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# Each extension and its sources (csrc/isa.h, the run-time ISA choice, is included by both).
KERNELS = {"hf_zero_cpu_adam": ["cpu_adam.cpp"], "hf_zero_quantize": ["quantize.cpp"]}
_built: dict[str, ModuleType | Exception] = {}


# No -march=native: the binary must run on any x86-64; the kernels pick AVX-512/AVX2 at run time.
# No contraction of a*b+c into FMAs behind our back: the kernels fuse exactly where ATen does.
# -fopenmp: at::parallel_for is a header template; without it the loop runs on one thread.
CFLAGS, LDFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp"), ("-fopenmp",)  # copied for torch, which appends to them


def build_directory(name: str) -> Path:
    """Where the compiled extension is cached: per torch version (the ABI follows torch) and per content of
    its sources and flags, so an edited kernel is a new folder and a cached one is never rebuilt in place."""
    digest = hashlib.sha256(json.dumps([torch.__version__, *CFLAGS, *LDFLAGS]).encode())
    for source in [*KERNELS[name], *sorted(p.name for p in CSRC.glob("*.h"))]:
        digest.update(source.encode() + b"\0" + (CSRC / source).read_bytes())
    return extensions_dir() / f"torch-{torch.__version__}" / f"{name}-{digest.hexdigest()[:12]}"


def _check_not_writable_by_others(path: Path, what: str) -> None:
    """Refuses `path` where another local user could plant code there, which would run in this process."""
    # The cache is hf_zero's own (0700 as it makes it): no group may write it, not even this user's own.
    problem = others_could_change(path, above=what == "above", own_group=False)
    if problem:
        raise RuntimeError(f"{path} {problem}; hf_zero loads compiled code from there and refuses a place another "
                           f"user could plant it. Make it yours and `chmod go-w` it, or set {EXTENSIONS_DIR_ENV} to a "
                           f"folder of your own")


def _private_folder(folder: Path) -> None:
    """Creates `folder` (mode 0700) where missing, and checks it and every folder above it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_not_writable_by_others(folder, "folder")
    for above in folder.resolve().parents:
        _check_not_writable_by_others(above, "above")


@contextlib.contextmanager
def _only_builder(directory: Path, name: str) -> Iterator[None]:
    """Holds an flock beside the cached build while one process checks, builds or loads it; the others wait.
    The kernel releases an flock when its process dies, so whoever holds it knows that any build folder left
    beside (`<name>.build-*`) belongs to a build that was killed: its compiler may even still be running,
    orphaned, but it writes only there. The lock file is opened without following a link (a link planted
    there would have the build truncate its target)."""
    path = directory.parent / f"{name}.flock"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise RuntimeError(f"cannot open the build lock {path}: {e.strerror} (a symbolic link there is refused)") \
            from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(name: str, directory: Path, verbose: bool) -> ModuleType:
    """Compiles `name` in a private folder of its own and moves it into place once complete: a build killed
    halfway leaves only its own folder, which the next builder removes."""
    from torch.utils.cpp_extension import load, verify_ninja_availability

    verify_ninja_availability()
    for leftover in directory.parent.glob(f"{name}.build-*"):
        logger.warning(f"removing {leftover}, left by a build of {name} that was interrupted")
        shutil.rmtree(leftover, ignore_errors=True)
    logger.warning(f"building hf_zero's C++ {name} kernel on first use (about half a minute); it is cached in "
                   f"{directory} for later runs (`hf-zero build-ops` builds it ahead of time)")
    staging = Path(tempfile.mkdtemp(prefix=f"{name}.build-", dir=directory.parent))  # mode 0700
    try:
        module = load(name=name, sources=[str(CSRC / s) for s in KERNELS[name]], extra_include_paths=[str(CSRC)],
                      extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(staging),
                      verbose=verbose)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when the build succeeded
    return module


def _import(name: str, library: Path) -> ModuleType:
    """Imports a cached build, as torch.utils.cpp_extension.load does once it has compiled."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension(name: str, verbose: bool = False) -> ModuleType:
    """Compiles (or reuses) extension `name` from its csrc/ sources (KERNELS); raises RuntimeError saying what
    is missing or wrong."""
    cached = _built.get(name)
    if isinstance(cached, ModuleType):
        return cached
    if isinstance(cached, Exception):
        raise cached
    try:
        missing = [s for s in KERNELS[name] if not (CSRC / s).is_file()]
        if missing:
            raise RuntimeError(f"the C++ sources {missing} are not in {CSRC}; install hf-zero from its source tree "
                               f"(pip install -e .) to build them")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no C++ compiler on PATH (set CXX or install g++)")
        directory = build_directory(name)
        _private_folder(directory.parent)
        with _only_builder(directory, name):
            library = directory / f"{name}.so"
            if library.exists():
                _check_not_writable_by_others(directory, "folder")
                _check_not_writable_by_others(library, "library")
                module = _import(name, library)
            else:
                module = _build(name, directory, verbose)
    except Exception as error:  # the compiler's output is in the message
        failure = RuntimeError(f"could not build or load hf_zero's {name} extension: {error}")
        _built[name] = failure
        raise failure from error
    _built[name] = module
    return module
