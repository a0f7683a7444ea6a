"""Every environment variable hf_zero reads, parsed in one place. A value hf_zero cannot use is a ZeroConfigError
naming the variable and what is allowed: the launchers (`hf-zero train`, `hf-zero run`) check them all before any
rank starts (`check_environment`), and a rank that reads one raises the same error, which its launcher reports as
one line (rank_main.run_rank), not a traceback per rank.

hf_zero's own: HF_ZERO_COLLECTIVE_TIMEOUT, HF_ZERO_CHECK_COLLECTIVES, HF_ZERO_EXTENSIONS_DIR, HF_ZERO_CPU_ADAM_ISA
(read by the C++ kernels too, csrc/isa.h), HF_ZERO_CPU_ADAM_THREADS, HF_ZERO_SIMULATE_ASYNC and HF_ZERO_CUDA_DELAY (tests). The launchers':
torchrun's WORLD_SIZE, LOCAL_WORLD_SIZE and RANK, and what `accelerate launch --use_deepspeed` hands its processes
(ACCELERATE_USE_DEEPSPEED and ACCELERATE_DEEPSPEED_ZERO3_INIT, truth values read as accelerate reads them;
ACCELERATE_DEEPSPEED_ZERO_STAGE, ACCELERATE_GRADIENT_CLIPPING, ACCELERATE_GRADIENT_ACCUMULATION_STEPS).
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

from hf_zero.settings.config import ZeroConfigError

COLLECTIVE_TIMEOUT_ENV = "HF_ZERO_COLLECTIVE_TIMEOUT"
# How long a rank waits in one collective by default: long enough for a rank that saves or loads a large
# shard, or compiles the kernels, while the others wait; short enough that a rank that stopped answering
# is an error within minutes (torch's own default is 30).
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=10)
CHECK_COLLECTIVES_ENV = "HF_ZERO_CHECK_COLLECTIVES"
EXTENSIONS_DIR_ENV = "HF_ZERO_EXTENSIONS_DIR"
CPU_ADAM_ISA_ENV = "HF_ZERO_CPU_ADAM_ISA"
CPU_ADAM_THREADS_ENV = "HF_ZERO_CPU_ADAM_THREADS"
SIMULATE_ENV = "HF_ZERO_SIMULATE_ASYNC"
CUDA_DELAY_ENV = "HF_ZERO_CUDA_DELAY"

# A collective timeout below a second fails on any rank that is a moment late (the heartbeats that name a silent
# rank are a second apart); above 30 days it is no timeout, and torch's millisecond count overflows long before
# Python's timedelta does (1e300 s raised OverflowError inside every rank).
TIMEOUT_BOUNDS = (1.0, 30 * 24 * 3600.0)
CPU_ADAM_ISAS = ("avx512", "avx2", "scalar")
# What each instruction set needs of the CPU, as csrc/isa.h's supported_isa() asks the CPU for it; read from Linux's
# /proc/cpuinfo before launch, so that an instruction set this CPU lacks is one line there, not a C++ error in every
# rank's first step.
ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma", "f16c"}, "scalar": set()}
CPU_INFO = Path("/proc/cpuinfo")
# More threads than any one machine has cores; torch.set_num_threads takes a C int (1e20 overflowed in every rank).
MAX_CPU_ADAM_THREADS = 4096
SIMULATION_MODES = ("late", "early")
DELAYED_STREAMS = ("compute", "comm", "copy")


def seconds(text: str, name: str) -> float:
    """A number of seconds a collective may wait, within TIMEOUT_BOUNDS; ZeroConfigError naming `name` otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low, high = TIMEOUT_BOUNDS
    if not low <= value <= high:  # nan too
        raise ZeroConfigError(f"{name} must be a number of seconds from {low:.0f} to {high:,.0f} (30 days); "
                              f"got {text!r}")
    return value


def collective_timeout(default: timedelta | None) -> timedelta | None:
    """HF_ZERO_COLLECTIVE_TIMEOUT as a timedelta where it is set, else `default`."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    return default if text is None else timedelta(seconds=seconds(text, COLLECTIVE_TIMEOUT_ENV))


def integer(name: str, default: int, minimum: int, maximum: int | None = None) -> int:
    """Environment variable `name` as a whole number of at least `minimum` (and at most `maximum` where given),
    `default` when unset."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"of at least {minimum}" if maximum is None else f"from {minimum} to {maximum:,}"
        raise ZeroConfigError(f"{name} must be a whole number {bounds}; got {text!r}")
    return value


def truth(name: str, default: bool) -> bool:
    """Environment variable `name` as accelerate and transformers read a truth value (1, true, yes, on, ... and
    their opposites), `default` when unset: read otherwise, `ACCELERATE_USE_DEEPSPEED=1` had transformers set up
    DeepSpeed's configuration while hf_zero never took it over."""
    text = os.environ.get(name)
    if text is None:
        return default
    from accelerate.utils.environment import (
        str_to_bool,  # imports torch: only where the variable is set
    )

    try:
        return str_to_bool(text) == 1  # as accelerate's parse_flag_from_env
    except ValueError:
        raise ZeroConfigError(f"{name} must be a truth value as accelerate reads it: y, yes, t, true, on or 1; n, "
                              f"no, f, false, off or 0; got {text!r}") from None


def number(name: str) -> float:
    """Environment variable `name` (set) as a finite number of at least 0."""
    text = os.environ[name]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ZeroConfigError(f"{name} must be a finite number of at least 0; got {text!r}")
    return value


def choice(name: str, allowed: dict[str, str], aliases: dict[str, str | None] | None = None) -> str | None:
    """Environment variable `name` as one of `allowed` (value: what it means) or an alias of one, None when unset or
    empty."""
    text = os.environ.get(name, "")
    aliases = {"": None, **(aliases or {})}
    if text in aliases:
        return aliases[text]
    if text not in allowed:
        spelled = ", ".join(f"{value} ({meaning})" if meaning else value for value, meaning in allowed.items())
        spelled += "".join(f"; {alias} means {meaning or 'off'}" for alias, meaning in aliases.items() if alias)
        raise ZeroConfigError(f"{name} must be one of {spelled}; got {text!r}")
    return text


def check_collectives() -> bool:
    """HF_ZERO_CHECK_COLLECTIVES: 1 (the default) compares every collective across the ranks, 0 does not."""
    return choice(CHECK_COLLECTIVES_ENV, {"1": "compare every collective across the ranks, the default",
                                          "0": "do not"}) != "0"


def simulation() -> str | None:
    """HF_ZERO_SIMULATE_ASYNC: "late", "early" or None (asynchronous work runs at once, as the CPU runs it)."""
    return choice(SIMULATE_ENV, dict.fromkeys(SIMULATION_MODES, ""), {"0": None, "1": "late"})


def extensions_dir() -> Path:
    """Where the compiled kernels are cached: HF_ZERO_EXTENSIONS_DIR, else ~/.cache/hf_zero/extensions. Set but empty
    is refused: it would build and cache them in whatever folder the process started in."""
    text = os.environ.get(EXTENSIONS_DIR_ENV)
    if text is None:
        return Path.home() / ".cache" / "hf_zero" / "extensions"
    if not text.strip():
        raise ZeroConfigError(f"{EXTENSIONS_DIR_ENV} is set but empty: name a folder for the compiled kernels, or "
                              f"unset it for the default (~/.cache/hf_zero/extensions)")
    return Path(text).expanduser()


def cuda_delay() -> tuple[str, int] | None:
    """HF_ZERO_CUDA_DELAY, "STREAM:CYCLES" (tests/test_gpu.py): the stream to hold back and for how many cycles."""
    text = os.environ.get(CUDA_DELAY_ENV, "")
    if not text:
        return None
    stream, _, cycles = text.partition(":")
    if stream not in DELAYED_STREAMS or not (cycles.isascii() and cycles.isdigit()):  # isdigit() alone takes "²"
        raise ZeroConfigError(f"{CUDA_DELAY_ENV} must be STREAM:CYCLES, STREAM one of {', '.join(DELAYED_STREAMS)} "
                              f"and CYCLES a whole number; got {text!r}")
    return stream, int(cycles)


def world_size() -> int:
    """torchrun's WORLD_SIZE: the processes in all (1 when not launched)."""
    return integer("WORLD_SIZE", 1, 1)


def processes_per_node(world: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE: the processes on this node (all `world` of them when it is not set)."""
    return integer("LOCAL_WORLD_SIZE", world, 1)


def restarts_so_far() -> int:
    """torchrun's TORCHELASTIC_RESTART_COUNT: how many times the ranks were started again after one died
    (--max_restarts); 0 in a first start, or outside torchrun."""
    return integer("TORCHELASTIC_RESTART_COUNT", 0, 0)


def _cpu_info(field: str) -> str | None:
    """The first processor's `field` in /proc/cpuinfo; None where it cannot be read (not Linux)."""
    try:
        lines = CPU_INFO.read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), "")


def cpu_isas() -> list[str] | None:
    """The kernels' instruction sets this CPU has (ISA_NEEDS), best first; None where /proc/cpuinfo cannot be read
    (not Linux: the kernel then checks HF_ZERO_CPU_ADAM_ISA itself, in the first step)."""
    flags = _cpu_info("flags")
    if flags is None:
        return None
    return [isa for isa in CPU_ADAM_ISAS if ISA_NEEDS[isa] <= set(flags.split())]


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it, or "unknown CPU"."""
    return _cpu_info("model name") or "unknown CPU"


def cpu_adam_isa() -> str | None:
    """HF_ZERO_CPU_ADAM_ISA (read by the kernels, csrc/isa.h), checked against this CPU; None when unset."""
    isa = choice(CPU_ADAM_ISA_ENV, dict.fromkeys(CPU_ADAM_ISAS, ""))
    has = cpu_isas()
    if isa is not None and has is not None and isa not in has:
        raise ZeroConfigError(f"{CPU_ADAM_ISA_ENV} must be one this CPU has: {', '.join(has)}; got {isa!r}")
    return isa


def cpu_adam_threads(beside_the_device: bool = False) -> tuple[int, str]:
    """The threads the offloaded update's CPU Adam runs on, and why: HF_ZERO_CPU_ADAM_THREADS where it is set, else
    the cores this process may run on shared by the processes on this node, less one when the update runs beside
    the thread that drives the device (a delayed update, during the next forward and backward: an OpenMP team
    sharing its cores with that thread waits for its slowest member). Not OMP_NUM_THREADS: torchrun sets it to 1
    whenever several processes share a node, which would leave each rank's update on one core."""
    threads = integer(CPU_ADAM_THREADS_ENV, 0, 1, MAX_CPU_ADAM_THREADS)
    if threads:
        return threads, CPU_ADAM_THREADS_ENV
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = processes_per_node(world_size())
    if beside_the_device:
        return max(1, cores // local - 1), f"{cores} cores / {local} processes on this node, less one for the " \
                                           f"thread that drives the device meanwhile"
    return max(1, cores // local), f"{cores} cores / {local} processes on this node"


def check_environment() -> None:
    """Checks every variable above that is set, so that a bad one is refused before any rank starts."""
    collective_timeout(None)
    check_collectives()
    simulation()
    cuda_delay()
    extensions_dir()
    cpu_adam_isa()
    cpu_adam_threads()
    processes_per_node(world_size())
    integer("RANK", 0, 0)
    if truth("ACCELERATE_USE_DEEPSPEED", False):
        truth("ACCELERATE_DEEPSPEED_ZERO3_INIT", True)
        integer("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2, 0)
        integer("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1, 1)
        if os.environ.get("ACCELERATE_GRADIENT_CLIPPING") not in (None, "none"):
            number("ACCELERATE_GRADIENT_CLIPPING")
