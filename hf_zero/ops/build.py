"""Builds csrc/ with torch's C++ extension tooling (ninja) on first use, cached per torch version.

Ahead of time: `hf-zero build-ops`. Nothing here needs CUDA: the kernels are CPU code, compiled
against whichever torch is installed, so building never pulls a different torch.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

logger = logging.getLogger("hf_zero")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# Each extension and its sources (csrc/isa.h, the run-time ISA choice, is included by both).
KERNELS = {"hf_zero_cpu_adam": ["cpu_adam.cpp"], "hf_zero_quantize": ["quantize.cpp"]}
_built: dict[str, ModuleType | Exception] = {}


def build_directory(name: str) -> Path:
    """Where the compiled extension is cached: per torch version, since the ABI follows torch."""
    root = Path(os.environ.get("HF_ZERO_EXTENSIONS_DIR", Path.home() / ".cache" / "hf_zero" / "extensions"))
    return root / f"torch-{torch.__version__}" / name


@contextlib.contextmanager
def _only_builder(directory: Path) -> Iterator[None]:
    """Holds an flock on the build folder while torch builds or loads the extension. torch's own lock is a
    file that a killed build (Ctrl-C, the OOM killer) leaves behind, and every later build then waits on
    it forever. The kernel releases an flock when its process dies, so while it is held here a `lock`
    file inside is such a leftover, and is removed."""
    with open(directory.parent / f"{directory.name}.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks building the same extension wait here
        leftover = directory / "lock"
        if leftover.exists():
            logger.warning(f"removing {leftover}, left by a build of {directory.name} that was interrupted")
            leftover.unlink()
        yield


def load_extension(name: str, verbose: bool = False) -> ModuleType:
    """Compiles (or reuses) extension `name` from its csrc/ sources (KERNELS); raises RuntimeError saying what
    is missing."""
    sources = KERNELS[name]
    cached = _built.get(name)
    if isinstance(cached, ModuleType):
        return cached
    if isinstance(cached, Exception):
        raise cached
    try:
        missing = [s for s in sources if not (CSRC / s).is_file()]
        if missing:
            raise RuntimeError(f"the C++ sources {missing} are not in {CSRC}; install hf-zero from its source tree "
                               f"(pip install -e .) to build them")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no C++ compiler on PATH (set CXX or install g++)")
        from torch.utils.cpp_extension import load, verify_ninja_availability

        verify_ninja_availability()
        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        with _only_builder(directory):
            if not (directory / f"{name}.so").exists():  # this process builds it; the others wait above
                logger.warning(f"building hf_zero's C++ {name} kernel on first use (about a minute); it is cached "
                               f"in {directory} for later runs (`hf-zero build-ops` builds it ahead of time)")
            # No -march=native: the binary must run on any x86-64; the kernels pick AVX-512/AVX2 at run time.
            # No contraction of a*b+c into FMAs behind our back: the kernels fuse exactly where ATen does.
            # -fopenmp: at::parallel_for is a header template; without it the loop runs on one thread.
            module = load(name=name, sources=[str(CSRC / s) for s in sources], extra_include_paths=[str(CSRC)],
                          extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                          build_directory=str(directory), verbose=verbose)
    except Exception as error:  # the compiler's output is in the message
        failure = RuntimeError(f"could not build hf_zero's {name} extension: {error}")
        _built[name] = failure
        raise failure from error
    _built[name] = module
    return module
