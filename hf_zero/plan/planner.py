"""A plan: a setting's memory per rank and traffic per link from the simulated ranks (hf_zero.plan.simulate), its
step time from a model of the machine (`Machine`), and, when the stage is left open, the fastest setting that fits.

Ranks differ only where their links do: the last rank of a node sends its ring traffic across the node boundary
(shards are padded to equal sizes, so no rank holds more). `distinct_ranks` simulates rank 0, the last of node 0
and the last of the world; every other rank holds and sends what one of them does (a test simulates all 16 ranks of
2 x 8 to show it).

The step time, per rank, with nothing overlapped (an upper bound; overlap is what the engine's streams buy back):

    compute   the forward's and backward's FLOPs, counted by FlopCounterMode's formulas on the first step (the same
              shapes; recomputation included), at gpu_tflops x mfu
    network   the bytes this rank sent over intra-node and inter-node links (the ledger's), at each link's bandwidth
    copies    the bytes copied between the device and the host (offload), at the PCIe bandwidth
    host      the optimizer's step on the host (offload_optimizer cpu or nvme): its trained parameters x cpu_adam_ns
    nvme      the bytes the step read from and wrote to its NVMe files, at its share of the node's nvme_gbps

The constants are `Machine`'s defaults, each a flag of `hf-zero plan`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ParamSpec, TypeVar

from hf_zero.optim.optimizer import check_optimizer
from hf_zero.plan.machine import GB, KEYS, Machine
from hf_zero.plan.simulate import Job, RankStep, Setting, probe_optimizer, simulate_rank
from hf_zero.settings.config import ZeroConfig, ZeroConfigError


@dataclass
class Plan:
    job: Job
    setting: Setting
    machine: Machine
    ranks: list[RankStep]
    step_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def busiest(self) -> RankStep:
        """The simulated rank with the highest device peak (the one that decides whether the setting fits)."""
        return max(self.ranks, key=lambda r: (r.device_peak, r.host_peak))

    @property
    def fits_device(self) -> bool:
        return self.busiest.device_peak <= self.machine.gpu_memory

    @property
    def host_busiest(self) -> RankStep:
        """The simulated rank with the highest host peak: every rank of a node is counted as holding what it holds."""
        return max(self.ranks, key=lambda r: r.host_peak)

    @property
    def host_per_node(self) -> int:
        """The host memory a node's ranks take together, each at the most any simulated rank took."""
        return self.host_busiest.host_peak * self.job.gpus_per_node

    @property
    def fits_host(self) -> bool:
        return self.host_per_node <= self.machine.host_memory

    @property
    def nvme_per_node(self) -> int:
        """The NVMe a node's ranks take together, each at the most any simulated rank took."""
        return max(r.nvme_file_bytes for r in self.ranks) * self.job.gpus_per_node

    @property
    def fits_nvme(self) -> bool:
        return self.nvme_per_node <= self.machine.nvme_capacity

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    @property
    def tokens_per_second(self) -> float:
        """Per GPU."""
        return self.setting.micro_batch * self.job.seq_len / self.step_seconds["total"]

    def traffic(self) -> dict[str, int]:
        """The most bytes any simulated rank sent per step over each kind of link."""
        return {span: max(r.sent.get(span, 0) for r in self.ranks) for span in ("intra-node", "inter-node")}

    def as_json(self) -> dict:
        rank, traffic = self.busiest, self.traffic()
        return {
            "setting": asdict(self.setting),
            "model": self.job.model, "params": rank.params, "trained_params": rank.trained_params,
            "nodes": self.job.nodes, "optimizer": self.job.optimizer,
            "engine_settings": json.loads(self.job.engine_settings),
            "gpus_per_node": self.job.gpus_per_node, "seq_len": self.job.seq_len, "dtype": self.job.dtype,
            "per_rank": {
                "rank": rank.rank,
                "device": {**{k: rank.device[k] for k in KEYS}, "peak": rank.device_peak},
                "host": {**{k: rank.host[k] for k in KEYS}, "peak": max(r.host_peak for r in self.ranks)},
                "model_states_at_rest": {k: rank.at_rest["device"][k] for k in KEYS[:3]},
                # what a run measured from before its model is built sees at most (set-up included), on the device
                # and, where the device is the host (a CPU run), on both at one moment
                "measured_peak": {"device": max(r.measured_peak(False) for r in self.ranks),
                                  "device_and_host": max(r.measured_peak(True) for r in self.ranks)},
            },
            "traffic_per_step": {"intra_node": traffic["intra-node"], "inter_node": traffic["inter-node"]},
            "step_seconds": self.step_seconds, "tokens_per_second_per_gpu": self.tokens_per_second,
            "nvme_per_node": self.nvme_per_node,
            "fits": self.fits, "fits_device": self.fits_device, "fits_host": self.fits_host,
            "fits_nvme": self.fits_nvme, "gpu_memory": self.machine.gpu_memory,
            "host_memory": self.machine.host_memory, "nvme_capacity": self.machine.nvme_capacity,
        }


# A step's FLOPs by (job, micro-batch, checkpointing): the same whatever the stage, offload or rank.
_counted_flops: dict[tuple, int] = {}


def distinct_ranks(job: Job) -> list[int]:
    return sorted({0, job.gpus_per_node - 1, job.world_size - 1})


def probe_rank(job: Job) -> int:
    """The rank candidates are simulated at: the last of node 0, whose ring sends cross the node boundary, so that a
    candidate's projected step counts the inter-node links it uses (rank 0 sends within its node only). It holds what
    rank 0 does."""
    return job.gpus_per_node - 1


def _probe_first(job: Job) -> list[int]:
    """The distinct ranks in the order a check simulates them: the probe's first."""
    probe = probe_rank(job)
    return [probe] + [r for r in distinct_ranks(job) if r != probe]


P = ParamSpec("P")
R = TypeVar("R")


class _Workers:
    """The interpreters that run simulations beside this process's, `count()` of them, spawned (this process has
    torch's thread pools, which a fork would copy mid-state). They start once a simulation here has taken
    PARALLEL_AFTER_S of a core (`started_if_slow`), on the cores it leaves waiting, so that their imports (~5 s) are
    over when the next simulations side by side need them; and they are kept until the outermost plan or choice is
    made (the object as a context) rather than spawned again for each round, which paid those imports every time."""

    def __init__(self) -> None:
        self.pool: ProcessPoolExecutor | None = None
        self.depth = 0  # plans and choices being made, one inside another (planning runs in one thread)
        self.lock = threading.Lock()  # the watcher's thread starts the pool (`started_if_slow`)

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.drop()

    def kept(self, function: Callable[P, R]) -> Callable[P, R]:
        """`function`, the workers kept through it."""
        @functools.wraps(function)
        def with_workers(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return function(*args, **kwargs)
        return with_workers

    def drop(self) -> None:
        """Shuts the workers down: each exits once its task, if it has one, is done."""
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def count() -> int:
        """One for each core besides this one, up to the two ranks checked beside the probe's (`distinct_ranks`)."""
        return min(_cores() - 1, 2)

    def get(self) -> ProcessPoolExecutor:
        with self.lock:
            if self.pool is None:
                self.pool = ProcessPoolExecutor(self.count(), mp_context=multiprocessing.get_context("spawn"))
            return self.pool

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        """`fn(*args)` in a worker; in new workers where one has died since it last ran (killed for memory)."""
        try:
            return self.get().submit(fn, *args)
        except BrokenProcessPool:
            self.drop()
            return self.get().submit(fn, *args)

    def start(self) -> None:
        for _ in range(self.count()):
            self.submit(_imported)

    @contextlib.contextmanager
    def started_if_slow(self, more_to_come: bool = True) -> Iterator[None]:
        """Inside, a simulation here: the workers start once it has taken PARALLEL_AFTER_S of this thread's CPU time,
        unless `more_to_come` is false (nothing could run beside the simulations after it). CPU time, not wall time:
        where the machine's cores are busy with other work, a simulation's wall time grows with that work, and
        workers started then would import and simulate on the same busy cores."""
        if not more_to_come or _cores() < 2 or self.pool is not None:
            yield
            return
        simulating = _cpu_clock_of_this_thread()
        start, finished = simulating(), threading.Event()

        def start_once_slow() -> None:
            # A thread's CPU time grows no faster than the wall clock: wait at least what it lacks.
            while (lacking := PARALLEL_AFTER_S - (simulating() - start)) > 0:
                if finished.wait(lacking):
                    return
            self.start()

        watcher = threading.Thread(target=start_once_slow, name="hf_zero plan's worker starter", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            finished.set()
            watcher.join()  # where it started them: the workers it starts are the ones `drop` shuts down


def _cpu_clock_of_this_thread() -> Callable[[], float]:
    """A clock of the calling thread's CPU time that other threads can read (POSIX's per-thread CPU clock); where the
    platform has none (macOS, Windows), the process's CPU time, nearly all of it the simulating thread's."""
    if not hasattr(time, "pthread_getcpuclockid"):
        return time.process_time
    clock = time.pthread_getcpuclockid(threading.get_ident())
    return functools.partial(time.clock_gettime, clock)


def _imported() -> None:
    """Most of what a simulation imports besides this module (torch, transformers, the engine), imported in a worker
    before it is needed."""
    import transformers.modeling_utils  # noqa: F401

    import hf_zero.engine  # noqa: F401


_workers = _Workers()


def _simulated_at_once(job: Job, runs: list[tuple[Setting, int]], more_to_come: bool = True
                       ) -> list[RankStep | Exception]:
    """`runs` ((setting, rank) pairs) simulated at once: the first here, the others in `_workers`. A spawned
    simulation's error is returned in its place, raised where its result is used (`_used`): a candidate simulated
    ahead of its turn may never be needed. A single run starts the workers if it is slow and `more_to_come`."""
    flops = [_counted_flops.get(_flops_key(job, setting)) for setting, _ in runs]
    if len(runs) == 1:
        with _workers.started_if_slow(more_to_come):
            steps = [simulate_rank(job, *runs[0], flops[0])]
    else:
        elsewhere = [_workers.submit(simulate_rank, job, *run, counted) for run, counted in zip(runs[1:], flops[1:])]
        steps = [simulate_rank(job, *runs[0], flops[0]), *(f.exception() or f.result() for f in elsewhere)]
    for (setting, _), step in zip(runs, steps):
        if isinstance(step, RankStep) and not step.said_without_engine:
            _counted_flops[_flops_key(job, setting)] = step.flops
    return steps


def _used(step: RankStep | Exception) -> RankStep:
    """A simulated rank, or the error its simulation raised, raised now."""
    if isinstance(step, Exception):
        raise step
    return step


def _flops_key(job: Job, setting: Setting) -> tuple[Job, int, bool]:
    """What a step's FLOPs depend on: the model and its input, not the ZeRO setting or the rank."""
    return job, setting.micro_batch, setting.gradient_checkpointing


def _cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def step_seconds(job: Job, setting: Setting, machine: Machine, rank: RankStep) -> dict[str, float]:
    compute = rank.flops / (machine.gpu_tflops * 1e12 * machine.mfu)
    network = (rank.sent.get("intra-node", 0) / (machine.intra_node_gbps * GB)
               + rank.sent.get("inter-node", 0) / (machine.inter_node_gbps * GB))
    copies = sum(rank.copied.values()) / (machine.pcie_gbps * GB)
    host = (rank.trained_params / job.world_size * machine.cpu_adam_ns * 1e-9
            if setting.offload_optimizer != "none" else 0.0)
    nvme = rank.nvme_moved / (machine.nvme_gbps * GB / job.gpus_per_node)
    return {"compute": compute, "network": network, "copies": copies, "host": host, "nvme": nvme,
            "total": compute + network + copies + host + nvme}


# A simulation this long, in its thread's CPU time (RankStep.seconds), makes the next ranks worth simulating side by
# side, in processes of their own (`_Workers`): 175B over 1024 GPUs takes ~20 s a rank on one core.
PARALLEL_AFTER_S = 10.0
# What a simulation takes for each of the model's parameter tensors, one core's time, for a model whose steps at
# stages 0-2 were said without running the engine (too large for the device whole): measured 9-11 ms for a stage-3
# step with checkpointing, from a 2-layer GPT-2 to a 175B one of 212 layers.
SECONDS_PER_PARAM_TENSOR = 0.01


@_workers.kept
def plan(job: Job, setting: Setting, machine: Machine, ranks: list[int] | None = None,
         known: list[RankStep] = (), at_once: bool = False) -> Plan:
    """`setting` simulated at each distinct rank of `job` (or at `ranks`); `known` ranks are not simulated again.
    Once a simulation of it has taken PARALLEL_AFTER_S (or from the start: `at_once`), the rest run side by side on
    the machine's cores."""
    wanted = ranks if ranks is not None else distinct_ranks(job)
    done = {r.rank: r for r in known}
    while left := [r for r in wanted if r not in done]:
        if len(left) > 1 and _cores() > 1 and (at_once or any(s.seconds >= PARALLEL_AFTER_S for s in done.values())):
            done |= {s.rank: s for s in map(_used, _simulated_at_once(job, [(setting, r) for r in left]))}
        else:  # the workers are started for what follows: two ranks or more left after this one (run at once), or
            # the choice this plan is part of
            more_to_come = len(left) > 2 or _workers.depth > 1
            done[left[0]] = _used(_simulated_at_once(job, [(setting, left[0])], more_to_come)[0])
    simulated = [done[r] for r in wanted]
    result = Plan(job, setting, machine, simulated)
    result.step_seconds = max((step_seconds(job, setting, machine, r) for r in simulated),
                              key=lambda s: s["total"])
    return result


# ---- choosing -------------------------------------------------------------------------------------
@dataclass
class Candidate:
    setting: Setting
    plan: Plan | None = None  # None: not simulated
    outcome: str = ""  # "chosen", or why it lost
    # Not simulated for what its model states take: its checkpointed and hpZ twins take as much, and are not either.
    model_states_decide: bool = False


def _bases(job: Job, fixed: dict, nvme: bool) -> list[Setting]:
    """Stage, offload and hpZ combinations to consider, fastest-looking first (for each stage, the less offloaded
    first), within what `fixed` fixes; offload to NVMe where the machine has it (`nvme`)."""
    hpz_sizes = [1] + ([job.gpus_per_node] if job.nodes > 1 and job.gpus_per_node > 1 else [])
    offloads = [("none", "none"), ("cpu", "none"), ("cpu", "cpu")] + (
        [("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")] if nvme else [])
    bases = []
    for stage in (0, 1, 2, 3):
        for opt, param in offloads:
            for hpz in hpz_sizes if stage == 3 else [1]:
                base = Setting(stage, opt, param, hpz_partition_size=hpz)
                # a fixed value, or (zero_stage) the values to choose among
                if _valid(base, job) and all(
                        getattr(base, k) in (v if isinstance(v, tuple) else (v,)) for k, v in fixed.items()
                        if k in ("zero_stage", "offload_optimizer", "offload_param", "hpz_partition_size")):
                    bases.append(base)
    return bases


def _valid(setting: Setting, job: Job) -> bool:
    """Whether the engine takes `setting` with the job's other engine settings (qwZ needs stage 3, a delayed update an
    offloaded optimizer, ...) and its optimizer (NVMe streams Adam's states only), as it checks them itself."""
    config = ZeroConfig(**setting.engine_config(job))
    try:
        config.validate()
        check_optimizer(probe_optimizer(job.optimizer, job.optimizer_kwargs, job.optimizer_folder), config)
    except ZeroConfigError:
        return False
    return True


def _largest_micro_batch(probe: Plan, machine: Machine, limit: int, freed: int = 0) -> int:
    """The largest power-of-two micro-batch, up to `limit`, whose device peak fits, taking activations (and the
    backward's other temporaries) to grow with the micro-batch from the probe's at micro-batch 1, with `freed` bytes
    less of the rest."""
    rank = probe.busiest
    growing = rank.transient
    fixed = rank.device_peak - growing - freed
    best, m = 0, 1
    while m <= limit and fixed + m * growing <= machine.gpu_memory:
        best, m = m, m * 2
    return best


def _more_offload_skipped(less: Plan, setting: Setting, machine: Machine, limit: int, fixed_micro: int | None,
                         candidates: list[Candidate]) -> str | None:
    """Why offloading as `setting` does is not worth simulating where `less` (the same stage with less offload) fits, or
    None. Offloading more adds host time and copies; what it can buy is a larger micro-batch, and at most it frees
    what `less` holds on the device at its peak of the optimizer's states and the gradients (and of the parameters'
    shards, where `setting` offloads them too). With that freed, the larger micro-batch is weighed at `less`'s compute
    per sample and traffic per step plus the host's step, nothing for the copies: where even that is no faster than
    the fastest projection among `candidates` simulated so far, it is skipped."""
    if fixed_micro is not None:
        return "fits with less offload; offloading more adds host time and copies"
    micro = _largest_micro_batch(less, machine, limit)
    held, shards = less.busiest.device, less.busiest.at_rest["device"]
    # The parameters at the peak are also the units gathered there, which stay: only their shards move.
    params = min(held["parameters"], shards["parameters"]) if setting.offload_param != "none" else 0
    larger = _largest_micro_batch(less, machine, limit, held["optimizer_states"] + held["gradients"] + params)
    if larger <= micro:
        return (f"fits with less offload, at the largest micro-batch allowed ({micro})" if micro >= limit else
                f"fits with less offload, and could not fit a larger micro-batch than its {micro}") + \
            "; offloading more adds host time and copies"
    seconds = less.step_seconds
    host = step_seconds(less.job, setting, machine, less.busiest)["host"]
    at_most = _tokens_per_second_at(less, larger, {"compute": seconds["compute"],
                                                   "total": seconds["compute"] + seconds["network"] + host})
    fastest = _fastest_projection(candidates, machine, limit)
    if at_most <= fastest:
        return (f"fits with less offload; at micro-batch {larger} at most, with the host's step, it would run at most "
                f"{at_most:,.0f} tokens/s per GPU, no faster than {fastest:,.0f}")
    return None


def _fastest_projection(candidates: list[Candidate], machine: Machine, limit: int) -> float:
    """The most tokens per second per GPU projected for a simulated candidate that fits, at its largest micro-batch."""
    speeds = [0.0]
    for candidate in candidates:
        probe = candidate.plan
        if probe is not None and probe.fits:
            micro = _largest_micro_batch(probe, machine, limit)
            if micro:
                speeds.append(_tokens_per_second_at(probe, micro))
    return max(speeds)


@_workers.kept
def choose(job: Job, machine: Machine, fixed: dict, max_micro_batch: int = 64,
           say: callable = lambda line: None) -> tuple[Plan | None, list[Candidate]]:
    """The fastest setting (tokens per second per GPU) that fits, among stages, offloads, hpZ, checkpointing and
    micro-batches not `fixed`; and every candidate considered with its outcome. Each candidate is simulated at
    `probe_rank` and micro-batch 1 (or the fixed one), the largest fitting micro-batch taken from how its activations
    grow; the winner is simulated again at its micro-batch, at every distinct rank (`_verify`), and kept if it is
    still the fastest. Skipped without simulation, saying why: an offloaded variant where a setting with less offload
    already fits, unless the memory offloading frees could make room for a larger micro-batch that may be faster
    (`_more_offload_skipped`), or where what offload leaves on the device already overflows it
    (`_staying_on_device`); checkpointing where the setting's model states alone (measured) exceed the device; hpZ
    where the setting without it does not fit (`_without_hpz_over`). Once a simulation of the job has taken
    PARALLEL_AFTER_S, the next candidate the rules would simulate runs beside the current one (`_next_simulated`), and
    beside the last one, the first ranks of the check the winner so far would get (`_checks_to_come`)."""
    candidates: list[Candidate] = []
    fixed_micro = fixed.get("micro_batch")
    checkpointing = [fixed["gradient_checkpointing"]] if "gradient_checkpointing" in fixed else [False, True]
    choosing_checkpointing = len(checkpointing) > 1
    fits_with_less_offload: dict[tuple, Plan] = {}  # the least offloaded setting that fits
    settings = [replace(base, gradient_checkpointing=ckpt, micro_batch=fixed_micro or 1)
                for base in _bases(job, fixed, machine.nvme_capacity > 0) for ckpt in checkpointing]
    # (setting, rank) -> its simulation, run beside an earlier one before its turn: the next candidate, or the first
    # ranks of the winner's check
    ahead: dict[tuple[Setting, int], RankStep | Exception] = {}
    rank = probe_rank(job)

    def not_simulated(setting: Setting, considered: list[Candidate]) -> tuple[str, bool] | None:
        return _not_simulated(setting, considered, fits_with_less_offload, machine, max_micro_batch, fixed_micro,
                              choosing_checkpointing)

    def judged(candidate: Candidate) -> Candidate:
        return _judged(candidate.plan, machine, fixed_micro, max_micro_batch)

    for i, setting in enumerate(settings):
        candidate = Candidate(setting)
        candidates.append(candidate)
        skipped = not_simulated(setting, candidates)
        if skipped:
            candidate.outcome, candidate.model_states_decide = skipped
            continue
        if (setting, rank) in ahead:
            candidate.plan = plan(job, setting, machine, ranks=[rank], known=[_used(ahead.pop((setting, rank)))])
        else:
            beside, what = [], ""
            if _slow(candidates) and not _said_without_engine(setting, candidates):
                following = _next_simulated(settings[i + 1:], candidates, not_simulated)
                checks = _checks_to_come(job, [judged(c) for c in candidates if c.plan is not None], ahead)
                # A more offloaded twin is simulated only where this setting does not fit (or frees room for a
                # larger micro-batch that may be faster): the winner's check is likelier to be needed.
                if following is not None and not (checks and _offload_free(following) == _offload_free(setting)):
                    beside, what = [(following, rank)], str(following)
                elif checks:
                    beside, what = checks, _checking(checks[0][0], [r for _, r in checks])
            say(f"simulating {setting}" + (f", and {what} beside it" if beside else ""))
            here, *there = _simulated_at_once(job, [(setting, rank), *beside])
            candidate.plan = plan(job, setting, machine, ranks=[rank], known=[_used(here)])
            ahead |= dict(zip(beside, there))
        if candidate.plan.fits:
            fits_with_less_offload.setdefault(_offload_free(setting), candidate.plan)
    for candidate in candidates:
        if candidate.plan is not None:
            at_its_micro_batch = judged(candidate)
            candidate.setting, candidate.outcome = at_its_micro_batch.setting, at_its_micro_batch.outcome
    viable = [c for c in candidates if c.plan is not None and not c.outcome]
    verified: dict[int, Plan] = {}  # id(candidate) -> its plan at every distinct rank, once checked
    chosen: Candidate | None = None
    while viable:
        best = _fastest(viable, verified)
        if id(best) in verified:  # checked, and still the fastest
            chosen = best
            break
        fitting = _verify(job, best.setting, machine, fixed_micro is None, say, best.plan, ahead)
        if fitting is None:
            best.outcome = "does not fit at every distinct rank, even at micro-batch 1"
            viable.remove(best)
            continue
        best.setting, verified[id(best)] = fitting.setting, fitting
    if chosen is None:
        return None, candidates
    chosen.outcome, result = "chosen", verified[id(chosen)]
    for candidate in viable:
        if candidate is not chosen:
            speed = _speed(candidate, verified)
            candidate.outcome = f"slower: {speed:,.0f} tokens/s per GPU against {result.tokens_per_second:,.0f}" \
                if round(math.log(speed), 3) < round(math.log(result.tokens_per_second), 3) else \
                "as fast, at more device memory"
    return result, candidates


def _offload_free(setting: Setting) -> tuple:
    """`setting` but for its offload: a setting with less offload that fits decides whether one with more is
    simulated (`_more_offload_skipped`)."""
    return setting.zero_stage, setting.hpz_partition_size, setting.gradient_checkpointing


def _said_without_engine(setting: Setting, candidates: list[Candidate]) -> bool:
    """Whether `setting`'s step will be said without running the engine, as an earlier candidate's was: stages 0-2
    of a model too large for the device whole."""
    return setting.zero_stage < 3 and any(r.said_without_engine for c in candidates if c.plan for r in c.plan.ranks)


def _judged(probe: Plan, machine: Machine, fixed_micro: int | None, max_micro_batch: int) -> Candidate:
    """A simulated candidate at the micro-batch its check would take, or with why it cannot fit (its `outcome`)."""
    judged = Candidate(probe.setting, probe)
    if not probe.fits_host:
        judged.outcome = (f"host memory: {probe.host_per_node / GB:.1f} GB a node, "
                          f"more than {machine.host_memory / GB:.0f} GB")
    elif not probe.fits_nvme:
        judged.outcome = (f"NVMe: {probe.nvme_per_node / GB:.1f} GB a node, "
                          f"more than {machine.nvme_capacity / GB:.0f} GB")
    elif fixed_micro is None:
        m = _largest_micro_batch(probe, machine, max_micro_batch)
        if m == 0:
            judged.outcome = _over(probe)
        else:
            judged.setting = replace(probe.setting, micro_batch=m)
    elif not probe.fits_device:
        judged.outcome = _over(probe)
    return judged


def _fastest(viable: list[Candidate], verified: dict[int, Plan]) -> Candidate:
    """The fastest of `viable`; speeds within 0.1% are a tie, which the smaller device peak wins."""
    return max(viable, key=lambda c: (round(math.log(_speed(c, verified)), 3), -c.plan.busiest.device_peak))


def _checks_to_come(job: Job, judged: list[Candidate], ahead: dict[tuple[Setting, int], RankStep | Exception]
                    ) -> list[tuple[Setting, int]]:
    """The first simulations `_verify` would run for the fastest of `judged` (the candidates simulated so far), were
    they the only candidates, one for each worker: worth simulating beside the last candidate, on cores that would
    otherwise wait. Its setting at its micro-batch, at its distinct ranks neither its probe nor `ahead` holds, the
    probe's rank first. Where a later candidate wins instead, or that micro-batch does not fit, their work is lost
    and the choice the same."""
    viable = [c for c in judged if not c.outcome]
    if not viable:
        return []
    best = _fastest(viable, {})
    probed = {r.rank for r in best.plan.ranks} if best.setting == best.plan.setting else set()
    return [(best.setting, r) for r in _probe_first(job)
            if r not in probed and (best.setting, r) not in ahead][:_workers.count()]


def _checking(setting: Setting, ranks: list[int]) -> str:
    return f"checking {setting} at rank {ranks[0]}" if len(ranks) == 1 else f"checking {setting} at ranks {ranks}"


def _not_simulated(setting: Setting, candidates: list[Candidate], fits_with_less_offload: dict[tuple, Plan],
                   machine: Machine, max_micro_batch: int, fixed_micro: int | None, choosing_checkpointing: bool
                   ) -> tuple[str, bool] | None:
    """Why `setting` need not be simulated, from the candidates considered before it, and whether its model states
    decide that; None where it must be (`choose`'s rules)."""
    key = _offload_free(setting)
    if setting.offload_optimizer != "none" and key in fits_with_less_offload:
        skipped = _more_offload_skipped(fits_with_less_offload[key], setting, machine, max_micro_batch, fixed_micro,
                                        candidates)
        if skipped:
            return f"not simulated: {skipped}", False
    checkpointed = setting.gradient_checkpointing and choosing_checkpointing
    twin = _twin_decided_by_model_states(candidates, setting, checkpointed)
    if twin is not None:
        return twin.outcome, True
    staying, by_model_states = _staying_on_device(candidates, setting, machine)
    staying = staying or _without_hpz_over(candidates, setting)
    if staying:
        return f"not simulated: {staying}", by_model_states
    if checkpointed:
        uncheckpointed = next(c for c in candidates if c.setting == replace(setting, gradient_checkpointing=False))
        if uncheckpointed.plan is not None and uncheckpointed.plan.busiest.model_states > machine.gpu_memory:
            return "not simulated: its model states alone exceed the device", True
    return None


def _slow(candidates: list[Candidate]) -> bool:
    """Whether a simulation of the job so far took PARALLEL_AFTER_S, or would have where its step was said without
    running the engine (`_simulation_seconds`), on a machine with a core to spare."""
    return _cores() > 1 and any(_simulation_seconds(r) >= PARALLEL_AFTER_S
                                for c in candidates if c.plan for r in c.plan.ranks)


def _simulation_seconds(rank: RankStep) -> float:
    """What simulating `rank` took; for a step said without running the engine (a model too large for the device
    whole, at stages 0-2), what running it would take, so that the first candidate simulated runs beside the next."""
    return rank.param_tensors * SECONDS_PER_PARAM_TENSOR if rank.said_without_engine else rank.seconds


def _next_simulated(later: list[Setting], candidates: list[Candidate], not_simulated: callable) -> Setting | None:
    """The first of `later` the rules would simulate if the candidate now being simulated told them nothing: worth
    simulating beside it, on a core that would otherwise wait. A result can only add reasons to skip, so the
    candidates between are skipped in any case; where the current candidate's result rules this one out too, its
    work is lost and the choice the same."""
    considered = list(candidates)
    for setting in later:
        skipped = not_simulated(setting, considered)
        if skipped is None:
            return setting
        considered.append(Candidate(setting, outcome=skipped[0], model_states_decide=skipped[1]))
    return None


def _speed(candidate: Candidate, verified: dict[int, Plan]) -> float:
    """Tokens per second per GPU: planned at every distinct rank where checked, else projected from the probe."""
    checked = verified.get(id(candidate))
    return checked.tokens_per_second if checked is not None else projected_tokens_per_second(candidate)


def _verify(job: Job, setting: Setting, machine: Machine, search: bool, say: callable, probe: Plan,
            ahead: dict[tuple[Setting, int], RankStep | Exception]) -> Plan | None:
    """`setting` planned at every distinct rank, the probe's rank first. Where that rank does not fit and the
    micro-batch is open (`search`), the next micro-batch tried is the largest that fits on the line through the two
    peaks it measured (the probe's and this one: activations grow linearly with the micro-batch); where another rank
    does not, half. Where the probe's simulation took PARALLEL_AFTER_S and the machine has a core for each distinct
    rank, the other ranks are simulated beside the probe's rank rather than after it, on cores that would otherwise
    wait: their work is lost only where it does not fit. (With fewer cores, some would run after the others in any
    case: on two, three 175B ranks at once took 2.4 times one's time, and one then two side by side 2.1.) Ranks
    simulated `ahead`, beside the last candidate (`_checks_to_come`), are not simulated again."""
    low = probe.ranks[0]  # the probe's rank at the probe's micro-batch
    every = distinct_ranks(job)
    at_once = low.seconds >= PARALLEL_AFTER_S and _cores() >= len(every) > 1
    while setting.micro_batch >= 1:
        at = _probe_first(job) if at_once else [low.rank]
        # A rank simulated ahead is used (and its error raised) only where one at a time would simulate it.
        known = [_used(ahead.pop((setting, r))) for r in at if (setting, r) in ahead]
        if probe.setting == setting:
            known += probe.ranks
        say(_checking(setting, at))
        checked = plan(job, setting, machine, ranks=at, known=known, at_once=at_once)
        first = Plan(job, setting, machine, checked.ranks[:1])
        if first.fits:
            if not at_once:
                say(_checking(setting, every))
            known = [_used(ahead.pop((setting, r))) for r in every if (setting, r) in ahead]
            result = plan(job, setting, machine, known=known + checked.ranks)
            if result.fits:
                return result
            next_micro = setting.micro_batch // 2
        else:
            next_micro = _on_the_line(probe.setting.micro_batch, low.device_peak, setting.micro_batch,
                                      first.busiest.device_peak, machine.gpu_memory)
        if not search or next_micro >= setting.micro_batch:
            return None
        setting = replace(setting, micro_batch=next_micro)
    return None


def _on_the_line(m1: int, peak1: int, m2: int, peak2: int, capacity: int) -> int:
    """The largest micro-batch below m2 whose peak, on the line through (m1, peak1) and (m2, peak2), fits."""
    if m2 == m1 or peak2 <= peak1:
        return m2 // 2
    slope = (peak2 - peak1) / (m2 - m1)
    return max(0, min(m2 - 1, m1 + int((capacity - peak1) // slope)))


def _twin_decided_by_model_states(candidates: list[Candidate], setting: Setting, checkpointed: bool
                                  ) -> Candidate | None:
    """The same setting without checkpointing (where `checkpointed`) or without hpZ, skipped for what its model
    states take: checkpointing does not change them, and hpZ only adds to them."""
    twins = [replace(setting, gradient_checkpointing=False)] if checkpointed else []
    if setting.hpz_partition_size > 1:
        twins.append(replace(setting, hpz_partition_size=1))
    return next((c for c in candidates if c.setting in twins and c.model_states_decide), None)


def _staying_on_device(candidates: list[Candidate], setting: Setting, machine: Machine) -> tuple[str | None, bool]:
    """Why offloading cannot make `setting` fit, from the same setting without offload measured (or without hpZ
    either, where that was not simulated): its activations and temporaries alone exceed the device; or (the optimizer
    offloaded, not the parameters) its parameters, and at stages 0-1 its gradients, which stay on the device, already
    do. None otherwise; and whether model states decide (the second reason)."""
    if setting.offload_optimizer == "none":
        return None, False
    # Without offload, with the same hpZ, or without it (hpZ changes no activation, and only adds parameters)
    twins = [replace(setting, offload_optimizer="none", offload_param="none", hpz_partition_size=hpz)
             for hpz in (setting.hpz_partition_size, 1)]
    unloaded = next((c.plan for twin in twins for c in candidates if c.plan is not None and c.setting == twin), None)
    if unloaded is None:
        return None, False
    rank = unloaded.busiest
    if rank.transient > machine.gpu_memory:
        return (f"its activations and temporaries alone ({rank.transient / GB:.3g} GB at the peak, measured without "
                f"offload) exceed the device; offloading model states cannot make it fit"), False
    if setting.offload_param != "none":
        return None, False
    held = rank.at_rest["device"]
    kinds = ["parameters"] + (["gradients"] if setting.zero_stage <= 1 else [])
    staying = sum(held[k] for k in kinds)
    if staying <= machine.gpu_memory:
        return None, False
    return (f"its {' and '.join(kinds)} alone ({staying / GB:.3g} GB, measured without offload) exceed the device; "
            f"offloading the optimizer cannot make it fit"), True


def _without_hpz_over(candidates: list[Candidate], setting: Setting) -> str | None:
    """Why hpZ cannot make `setting` fit: the same setting without hpZ, measured, does not fit the device, and hpZ
    only adds its secondary copy of the parameters (the gathers are the same size). None otherwise."""
    if setting.hpz_partition_size == 1:
        return None
    plain = next((c.plan for c in candidates if c.plan is not None and c.setting == replace(
        setting, hpz_partition_size=1)), None)
    if plain is None or plain.fits_device:
        return None
    return (f"without hpZ it takes {plain.busiest.device_peak / GB:.3g} GB at micro-batch {setting.micro_batch} "
            f"(measured), more than the device; hpZ only adds its secondary copy of the parameters")


def _over(probe: Plan) -> str:
    return (f"device memory: {probe.busiest.device_peak / GB:.3g} GB at micro-batch {probe.setting.micro_batch}, "
            f"more than {probe.machine.gpu_memory / GB:.3g} GB")


def projected_tokens_per_second(candidate: Candidate) -> float:
    """The probe's step at the candidate's micro-batch."""
    return _tokens_per_second_at(candidate.plan, candidate.setting.micro_batch)


def _tokens_per_second_at(probe: Plan, micro_batch: int, seconds: dict[str, float] | None = None) -> float:
    """The probe's step (or `seconds`, its compute and total) at `micro_batch`: compute grows with it; traffic, the
    host's step and NVMe's do not."""
    seconds = seconds or probe.step_seconds
    total = seconds["total"] + seconds["compute"] * (micro_batch / probe.setting.micro_batch - 1)
    return micro_batch * probe.job.seq_len / total if total else 0.0


PLAN_MISS = 0.10  # a measured peak this much above the plan's is reported
# What a CPU process's resident memory grows by in its first steps whatever the model: torch's code pages, the
# allocator's arenas, gloo's buffers (measured: 0.23 GB for the 3.3M gpt2-demo, 0.32 GB for a 44M GPT-2, 2 ranks).
# A GPU's allocator counts tensors only.
RSS_OVERHEAD = 512 * 2**20


def check_against_plan(planned: int, measured: int, rank: int, logger: logging.Logger,
                       by_rss: bool = False, said_by_this_rank: bool = False) -> bool:
    """Logs a run's measured peak beside its plan's: a warning where it exceeds it by more than PLAN_MISS (and
    RSS_OVERHEAD, measured `by_rss`), else both figures at rank 0 (or at this rank, `said_by_this_rank`). Returns
    whether it warned."""
    if measured <= planned * (1 + PLAN_MISS) + (RSS_OVERHEAD if by_rss else 0):
        if rank == 0 or said_by_this_rank:
            logger.info(f"rank {rank}: the step took {measured / GB:.3g} GB at its peak, the plan "
                        f"{planned / GB:.3g} GB")
        return False
    logger.warning(f"rank {rank}: the step took {measured / GB:.3g} GB at its peak, {measured / planned - 1:.0%} more "
                   f"than the plan's {planned / GB:.3g} GB (the auto settings were chosen for that figure): a longer "
                   f"run may run out of memory; give settings that take less (a higher stage, offload, a smaller "
                   f"batch, checkpointing)")
    return True
