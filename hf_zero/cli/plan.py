"""`hf-zero plan`: which setting fits, and how fast it runs, before any GPU is rented. The engine's own code runs as
the target world's ranks on this CPU (hf_zero.plan), and the plan reports each rank's memory at the step's peak by
kind, the bytes it sends over intra-node and inter-node links, and a modelled step time. Without --zero_stage (or
with auto) it picks the fastest setting that fits among stages, CPU offload, hpZ, checkpointing and micro-batches,
and lists the candidates with why each lost. GB = 1e9 bytes."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from hf_zero.plan.machine import GB, KEYS, Machine
from hf_zero.settings.config import offload_conflict, offloads_to_check

if TYPE_CHECKING:
    from hf_zero.plan.planner import Candidate, Plan
    from hf_zero.plan.simulate import Job


def add_arguments(parser: argparse.ArgumentParser, count: type, size: type) -> None:
    parser.add_argument("--model", required=True, help="a model_zoo name (python -c 'import model_zoo; "
                        "print(model_zoo.list())'), or a folder or cached Hub model with a config.json")
    parser.add_argument("--nodes", type=count, default=1, help="machines (default 1)")
    parser.add_argument("--gpus_per_node", type=count, default=8, help="GPUs on each machine (default 8)")
    parser.add_argument("--gpu_memory", type=size, default="80GB", help="memory of each GPU (default 80GB)")
    parser.add_argument("--host_memory", type=size, default="1000GB", help="host memory of each machine "
                        "(default 1000GB)")
    parser.add_argument("--nvme", type=size, default=0, help="NVMe of each machine for ZeRO-Infinity's files "
                        "(default: none, and offload to NVMe is not considered)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--seq_len", type=count, help="tokens per sequence (default: the model's longest, at most "
                        "1024)")
    parser.add_argument("--micro_batch", type=count, help="sequences per GPU per step (default: the largest that "
                        "fits, up to --max_micro_batch)")
    parser.add_argument("--max_micro_batch", type=count, default=64)
    parser.add_argument("--sample", metavar="FILE.json", help="one training sample's tensors, as {name: {\"shape\": "
                        "[...], \"dtype\": \"int64\", \"high\": N}} (the shape without the batch dimension; "
                        "integers are drawn below high). ZeroTrainer's --zero_stage auto writes it from its first "
                        "batch. Default: a language model's input_ids and labels of --seq_len tokens")
    parser.add_argument("--adapter", metavar="FOLDER", help="a peft adapter around the model: the folder peft saved "
                        "it in (its adapter_config.json); only what it trains is trained")
    parser.add_argument("--adapter_name", default="default", help="the name peft gives the adapter (its "
                        "parameters' names hold it; default: peft's, default)")
    parser.add_argument("--frozen", metavar="FILE.json", help="a JSON list of the parameters that do not train (the "
                        "names of model.named_parameters(), the adapter's around it); every other one trains. "
                        "ZeroTrainer's --zero_stage auto writes it from its model")
    parser.add_argument("--optimizer", default="torch.optim.AdamW", metavar="CLASS", help="the optimizer's class, "
                        "by its module's name and its own (default torch.optim.AdamW; torch.optim.SGD, "
                        "transformers.optimization.Adafactor, lion_pytorch.Lion, ...), imported here. ZeroTrainer's "
                        "--zero_stage auto gives its own")
    parser.add_argument("--optimizer_folder", metavar="FOLDER", help="where --optimizer's module is, if Python would "
                        "not find it (a module beside the script; looked in after the installed packages). "
                        "ZeroTrainer's --zero_stage auto gives it")
    parser.add_argument("--optimizer_kwargs", default='{"lr": 0.0001}', metavar="JSON", help="its keyword arguments, "
                        "as a JSON object (default {\"lr\": 0.0001})")
    parser.add_argument("--engine_settings", default="{}", metavar="JSON", help="the engine's other settings, as a "
                        "JSON object of its names (reduce_bucket_size, prefetch_bucket_size, quantized_weights, ...: "
                        "hf_zero.settings.config.ZeroConfig); the stage, offloads, hpZ and dtype are flags of their "
                        "own, and a plan runs the model eager")
    parser.add_argument("--zero_stage", default="auto", help="auto (default), a stage 0-3, or the stages to choose "
                        "among, as 1,2,3")
    parser.add_argument("--offload_optimizer", choices=("auto", "none", "cpu", "nvme"), default="auto")
    parser.add_argument("--offload_param", choices=("auto", "none", "cpu", "nvme"), default="auto")
    parser.add_argument("--hpz_partition_size", type=count, help="ZeRO++ hpZ at stage 3 (default: 1, or a node's "
                        "GPUs when that is faster)")
    parser.add_argument("--gradient_checkpointing", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw each simulated candidate's memory per GPU by kind "
                        "against the device's capacity, and its speed (needs matplotlib: pip install hf_zero[plot])")
    machine = parser.add_argument_group("the machine's speed (the step-time model; defaults: A100 nodes)")
    for f in fields(Machine):
        if f.name not in ("gpu_memory", "host_memory", "nvme_capacity"):
            machine.add_argument(f"--{f.name}", type=float, default=f.default, help=f"(default {f.default})")


def fixed_settings(args: argparse.Namespace) -> dict:
    fixed: dict = {}
    if args.zero_stage != "auto":
        stages = tuple(int(stage) for stage in args.zero_stage.split(","))
        fixed["zero_stage"] = stages[0] if len(stages) == 1 else stages
    for key in ("offload_optimizer", "offload_param"):
        if getattr(args, key) != "auto":
            fixed[key] = getattr(args, key)
    if args.hpz_partition_size is not None:
        fixed["hpz_partition_size"] = args.hpz_partition_size
    if args.gradient_checkpointing != "auto":
        fixed["gradient_checkpointing"] = args.gradient_checkpointing == "true"
    if args.micro_batch is not None:
        fixed["micro_batch"] = args.micro_batch
    return fixed


def check(args: argparse.Namespace) -> str | None:
    """The first flag that cannot be planned, said as a sentence naming it; None when all can."""
    if args.plot:
        if not args.plot.lower().endswith((".png", ".svg", ".pdf")):
            return f"--plot must name a .png, .svg or .pdf file; got {args.plot}"
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install 'hf_zero[plot]'"
    stages = ["0", "1", "2", "3"] if args.zero_stage == "auto" else args.zero_stage.split(",")
    if not set(stages) <= {"0", "1", "2", "3"} or len(set(stages)) != len(stages):
        return f"--zero_stage must be auto, a stage 0-3, or stages such as 1,2,3; got {args.zero_stage}"
    if args.hpz_partition_size is not None and args.hpz_partition_size > 1:
        if "3" not in stages:
            return f"--hpz_partition_size needs --zero_stage 3; got {args.zero_stage}"
        if args.gpus_per_node % args.hpz_partition_size:
            return (f"--hpz_partition_size must divide --gpus_per_node ({args.gpus_per_node}); got "
                    f"{args.hpz_partition_size}")
    # The engine's own rule, with an `auto` offload at the value it is chosen from (where the other is given, the
    # same place), at the stage given or at stage 3, where every offload is allowed.
    given = {key: getattr(args, key) for key in ("offload_optimizer", "offload_param") if getattr(args, key) != "auto"}
    offloads = given | offloads_to_check(given, [key for key in ("offload_optimizer", "offload_param")
                                                 if key not in given])
    stage = int(args.zero_stage) if args.zero_stage in ("0", "1", "2", "3") else 3
    conflict = offload_conflict(stage, offloads["offload_optimizer"], offloads["offload_param"], lambda key: f"--{key}")
    if conflict:
        return conflict
    if args.offload_param == "cpu" and args.offload_optimizer == "none":
        return "--offload_param cpu is planned with --offload_optimizer cpu; got --offload_optimizer none"
    to_nvme = [f"--{key} nvme" for key in ("offload_optimizer", "offload_param") if getattr(args, key) == "nvme"]
    if to_nvme and not args.nvme:
        return f"{to_nvme[0]} needs --nvme, the NVMe of each machine (such as --nvme 3.8TB)"
    for flag, read in (("sample", read_sample), ("frozen", read_frozen)):  # files, read into what the plan takes
        if getattr(args, flag):
            try:
                setattr(args, flag, read(getattr(args, flag)))
            except (OSError, ValueError) as error:
                return f"--{flag} {getattr(args, flag)}: {error}"
    problem = optimizer_problem(args.optimizer, args.optimizer_kwargs, args.optimizer_folder)
    if problem:
        return problem
    problem = engine_settings_problem(args.engine_settings)
    if problem:
        return f"--engine_settings {problem}"
    if args.adapter:
        try:
            from peft import PeftConfig

            PeftConfig.from_pretrained(args.adapter)
        except (OSError, ValueError, TypeError) as error:
            return f"--adapter {args.adapter}: not a folder holding a peft adapter_config.json ({error})"
    return None


def optimizer_problem(name: str, kwargs: str, folder: str | None = None) -> str | None:
    """What is wrong with --optimizer, --optimizer_folder and --optimizer_kwargs, or None: the class must be
    importable by its name (from the folder, where Python would not find it) with its code where only this user or
    root can write, and take the arguments (tried on one parameter of one element)."""
    from hf_zero.plan.simulate import optimizer_class, probe_optimizer

    if folder is not None and not Path(folder).is_dir():
        return f"--optimizer_folder {folder} is not a folder"
    try:
        optimizer_class(name, folder)
    except ValueError as error:
        return f"--optimizer: {error}"
    try:
        if not isinstance(json.loads(kwargs), dict):
            raise ValueError("not an object")
    except ValueError as error:
        return f"--optimizer_kwargs must be a JSON object such as {{\"lr\": 0.0001}}; got {kwargs} ({error})"
    try:
        probe_optimizer(name, kwargs, folder)
    except Exception as error:  # a class of another library may raise anything for settings it refuses
        return f"--optimizer_kwargs {kwargs}: {name} does not take them ({str(error) or type(error).__name__})"
    return None


PLAN_FLAGS = ("zero_stage", "dtype", "offload_optimizer", "offload_param", "hpz_partition_size")


def engine_settings_problem(text: str) -> str | None:
    """What is wrong with --engine_settings, or None: each a setting of the engine's that the plan does not set, and
    together valid at some stage (the plan then chooses among the settings the engine takes with them)."""
    from hf_zero.settings.config import SET_BY_THE_PLAN, ZeroConfig, ZeroConfigError, did_you_mean, stages_allowed

    try:
        settings = json.loads(text)
    except ValueError as error:
        return f"must be a JSON object; got {text} ({error})"
    if not isinstance(settings, dict):
        return f"must be a JSON object; got {text}"
    known = {f.name for f in fields(ZeroConfig)} - set(SET_BY_THE_PLAN)
    for key in settings:
        if key in SET_BY_THE_PLAN:
            return f"sets {key}, which " + ("a plan does not (it runs the model eager)" if key.startswith("compile")
                                            else f"is a flag of its own (--{key})" if key in PLAN_FLAGS else
                                            "the plan sets from the job")
        if key not in known:
            return f"names no engine setting: {key}{did_you_mean(key, known)}"
    if not stages_allowed(settings):
        try:
            ZeroConfig(**settings).validate()
        except (ZeroConfigError, TypeError) as error:
            return str(error)
    return None


def read_frozen(path: str) -> tuple[str, ...]:
    """--frozen's file as Job.frozen; ValueError saying what is wrong."""
    with open(path) as f:
        names = json.load(f)
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError("expected a JSON list of parameter names")
    return tuple(names)


def read_sample(path: str) -> tuple[tuple[str, tuple[int, ...], str, int], ...]:
    """--sample's file as Job.sample; ValueError saying what is wrong."""
    import torch

    with open(path) as f:
        tensors = json.load(f)
    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("expected an object of one or more tensors")
    sample = []
    for name, spec in tensors.items():
        shape, dtype, high = (spec.get(key) if isinstance(spec, dict) else None for key in ("shape", "dtype", "high"))
        if not (isinstance(shape, list) and all(isinstance(n, int) and n > 0 for n in shape)):
            raise ValueError(f"{name}'s shape must be a list of positive integers; got {shape!r}")
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"{name}'s dtype must name a torch dtype (int64, float32, ...); got {dtype!r}")
        if not (isinstance(high, int) and high > 0):
            raise ValueError(f"{name}'s high must be a positive integer; got {high!r}")
        sample.append((name, tuple(shape), dtype, high))
    return tuple(sample)


def run(args: argparse.Namespace) -> int:
    from hf_zero.plan.models import model_class, model_config
    from hf_zero.plan.planner import choose, distinct_ranks, plan
    from hf_zero.plan.simulate import Job, Setting

    config = model_config(args.model)
    model_class(args.model)  # a class transformers has, before anything is simulated
    longest = next((getattr(c, k) for c in (config, config.get_text_config()) for k in
                    ("n_positions", "max_position_embeddings") if getattr(c, k, None)), 1024)
    sample_length = next((shape[-1] for name, shape, *_ in args.sample or () if name == "input_ids" and shape), None)
    seq_len = args.seq_len or sample_length or min(1024, longest)
    if seq_len > longest:
        raise ValueError(f"--seq_len {seq_len} is longer than {args.model} takes ({longest} positions)")
    job = Job(args.model, args.nodes, args.gpus_per_node, args.dtype, seq_len, args.gpu_memory, args.sample or (),
              adapter=args.adapter, adapter_name=args.adapter_name, frozen=args.frozen, optimizer=args.optimizer,
              optimizer_folder=args.optimizer_folder, optimizer_kwargs=args.optimizer_kwargs,
              engine_settings=args.engine_settings)
    machine = Machine(args.gpu_memory, args.host_memory, nvme_capacity=args.nvme,
                      **{f.name: getattr(args, f.name) for f in fields(Machine)
                         if f.name not in ("gpu_memory", "host_memory", "nvme_capacity")})
    fixed = fixed_settings(args)
    say = (lambda line: None) if args.json else (lambda line: print(f"  {line}", flush=True))
    if {"zero_stage", "offload_optimizer", "offload_param", "gradient_checkpointing", "micro_batch"} <= fixed.keys() \
            and isinstance(fixed["zero_stage"], int):
        setting = Setting(**fixed)
        say(f"simulating {setting} at ranks {distinct_ranks(job)}")
        chosen, candidates = plan(job, setting, machine), []
    else:
        chosen, candidates = choose(job, machine, fixed, args.max_micro_batch, say)
    if args.plot:
        plot(args.plot, job, machine, chosen, candidates)
    if args.json:
        fitting = chosen is not None and chosen.fits
        what_would = {} if fitting else {"what_would": _what_would(
            job, machine, [chosen] if chosen is not None else [c.plan for c in candidates if c.plan])}
        print(json.dumps({**(chosen.as_json() if chosen else {"fits": False}), **what_would,
                          "candidates": [{"setting": str(c.setting), "outcome": c.outcome} for c in candidates]},
                         indent=2))
    else:
        print(report(job, machine, chosen, candidates))
    return 0 if chosen is not None and chosen.fits else 1


def report(job: Job, machine: Machine, chosen: Plan | None, candidates: list[Candidate]) -> str:
    from hf_zero.plan.planner import probe_rank, projected_tokens_per_second

    lines = [f"{job.model} on {job.nodes} node(s) x {job.gpus_per_node} GPU(s) of {machine.gpu_memory / GB:.3g} GB, "
             f"{job.dtype}, {job.seq_len} tokens a sequence"]
    if candidates:
        lines += ["", f"Candidates: memory at micro-batch 1 (or the one given) on rank {probe_rank(job)}; tokens/s "
                  "projected at the candidate's micro-batch", "",
                  "| candidate | device GB at peak | host GB a node | NVMe GB a node | tokens/s per GPU | outcome |",
                  "|---|---|---|---|---|---|"]
        for c in candidates:
            p = c.plan
            if p is None:
                lines.append(f"| {c.setting} | | | | | {c.outcome} |")
                continue
            speed = projected_tokens_per_second(c)  # 0: not run (stages 0-2 whose parameters alone overflow)
            lines.append(f"| {c.setting} | {p.busiest.device_peak / GB:.3g} | "
                         f"{p.host_per_node / GB:.3g} | {p.nvme_per_node / GB:.3g} | "
                         f"{f'{speed:,.0f}' if speed else ''} | {c.outcome} |")
    if chosen is None:
        lines += ["", "nothing fits: " + _what_would(job, machine, [c.plan for c in candidates if c.plan])]
        return "\n".join(lines)
    rank = chosen.busiest
    lines += ["", f"{'chosen' if candidates else 'planned'}: {chosen.setting} "
              f"({'fits' if chosen.fits else 'does not fit'})",
              f"Ψ = {rank.params / 1e9:.3f}B parameters; rank {rank.rank} (of ranks {[r.rank for r in chosen.ranks]} "
              f"simulated) at the step's peak:",
              "| where | " + " | ".join(KEYS) + " | total |", "|---|" + "---|" * (len(KEYS) + 1)]
    for where, held in (("device", rank.device), ("host", rank.host)):
        lines.append(f"| {where} | " + " | ".join(f"{held[k] / GB:.3g}" for k in KEYS) +
                     f" | {sum(held.values()) / GB:.3g} |")
    if chosen.nvme_per_node:
        lines.append(f"NVMe: {max(r.nvme_file_bytes for r in chosen.ranks) / GB:.3g} GB of files a rank, "
                     f"{chosen.nvme_per_node / GB:.3g} GB a node")
    traffic = chosen.traffic()
    seconds = chosen.step_seconds
    lines += [f"sent per step by the busiest rank: intra-node {traffic['intra-node'] / GB:.3g} GB, inter-node "
              f"{traffic['inter-node'] / GB:.3g} GB",
              f"step: {seconds['total']:.3g} s (compute {seconds['compute']:.3g}, network {seconds['network']:.3g}, "
              f"copies {seconds['copies']:.3g}, host {seconds['host']:.3g}, NVMe {seconds['nvme']:.3g}; nothing "
              f"overlapped), {chosen.tokens_per_second:,.0f} tokens/s per GPU"]
    if not chosen.fits:
        lines.append("does not fit: " + _what_would(job, machine, [chosen]))
    return "\n".join(lines)


def _what_would(job: Job, machine: Machine, plans: list[Plan]) -> str:
    """What would make the least-memory of these plans fit."""
    if not plans:
        return "no candidate could be simulated"
    least = min(plans, key=lambda p: p.busiest.device_peak)
    rank = least.busiest
    needs = []
    if rank.device_peak > machine.gpu_memory:
        needs.append(_device_needs(job, machine, least))
    if not least.fits_host:
        nvme = "" if machine.nvme_capacity else (" (or NVMe for the offloaded states: hf-zero plan's --nvme; in a run, "
                                               "an NVMe folder with the offloads left to auto)")
        needs.append(f"more host memory: {least.host_per_node / GB:.1f} GB a node{nvme}")
    if not least.fits_nvme:
        needs.append(f"more NVMe: {least.nvme_per_node / GB:.1f} GB a node")
    return f"the least-memory candidate ({least.setting}) needs " + "; or ".join(needs)


def _device_needs(job: Job, machine: Machine, least: Plan) -> str:
    """What would bring this plan's device peak under the GPU's memory: each change that alone would remove more
    than the overflow, or else the largest."""
    rank, stage = least.busiest, least.setting.zero_stage
    at_rest, overflow = rank.at_rest["device"], rank.device_peak - machine.gpu_memory
    # What the stage keeps whole on every GPU, whatever their number: stage 1 partitions the optimizer's states,
    # stage 2 the gradients too, stage 3 the parameters too.
    whole = [kind for kind, partitioned_from in (("optimizer_states", 1), ("gradients", 2), ("parameters", 3))
             if stage < partitioned_from]
    kept_whole = sum(at_rest[kind] for kind in whole)
    # What the step holds beyond the model states at rest: its temporaries (the gradients' fp32 copy for the update,
    # buckets, gathered parameters), apart from the activations.
    during_step = {kind: held - at_rest.get(kind, 0) if kind in ("parameters", "gradients", "optimizer_states")
                   else held for kind, held in rank.device.items() if kind != "activations"}
    partitioned = rank.model_states - kept_whole
    steps_own = ", ".join(f"{kind.replace('_', ' ')} {held / GB:.3g} GB" for kind, held in
                          sorted(during_step.items(), key=lambda item: -item[1]) if held >= 0.01 * rank.device_peak)
    changes = [  # (bytes the change could remove at most, what to say)
        (rank.device["activations"], f"a shorter sequence or checkpointing: activations take "
                                     f"{rank.device['activations'] / GB:.3g} GB"),
        (sum(during_step.values()), f"a setting that holds less during the step (offload, a higher --zero_stage, "
                                    f"smaller buckets): beside the model states at rest it holds "
                                    f"{steps_own or 'little'}")]
    if stage < 3:
        kinds = ", ".join(kind.replace("_", " ") for kind in whole)
        changes.append((kept_whole, f"a higher --zero_stage: at stage {stage} every GPU keeps its {kinds} whole "
                                    f"({kept_whole / GB:.3g} GB at any number of GPUs)"))
    if partitioned:
        changes.append((partitioned, f"more GPUs: its model states alone take {rank.model_states / GB:.3g} GB of each "
                                     f"GPU's {machine.gpu_memory / GB:g} GB at {job.world_size} GPUs, and stage "
                                     f"{stage} divides {partitioned / GB:.3g} GB of them by the GPU count"))
    enough = [said for removes, said in changes if removes > overflow]
    largest = max(changes, key=lambda change: change[0])[1]
    return (f"{'; or '.join(enough or [largest])} (the peak is {rank.device_peak / GB:.3g} GB of "
            f"{machine.gpu_memory / GB:g} GB)")


def plot(path: str, job: Job, machine: Machine, chosen: Plan | None, candidates: list) -> None:
    """Each simulated candidate's device memory per GPU by kind at the step's peak, stacked, against the device's
    capacity (the way the ZeRO paper's Figure 1 sets the stages side by side), its host memory per node by kind
    against the host's, and its modelled step time at its micro-batch (labelled with the tokens/s per GPU the
    candidates table gives it). An SVG keeps its text as text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_zero.plan.planner import projected_tokens_per_second

    # (setting, its plan, outcome, tokens/s per GPU): each simulated candidate, or the one setting planned
    shown = [(c.setting, c.plan, c.outcome, projected_tokens_per_second(c)) for c in candidates if c.plan is not None]
    if not shown and chosen is not None:
        shown = [(chosen.setting, chosen, "planned", chosen.tokens_per_second)]
    labels = [str(setting).replace(", ", "\n") for setting, *_ in shown]
    figure, (memory, host, speed) = plt.subplots(1, 3, figsize=(6 + 1.6 * len(shown), 5.5),
                                                  gridspec_kw={"width_ratios": [3, 1.5, 1.5]})
    device_bottom, host_bottom = [0.0] * len(shown), [0.0] * len(shown)
    for number, kind in enumerate(KEYS):
        heights = [p.busiest.device[kind] / GB for _, p, *_ in shown]
        memory.bar(labels, heights, bottom=device_bottom, label=kind.replace("_", " "), color=f"C{number}")
        device_bottom = [b + h for b, h in zip(device_bottom, heights)]
        # a node's ranks, each holding what the simulated rank with the most host memory holds (Plan.host_per_node)
        heights = [p.host_busiest.host[kind] * job.gpus_per_node / GB for _, p, *_ in shown]
        host.bar(labels, heights, bottom=host_bottom, color=f"C{number}")
        host_bottom = [b + h for b, h in zip(host_bottom, heights)]
    memory.axhline(machine.gpu_memory / GB, color="black", linestyle="--", label="device capacity")
    memory.set_ylabel("GB per GPU at the step's peak")
    memory.set_title(f"{job.model}, {job.nodes} x {job.gpus_per_node} GPUs")
    memory.legend(fontsize=7)
    host.axhline(machine.host_memory / GB, color="black", linestyle="--")
    host.set_ylabel("host GB per node at the step's peak")
    seconds = [setting.micro_batch * job.seq_len / tokens if tokens else 0.0 for setting, _, _, tokens in shown]
    steps = speed.bar(labels, seconds,
                      color=["tab:green" if outcome == "chosen" else "tab:blue" for _, _, outcome, _ in shown])
    speed.bar_label(steps, labels=[f"{tokens:,.0f} tokens/s" for *_, tokens in shown], fontsize=6)
    speed.set_ylabel("step time, s (modelled, at its micro-batch)")
    for axis in (memory, host, speed):
        axis.tick_params(axis="x", labelsize=6, rotation=90)
    figure.tight_layout()
    with plt.rc_context({"svg.fonttype": "none"}):
        figure.savefig(path, dpi=120)
    plt.close(figure)

