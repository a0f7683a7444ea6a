"""The suite's settings and its split over four xdist workers (docs/testing.md), and the session-wide spawned
runs: each world size is spawned once and runs every scenario the tests read."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hf_zero.runtime.launch import spawn_gloo
from hf_zero.settings.environment import (
    COLLECTIVE_TIMEOUT_ENV,
    CPU_ADAM_THREADS_ENV,
    SIMULATION_MODES,
    cpu_isas,
    cpu_model,
)
from hf_zero.testing.simulated_gpu import simulation, uninstall
from tests.helpers import Scenario, run_scenarios, simulated

# Every process a test starts (torchrun ranks, spawned workers, scripts) prints its Python stacks if it dies
# on a signal, so a rare abort in CI says where it happened.
os.environ["PYTHONFAULTHANDLER"] = "1"
# glibc's own last words ("free(): invalid pointer") go to the captured stderr, not to a terminal the run may have.
os.environ["LIBC_FATAL_STDERR_"] = "1"
# A collective that some rank never joins fails its test within a minute, naming the rank and the collective,
# instead of after the default wait (spawned ranks: 5 minutes; hf-zero train and run: 10).
os.environ[COLLECTIVE_TIMEOUT_ENV] = "40"

# The suite runs on four pytest-xdist workers (pyproject.toml: -n 4 --dist loadgroup). A worker takes whole
# modules, so that a module's fixtures are built once; the modules that use the session's spawned worlds go
# to one worker together, so that those are spawned once. Modules that took over 20 s alone (--durations=0 on
# the 2-core machine) start first, longest first, so that no long module is left to run
# alone at the end; the rest follow in collection order.
LONGEST_MODULES = ["tests/hf/test_pretrained.py", "tests/test_examples.py", "tests/cli/test_run.py",
                   "tests/zero/test_construct.py", "tests/optim/test_delayed_update.py", "tests/optim/test_nvme.py",
                   "tests/hf/test_trainer.py", "tests/runtime/test_tensor_parallel.py", "tests/ops/test_quantize.py",
                   "tests/cli/test_train_lm.py", "tests/runtime/test_launch.py", "tests/checkpoint/test_checkpoint.py",
                   "tests/engine/test_compile.py"]
SESSION_WORLDS = {"world2", "world4"}


if "PYTEST_XDIST_WORKER" in os.environ:
    # Several workers on two cores: torch's intra-op threads (OpenMP, which spins while it waits) in each worker and
    # in the interpreters they start would contend for the cores the other workers' ranks need. The offloaded step's
    # CPU Adam takes its threads from HF_ZERO_CPU_ADAM_THREADS, not OMP_NUM_THREADS (two here by default): 100 steps
    # of gpt2-tiny offloaded took 4.9 s and 3.4 s of CPU on two threads beside a running suite, 1.8 s on one.
    # tests/optim/test_host.py runs it on the default and on 3 threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[CPU_ADAM_THREADS_ENV] = "1"
    torch.set_num_threads(1)


_KERNEL_BUILD = pytest.StashKey[subprocess.Popen]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under xdist, the C++ kernels start compiling in the background at once (one compiler process, about
    13 s of a core each), while the workers run tests that need none; a test that needs one waits on the build's
    lock (hf_zero/ops/build.py). Compiled on first use, the workers waited on the compiler, one core idle."""
    if session.config.getoption("numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        session.config.stash[_KERNEL_BUILD] = subprocess.Popen(
            [sys.executable, "-m", "hf_zero", "build-ops"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(_KERNEL_BUILD, None)
    if build is not None:
        build.wait()


@pytest.hookimpl(trylast=True)  # after the durations, near the line of counts that CI shows last
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The machine the run's times belong to: docs/testing.md compares the suite's time by machine kind."""
    terminalreporter.write_line(f"machine: {cpu_model()}, {os.cpu_count()} cores, kernels' instruction sets "
                                f"{', '.join(cpu_isas() or ['unknown'])}")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it names each test by its group)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    with_worlds = {_module(item) for item in items if SESSION_WORLDS & set(getattr(item, "fixturenames", ()))}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("session_worlds" if _module(item) in with_worlds else _module(item)))


@pytest.hookimpl(tryfirst=True)  # after every reordering of the items, before xdist sends their order
def pytest_collection_finish(session: pytest.Session) -> None:
    first = {name: i for i, name in enumerate(LONGEST_MODULES)}
    session.items.sort(key=lambda item: first.get(_module(item), len(first)))  # stable: modules keep their order
    # What collection imported (torch, transformers, every test module) lives as long as the worker: frozen, the
    # cyclic collector no longer walks it in each full collection, about 0.2 s of a core each, hundreds a run.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def transformers_verbosity_restored():
    """A Trainer run with log_level="info" sets transformers' global verbosity; without this, every later test
    in the same worker would capture transformers' INFO records (which test runs first depends on xdist)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    yield
    hf_logging.set_verbosity(verbosity)


@pytest.fixture
def refused_before_launch(monkeypatch, capsys):
    """`hf-zero ARGS` run in this process, for what it must refuse before any process starts: starting one
    fails the test. Returns the exit code and stderr."""
    from hf_zero.cli import commands as cli
    from hf_zero.cli import node_ranks

    monkeypatch.setattr(node_ranks, "start_node_ranks",
                        lambda *launch: pytest.fail(f"processes were started: {launch}"))
    monkeypatch.setattr(cli, "use_mmap_for_large_allocations", lambda: None)  # this process's allocator kept

    def refused(*args: str) -> tuple[int, str]:
        try:
            code = cli.main(list(args))
        except SystemExit as stop:  # argparse's errors
            code = stop.code
        return code, capsys.readouterr().err

    return refused


@pytest.fixture(autouse=True)
def _stream_checker_ends_with_the_simulation():
    """A test that left the simulation "late" (its monkeypatch undone) leaves no simulated GPU, nor its stream
    checker, behind to slow, or stop, the tests after it in this worker."""
    yield
    if simulation() != "late":
        uninstall()


@pytest.fixture(scope="module", params=["immediate", *SIMULATION_MODES])
def copies(request) -> str:
    """Runs a module's tests three times: with copies as the CPU makes them (immediate), and under each mode of
    hf_zero.runtime.device's simulation of a GPU: "late", where a copy lands only when waited on and the host touching
    a buffer that a queued copy still uses raises (how a missing wait on the GPU path shows), and "early",
    where every copy and reduction has run the moment it is issued."""
    with simulated(request.param if request.param in SIMULATION_MODES else None):
        yield request.param


SMALL_BUCKETS = {"reduce_bucket_size": 3000, "allgather_bucket_size": 6000}  # several buckets, straddling params
CLIP = 1.0  # the global norm of the parity runs' 5 steps goes from 0.91 to 1.10: some steps clip, some do not


def parity_scenarios(kind: str) -> list[Scenario]:
    return [Scenario(f"ddp_{kind}", kind)] + [
        Scenario(f"s{stage}_{kind}", kind, {"zero_stage": stage, **SMALL_BUCKETS}) for stage in (0, 1, 2, 3)
    ]


def world2_scenarios() -> list[Scenario]:
    scenarios = parity_scenarios("gpt2") + parity_scenarios("bert")
    scenarios += [
        Scenario("s3_persistent_gpt2", config={"zero_stage": 3, "param_persistence_threshold": 100,
                                               "prefetch_bucket_size": 0}),
        Scenario("s3_paper_schedule_gpt2", config={"zero_stage": 3, "reshard_root_after_forward": True,
                                                   **SMALL_BUCKETS}),
        Scenario("s2_no_overlap_gpt2", config={"zero_stage": 2, "overlap_comm": False, **SMALL_BUCKETS}),
        Scenario("s2_deep", "gpt2-deep", {"zero_stage": 2, **SMALL_BUCKETS}, steps=2),
        Scenario("s3_deep", "gpt2-deep", {"zero_stage": 3, **SMALL_BUCKETS}, steps=2),
    ]
    scenarios.append(Scenario("s0_bf16", config={"zero_stage": 0, "dtype": "bf16", **SMALL_BUCKETS}))
    for stage in (1, 2, 3):
        scenarios += [
            Scenario(f"s{stage}_bf16", config={"zero_stage": stage, "dtype": "bf16", **SMALL_BUCKETS}),
            Scenario(f"s{stage}_ga4", config={"zero_stage": stage, "gradient_accumulation_steps": 4, **SMALL_BUCKETS},
                     steps=3, global_batch=16),
            Scenario(f"s{stage}_fp16_overflow", config={"zero_stage": stage, "dtype": "fp16", **SMALL_BUCKETS},
                     steps=3, poison_step=1),
            Scenario(f"s{stage}_clip", config={"zero_stage": stage, "gradient_clipping": CLIP, **SMALL_BUCKETS}),
        ]
    scenarios += [Scenario(f"s{stage}_clip_fused", config={"zero_stage": stage, "gradient_clipping": CLIP,
                                                           **SMALL_BUCKETS}, fused=True) for stage in (2, 3)]
    scenarios += [Scenario(f"s{stage}_bf16_fp32_reduce", config={"zero_stage": stage, "dtype": "bf16",
                                                                  "reduce_dtype": "fp32", **SMALL_BUCKETS})
                  for stage in (2, 3)]
    # ZeRO++ hpZ over both ranks, the root freed after forward too: a secondary partition of every unit.
    scenarios.append(Scenario("s3_hpz_bf16", config={"zero_stage": 3, "dtype": "bf16", "ranks_per_node": 2,
                                                     "hpz_partition_size": 2, "reshard_root_after_forward": True},
                              steps=2))
    scenarios += [
        Scenario("s3_qwz", config={"zero_stage": 3, "quantized_weights": True, "quantization_block_size": 64},
                 steps=2),
        Scenario("s2_offload_ga2", config={"zero_stage": 2, "offload_optimizer": "cpu", "dtype": "bf16",
                                           "gradient_accumulation_steps": 2, **SMALL_BUCKETS}, steps=2),
        Scenario("s3_offload", config={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
                                       "dtype": "bf16", **SMALL_BUCKETS}, steps=2),
    ]
    # The same runs with every asynchronous copy, reduction and collective as late, then as early, as a GPU may
    # run them (hf_zero.runtime.device's simulation): tests/engine/test_engine.py holds them bitwise to the runs above.
    scenarios += [replace(sc, name=f"{sc.name}_{mode}", simulate=mode)
                  for sc in scenarios if sc.name in UNDER_SIMULATION for mode in SIMULATION_MODES]
    return scenarios


UNDER_SIMULATION = ["s0_gpt2", "s1_gpt2", "s2_gpt2", "s3_gpt2", "s2_ga4", "s3_hpz_bf16", "s3_qwz", "s2_offload_ga2",
                    "s3_offload", "s3_clip_fused"]


def world4_scenarios() -> list[Scenario]:
    return [sc for kind in ("gpt2", "bert") for sc in parity_scenarios(kind) if not sc.name.startswith("s0")]


@pytest.fixture(scope="session")
def world2() -> list[dict]:
    return spawn_gloo(run_scenarios, 2, world2_scenarios())


@pytest.fixture(scope="session")
def world4() -> list[dict]:
    return spawn_gloo(run_scenarios, 4, world4_scenarios())
