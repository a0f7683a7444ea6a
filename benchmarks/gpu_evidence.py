"""The GPU evidence run: one command, one JSON and one markdown table, for the day a GPU is at hand.

  python -m benchmarks.gpu_evidence --out bench_out/gpu         # on a GPU machine, about 5-8 minutes on an H100
  python -m benchmarks.gpu_evidence --dry --out /tmp/gpu_dry    # anywhere: tiny sizes, gloo, the CPU simulation

What it runs, each part in a fresh process so that one part's allocator state is not the next one's:
  tests      tests/test_gpu.py under pytest (skipped in the dry mode, where it would only skip)
  sanitizer  its stream tests again under TORCH_CUDA_SANITIZER=1 (CUDA's stream sanitizer): every stage and
             offload configuration with each stream delayed, and NVMe offload
  systems    a GPT-2 of about 1.3B (width 2048, 24 blocks; `--dry`: the zoo's tiny one) trained by plain
             PyTorch (fp32 weights, bf16 autocast), by the engine at stages 2 and 3, with and without CPU offload
             (and the delayed update), and by FSDP2 and DeepSpeed (stages 2, 3, and 2 with its CPU offload) as
             references, each inside a one-rank NCCL process group so that the communication stream and the NCCL
             call shapes really run; every system's AdamW is the fused one where it runs on the GPU (DeepSpeed
             takes torch's AdamW as given). An offloaded system's extra step is timed phase by phase
             (forward and backward, the norm, the host update, the copies back and the all-gather); with
             `--memory_at_peak`, a system's extra step records the CUDA allocator's history and the table says
             what is alive at that step's peak, by where it was allocated. Per system: device memory allocated by
             `initialize` at its peak (torch.cuda.max_memory_allocated) beside the formula's model states, the
             per-step peak, `hf-zero plan`'s step peak for the same job beside max_memory_allocated over the
             timed steps (`planned`; stages 2 and 3, with and without offload), pinned host bytes before and
             after a save (hf_zero.runtime.device.pinned_host_bytes: the caching host
             allocator's torch.cuda.host_memory_stats and the blocks page-locked in place), host synchronisations
             per step (torch.cuda.set_sync_debug_mode counts the implicit ones), tokens per second and model
             TFLOPS (6Ψ per token plus attention, the Megatron-LM count).
In the dry mode the same code runs on CPU under hf_zero.runtime.device's simulation with a gloo group, so the run is
known to work before a GPU is at hand (tests/benchmarks/test_gpu_evidence.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEMS = {"torch": None,
           "stage2": {"zero_stage": 2},
           "stage2+cpu": {"zero_stage": 2, "offload_optimizer": "cpu"},
           # warm-up 0: every timed step runs delayed
           "stage2+cpu+delayed": {"zero_stage": 2, "offload_optimizer": "cpu", "delayed_param_update": True,
                                  "delayed_param_update_warmup": 0},
           "stage3": {"zero_stage": 3},
           "stage3+cpu": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
           # Each GPT2Block compiled (inductor; aot_eager in the dry mode), as torch+compile and fsdp2+compile compile
           # theirs: torch.compile on the block, before fully_shard for FSDP2 (torchtitan's order).
           "torch+compile": None,
           "stage2+compile": {"zero_stage": 2, "compile": True},
           "stage3+compile": {"zero_stage": 3, "compile": True}}
# The references, in the same invocation: FSDP2 (bf16 parameters, fp32 reduction, fused AdamW) and
# DeepSpeed (bf16, torch's AdamW; with offload its own DeepSpeedCPUAdam, as it requires), when it imports.
REFERENCES = {"fsdp2": None, "fsdp2+compile": None, "deepspeed2": {"stage": 2}, "deepspeed3": {"stage": 3},
              "deepspeed2+cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
# Where each reference keeps its model states, as the formula counts them.
REFERENCE_STATES = {"fsdp2": {"zero_stage": 3}, "fsdp2+compile": {"zero_stage": 3}, "deepspeed2": {"zero_stage": 2},
                    "deepspeed3": {"zero_stage": 3}, "deepspeed2+cpu": {"zero_stage": 2, "offload_optimizer": "cpu"}}
# Under CUDA's stream sanitizer (TORCH_CUDA_SANITIZER=1, which reports any kernel that touches memory another
# stream uses without an ordering between them): every stage and offload configuration in a one-rank NCCL group,
# with each stream delayed in turn (compute, comm, copy), and NVMe offload.
SANITIZED = ["-k", "nccl_group or nvme"]
GPT2_1_3B = {"n_embd": 2048, "n_head": 16, "n_layer": 24, "n_positions": 1024}
# The systems `hf-zero plan` plans: the engine's settings it chooses among (not compiled blocks or the delayed update).
PLANNED = ("stage2", "stage2+cpu", "stage3", "stage3+cpu")
# A step's peak that misses the plan's by more than this is reported, as `--zero_stage auto` reports a first step's.
PLAN_TOLERANCE = 0.10


def workload_model(dry: bool) -> tuple[str, dict]:
    """The model every system trains: the zoo's name and its overrides."""
    return ("gpt2-tiny", {}) if dry else ("gpt2-xl", GPT2_1_3B)


def model_flops_per_token(psi: int, n_layer: int, n_embd: int, seq: int) -> float:
    """Forward and backward: 6 per parameter, plus attention's 12 · layers · width · sequence (Megatron-LM)."""
    return 6 * psi + 12 * n_layer * n_embd * seq


def write_profile(train_step, ids: torch.Tensor, cuda: bool, path: Path) -> None:
    """One step under torch.profiler: the operators by device time and by host time, to see where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_step(ids)
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
                    + "\n" + averages.table(sort_by="cpu_time_total", row_limit=30))


# Where a frame is worth naming an allocation by: the systems' own code before the model's or torch's.
OWN_CODE = ("/hf_zero/", "/torch/distributed/fsdp/", "/deepspeed/")


def live_at_peak(trace: list[dict], resident: int, top: int = 12) -> dict:
    """Replays a CUDA caching allocator trace (torch.cuda.memory._snapshot()["device_traces"][i], recorded with Python
    stacks) from `resident` bytes allocated when it started: the peak of allocated bytes, as max_memory_allocated
    counts them (a block stops counting when its free is requested, even while a stream recorded on it keeps it from
    reuse; sizes as requested, so within the allocator's rounding of that), and what was alive then, summed by where
    it was allocated (the innermost frame in OWN_CODE, else the innermost one), largest first. Blocks allocated before
    the trace are "resident before the step"."""
    live: dict[int, tuple[int, str]] = {}
    resident_now = peak = now = resident
    at_peak: dict[int, tuple[int, str]] = {}
    resident_at_peak = resident
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            frames = event.get("frames", [])
            own = [f for f in frames if any(o in f["filename"] for o in OWN_CODE)]
            innermost = (own or frames or [None])[0]
            live[addr] = (size, "(no Python frame)" if innermost is None else
                          f"{innermost['filename'].rsplit('/site-packages/', 1)[-1]}:{innermost['line']} "
                          f"{innermost['name']}")
            now += size
        elif action == "free_requested":
            if addr in live:
                now -= live.pop(addr)[0]
            else:
                now -= size
                resident_now -= size
        if now > peak:
            peak, at_peak, resident_at_peak = now, dict(live), resident_now
    sites: dict[str, int] = {"resident before the step": resident_at_peak}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    largest = sorted(sites.items(), key=lambda item: -item[1])[:top]
    return {"peak_bytes": peak, "by_site": [{"site": site, "bytes": size} for site, size in largest]}


TRACE_ENTRIES = 2_000_000  # the allocator's history is a ring: a step that records more loses its first events


def memory_at_peak(train_step, ids: torch.Tensor) -> dict:
    """One more step with the CUDA allocator's history recorded: what is alive at its peak (`live_at_peak`), to see
    where stages 2-3 and FSDP2 part (31.5 against 28.9 GiB on an H100)."""
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=TRACE_ENTRIES, stacks="python")
    try:
        train_step(ids)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    if len(trace) >= TRACE_ENTRIES:
        return {"error": f"the step made more than {TRACE_ENTRIES} allocator events: its first ones were lost"}
    return {**live_at_peak(trace, resident), "max_memory_allocated": torch.cuda.max_memory_allocated()}


def formula_device_bytes(config: dict | None, psi: int) -> float:
    """Model states per device by the paper's formula (hf_zero.cli.estimate), one rank, bf16 with fp32 masters."""
    from hf_zero.cli.estimate import Setting, model_states

    if config is None:
        return 16 * psi  # plain mixed precision: fp32 weights, gradients and Adam's two moments
    setting = Setting(config["zero_stage"], 1, config.get("offload_optimizer", "none"),
                      config.get("offload_param", "none"))
    return sum(model_states(psi, setting)[0].values())


def one_system(name: str, dry: bool, steps: int, batch: int, seq: int, workdir: Path, profile: bool,
               trace_memory: bool = False) -> dict:
    """Trains one system in this process (a one-rank process group) and measures it."""
    import torch.distributed as dist

    import hf_zero
    import model_zoo
    from hf_zero.runtime.device import pinned_host_bytes
    from hf_zero.runtime.launch import free_port
    from hf_zero.zero.construct import SeededInit

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    zoo_name, overrides = workload_model(dry)
    cfg = model_zoo.config(zoo_name, **overrides)
    psi = model_zoo.parameter_count(zoo_name, **overrides)
    config = SYSTEMS.get(name)

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    def peak() -> int:
        return torch.cuda.max_memory_allocated() if cuda else 0

    def reset_peak() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    if config is not None and config["zero_stage"] == 3:
        with torch.device("meta"):
            model = model_zoo.build(zoo_name, **overrides)
        init_from = SeededInit(0)
    else:
        with torch.device(device):
            model = model_zoo.build(zoo_name, **overrides)
        init_from = None
    model.config.use_cache = False  # training: no KV cache, and the compiled blocks share one graph
    backend = "aot_eager" if dry else "inductor"
    if name.endswith("+compile") and config is None:
        for i, block in enumerate(model.transformer.h):
            model.transformer.h.register_module(str(i), torch.compile(block, backend=backend))
    before_init = allocated()
    reset_peak()
    start = time.perf_counter()
    engine = None
    if name in REFERENCES:
        train_step = reference_system(name, model, batch, cuda)
    elif config is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

        def train_step(ids: torch.Tensor) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        compiled = {"compile_backend": backend} if config.get("compile") else {}
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda),
                                    {**config, **compiled, "dtype": "bf16"}, init_from=init_from)

        def train_step(ids: torch.Tensor) -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    init_seconds = time.perf_counter() - start
    init_peak = peak() - before_init
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    reset_peak()
    start = time.perf_counter()
    train_step(ids)  # warm-up: kernels chosen, buffers allocated, blocks compiled
    first_step_seconds = time.perf_counter() - start
    warm_up_peak = peak()
    reset_peak()
    step_seconds, syncs = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            train_step(ids)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - start)
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    steady_step_peak = peak()  # a step with the optimizer's states made, as the plan's
    step_peak = max(warm_up_peak, steady_step_peak)
    pinned = {}
    if engine is not None and cuda and hasattr(torch.cuda, "host_memory_stats"):
        pinned["before_save"] = pinned_host_bytes()[0]
        with tempfile.TemporaryDirectory() as folder:
            engine.save_checkpoint(folder)
        pinned["after_save"] = pinned_host_bytes()[0]
    phases = offloaded_step_phases(engine, ids, cuda) if engine is not None and \
        engine.config.offload_optimizer != "none" and not engine.config.delayed_param_update else {}
    if profile:
        write_profile(train_step, ids, cuda, workdir / f"profile-{name}.txt")
    at_peak = memory_at_peak(train_step, ids) if trace_memory and cuda else {}
    median = sorted(step_seconds)[len(step_seconds) // 2]
    tokens = batch * seq
    dist.destroy_process_group()
    return {"system": name, "psi": psi,
            "formula_device_bytes": formula_device_bytes(config or REFERENCE_STATES.get(name), psi),
            "init_seconds": init_seconds, "init_peak_bytes": init_peak, "first_step_seconds": first_step_seconds,
            "step_peak_bytes": step_peak, "steady_step_peak_bytes": steady_step_peak, "median_step_seconds": median,
            "tokens_per_second": tokens / median,
            "model_tflops": model_flops_per_token(psi, cfg.n_layer, cfg.n_embd, seq) * tokens / median / 1e12,
            "host_syncs_per_step": sorted(syncs)[len(syncs) // 2], "pinned_bytes": pinned,
            "offloaded_step_seconds": phases, "memory_at_peak": at_peak}


def planned_step(name: str, dry: bool, batch: int, seq: int, workdir: Path) -> dict:
    """`hf-zero plan`'s step for system `name`: the same model, micro-batch, sequence, bf16 with fp32 masters and
    AdamW (fused on a GPU), on one rank of one GPU. Run here, outside the system's process: a plan simulates its own
    process group, and the measured process should hold nothing but its system."""
    import model_zoo
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import plan
    from hf_zero.plan.simulate import Job, Setting

    cuda = torch.cuda.is_available() and not dry
    zoo_name, overrides = workload_model(dry)
    folder = model_zoo.save_config(zoo_name, workdir / "planned_model", **overrides)
    capacity = torch.cuda.get_device_properties(0).total_memory if cuda else Machine().gpu_memory
    job = Job(folder, nodes=1, gpus_per_node=1, dtype="bf16", seq_len=seq, gpu_memory=capacity,
              optimizer_kwargs=json.dumps({"lr": 1e-5, "fused": cuda}))
    rank = plan(job, Setting(**SYSTEMS[name], micro_batch=batch), Machine(gpu_memory=capacity)).ranks[0]
    return {"step_peak_bytes": rank.device_peak, "psi": rank.params, "simulation_cpu_seconds": rank.seconds}


def reference_system(name: str, model: torch.nn.Module, batch: int, cuda: bool) -> Callable[[torch.Tensor], None]:
    """A training step of FSDP2 or DeepSpeed on `model` (built in fp32 on the device), bf16 with fp32 masters."""
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

        def fsdp_step(ids: torch.Tensor) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return fsdp_step
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asks for its launcher's variable; this is a one-rank group
    import deepspeed

    zero = REFERENCES[name]
    config = {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": dict(zero)}
    if "offload_optimizer" in zero:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def deepspeed_step(ids: torch.Tensor) -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return deepspeed_step


def offloaded_step_phases(engine, ids: torch.Tensor, cuda: bool) -> dict[str, float]:
    """One more step of an offloaded engine, timed phase by phase with the device synchronised between them (so
    the phases' sum exceeds a step, whose phases overlap): forward and backward with the chunks' landing, the
    gradient norm, the host update (the CPU Adam, the copies back queued chunk by chunk), and the rest of the step
    (the copies back landing, the all-gather)."""
    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    backend = engine.sharded_optimizer.backend
    real_step, host_update = backend.step, []

    def timed_step(coef: float, grads) -> None:
        start = time.perf_counter()
        real_step(coef, grads)
        host_update.append(time.perf_counter() - start)

    backend.step = timed_step
    try:
        start = now()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        backward = now()
        engine.compute_grad_norm()
        norm = now()
        engine.step()
        end = now()
    finally:
        backend.step = real_step
    return {"forward_backward": backward - start, "norm": norm - backward, "host_update": host_update[0],
            "copies_back_and_all_gather": end - norm - host_update[0]}


def in_fresh_process(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_evidence", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for evidence.json and evidence.md")
    p.add_argument("--dry", action="store_true", help="tiny sizes on CPU under the simulation, gloo")
    p.add_argument("--parts", nargs="+", default=["tests", "sanitizer", "systems"],
                   choices=["tests", "sanitizer", "systems"])
    p.add_argument("--systems", nargs="+", default=[*SYSTEMS, *REFERENCES], choices=[*SYSTEMS, *REFERENCES])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--profile", nargs="*", default=[], choices=[*SYSTEMS, *REFERENCES],
                   help="systems whose extra step runs under torch.profiler (profile-<system>.txt)")
    p.add_argument("--memory_at_peak", nargs="*", default=[], choices=[*SYSTEMS, *REFERENCES],
                   help="systems whose extra step records the CUDA allocator's history: what is alive at its peak")
    p.add_argument("--one_system", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_system:
        result = one_system(args.one_system, args.dry, args.steps, args.batch, args.seq, args.out,
                            args.one_system in args.profile, args.one_system in args.memory_at_peak)
        print("RESULT " + json.dumps(result), flush=True)
        return
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if args.dry:
        env["HF_ZERO_SIMULATE_ASYNC"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
    evidence: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry
                      else "cpu (dry run)", "torch": torch.__version__, "parts": {}}
    for part, extra_env, selection in (("tests", {}, []), ("sanitizer", {"TORCH_CUDA_SANITIZER": "1"}, SANITIZED)):
        if part in args.parts and not args.dry:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                   "tests/test_gpu.py", *selection], cwd=ROOT, env={**env, **extra_env},
                                  capture_output=True, text=True, timeout=900)
            evidence["parts"][part] = {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:],
                                       "tail": done.stdout[-3000:] + done.stderr[-2000:]}
            print(f"{part}:", evidence["parts"][part]["summary"], flush=True)
    if "systems" in args.parts:
        rows = []
        for name in args.systems:
            done = in_fresh_process(["--out", str(args.out), "--one_system", name, "--steps", str(args.steps),
                                     "--batch", str(args.batch), "--seq", str(args.seq), "--profile", *args.profile,
                                     "--memory_at_peak", *args.memory_at_peak]
                                    + (["--dry"] if args.dry else []), env, 900)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                rows.append({"system": name, "error": (done.stdout + done.stderr)[-3000:]})
            else:
                rows.append(json.loads(lines[-1][len("RESULT "):]))
            if name in PLANNED and "error" not in rows[-1]:
                try:  # a plan that fails costs its column, not the measurements
                    rows[-1]["planned"] = planned_step(name, args.dry, args.batch, args.seq, args.out)
                except Exception as error:  # noqa: BLE001
                    rows[-1]["planned"] = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(rows[-1])[:3000], flush=True)
        evidence["parts"]["systems"] = rows
    (args.out / "evidence.json").write_text(json.dumps(evidence, indent=1))
    (args.out / "evidence.md").write_text(markdown(evidence))
    print(markdown(evidence))


def markdown(evidence: dict) -> str:
    gib = 2 ** 30
    lines = [f"Device: {evidence['device']}, torch {evidence['torch']}", ""]
    for part, what in (("tests", "tests/test_gpu.py"), ("sanitizer", "under TORCH_CUDA_SANITIZER=1")):
        tests = evidence["parts"].get(part)
        if tests:
            lines += [f"{what}: {' '.join(tests['summary'])} (exit {tests['returncode']})", ""]
    rows = evidence["parts"].get("systems", [])
    if rows:
        lines += ["| system | Ψ | model states by the formula (GiB) | initialize: device peak (GiB) | step peak (GiB) "
                  "| tokens/s | model TFLOPS | first step (s; compilation in it) | host syncs/step "
                  "| pinned before / after save (GiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['system']} | failed: {r['error'][-200:]!r} |")
                continue
            pinned = r["pinned_bytes"]
            pinned_text = (f"{pinned['before_save'] / gib:.2f} / {pinned['after_save'] / gib:.2f}" if pinned else "-")
            lines.append(f"| {r['system']} | {r['psi'] / 1e9:.2f}B | {r['formula_device_bytes'] / gib:.2f} "
                         f"| {r['init_peak_bytes'] / gib:.2f} "
                         f"| {r['step_peak_bytes'] / gib:.2f} | {r['tokens_per_second']:.0f} | {r['model_tflops']:.1f} "
                         f"| {r['first_step_seconds']:.1f} | {r['host_syncs_per_step']} | {pinned_text} |")
    planned = [r for r in rows if r.get("planned")]
    if planned:
        lines += ["", ("`hf-zero plan`'s step peak against the allocator's (max_memory_allocated over the timed "
                       f"steps, after the warm-up; a miss over {PLAN_TOLERANCE:.0%} is marked):"), "",
                  "| system | planned (GiB) | measured (GiB) | measured / planned |", "|---|---|---|---|"]
        for r in planned:
            if "error" in r["planned"]:
                lines.append(f"| {r['system']} | plan failed: {r['planned']['error'][-200:]!r} | | |")
                continue
            plan_bytes, measured = r["planned"]["step_peak_bytes"], r["steady_step_peak_bytes"]
            ratio = measured / plan_bytes if measured else None
            said = "- (no GPU)" if ratio is None else \
                f"{ratio:.3f}{' **missed**' if abs(ratio - 1) > PLAN_TOLERANCE else ''}"
            lines.append(f"| {r['system']} | {plan_bytes / gib:.2f} | {measured / gib:.2f} | {said} |")
    phased = [r for r in rows if r.get("offloaded_step_seconds")]
    if phased:
        lines += ["", "An offloaded step, phase by phase (seconds; the device synchronised between phases):", "",
                  "| system | forward and backward | norm | host update | copies back and all-gather |",
                  "|---|---|---|---|---|"]
        for r in phased:
            s = r["offloaded_step_seconds"]
            lines.append(f"| {r['system']} | {s['forward_backward']:.3f} | {s['norm']:.3f} | {s['host_update']:.3f} "
                         f"| {s['copies_back_and_all_gather']:.3f} |")
    for r in (r for r in rows if r.get("memory_at_peak")):
        m = r["memory_at_peak"]
        if "error" in m:
            lines += ["", f"{r['system']}: what is alive at the step's peak: {m['error']}"]
            continue
        lines += ["", f"{r['system']}: alive at the step's peak, {m['peak_bytes'] / gib:.2f} GiB replayed "
                      f"(max_memory_allocated {m['max_memory_allocated'] / gib:.2f} GiB), by where it was "
                      f"allocated:", "",
                  "| GiB | allocated at |", "|---|---|"]
        lines += [f"| {site['bytes'] / gib:.2f} | `{site['site']}` |" for site in m["by_site"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
