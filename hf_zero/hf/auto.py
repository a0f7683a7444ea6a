"""ZeroTrainer's --zero_stage auto (and --zero_offload_optimizer / --zero_offload_param auto): the settings left to a
plan of this job on this machine, made when the Trainer has the model, its optimizer and its data, just before the
engine starts; then the second optimizer step's measured peak is checked against the plan's, and that of each step
whose batch is longer than the planned one (ZeroTrainer's PlanCheck).

Rank 0 plans: `hf-zero plan --json` in a process of its own, since the plan simulates its own world and this process
is a rank of a real one. It plans the model's class from its config (a peft adapter around it as the run has it,
training what the run trains, with the run's optimizer and engine settings), for the tensors of the longest batch at
--per_device_train_batch_size, with --gradient_checkpointing and the other settings as given (a stage among those they
allow), at this world's size and nodes, with the device memory the rank with the least has left (the model's own
tensors counted back in: the plan builds it too), the host's available memory and the NVMe folder's free space. Every
rank takes rank 0's answer, or raises rank 0's error; they wait for it in short collectives (Communicator.from_rank_0),
so the plan may take longer than --ddp_timeout. The batch is read with every random generator kept as it was,
so that the run trains as the same run with the chosen settings given.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch
import transformers
from torch import nn
from transformers.trainer_utils import _is_peft_model, unwrap_peft_model
from transformers.utils import is_datasets_available, logging

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.ledger import Ledger
from hf_zero.runtime.memory import memory_left
from hf_zero.runtime.trusted import code_location
from hf_zero.settings.config import (
    ZeroConfig,
    ZeroConfigError,
    engine_settings_for_a_plan,
    offloads_to_check,
    trainer_flag,
)
from hf_zero.settings.environment import processes_per_node

logger = logging.get_logger(__name__)

# Seconds a plan may take (reading the batch, and `hf-zero plan` in its own process) before it is stopped and every
# rank raises: a plan that hangs would hold the job, whose other ranks wait for it without a collective timing out
# (Communicator.from_rank_0).
PLAN_TIME_LIMIT = 600.0

# What torchrun tells a rank about its world: a plan's own process runs outside it.
_WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def check_model(model: nn.Module, flag: str) -> None:
    """Refuses, before any work starts, a model the plan cannot build and train as the run will: its own class (or,
    under a peft adapter, its base model's) must be transformers', which the plan builds from its config."""
    base = unwrap_peft_model(model)
    name = type(base).__name__
    if getattr(transformers, name, None) is not type(base) or not hasattr(base, "config"):
        raise ZeroConfigError(f"{flag} auto plans transformers' own model classes (built from their config); "
                              f"{name} is not one: give {flag} a value (`hf-zero plan` shows what each takes)")
    if _is_peft_model(model) and len(model.peft_config) > 1:
        raise ZeroConfigError(f"{flag} auto plans one peft adapter; this model has {len(model.peft_config)} "
                              f"({', '.join(model.peft_config)}): give {flag} a value")


def model_bytes(model: nn.Module, device: torch.device) -> int:
    """The bytes of the model's parameters and buffers on `device`: what a plan counts as built by it, held by this
    process already."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)


@dataclasses.dataclass(frozen=True)
class PlannedFor:
    """What a plan was made for, which the run is checked against: its peak (bytes; on a CPU device and host memory
    together, measured from when the engine starts), and the length of the planned batch's `input_name` where each
    sample's is a sequence of tokens (else None), the longest of `batch_of`."""
    peak: int
    input_name: str
    length: int | None
    batch_of: str


def planned_config(trainer: Any) -> tuple[ZeroConfig, PlannedFor]:
    """The engine's configuration with the `auto` settings planned, and what the plan was made for."""
    args = trainer.args
    config: ZeroConfig = args.zero_engine_config
    flag = trainer_flag(args.zero_planned[0])
    per_node = processes_per_node(args.world_size)
    comm = Communicator(Ledger(), ranks_per_node=per_node)
    device = compute_device()
    # Planned for the rank with the least memory left: every rank runs the same setting.
    left = min(comm.all_gather_object(memory_left(device, per_node)[0] + model_bytes(trainer.model, device)))
    if comm.rank == 0:
        logger.warning(f"planning {', '.join(trainer_flag(key) for key in args.zero_planned)} for {args.world_size} "
                       f"process(es), {per_node} a node (the other ranks wait) ...")
    # The plan's processes stop at PLAN_TIME_LIMIT, saying so; past a minute more, reading the batch has hung.
    plan = comm.from_rank_0(lambda: _plan(trainer, per_node, left), f"planning {flag} auto", ZeroConfigError,
                            limit=PLAN_TIME_LIMIT + 60)
    chosen = {key: plan["setting"][key] for key in args.zero_planned}
    on_nvme = "nvme" in (plan["setting"]["offload_optimizer"], plan["setting"]["offload_param"])
    nvme = {"nvme_path": args.zero_nvme_to_plan} if args.zero_nvme_to_plan and on_nvme else {}
    config = dataclasses.replace(config, **chosen, **nvme)
    config.validate(name=trainer_flag)
    if comm.rank == 0:
        logger.warning(_said(plan, chosen))
        if config.compile:
            logger.warning("the plan ran the model eager: the compiled step may take other memory, which the check "
                           "after the second step measures")
        if args.zero_nvme_to_plan and not on_nvme:
            logger.warning(f"the plan offloads nothing to NVMe: {trainer_flag('nvme_path')} "
                           f"{args.zero_nvme_to_plan} is not used")
    name = _main_input(trainer)
    shape = plan["sample"].get(name, {}).get("shape") or []
    peak = plan["per_rank"]["measured_peak"]["device_and_host" if device.type == "cpu" else "device"]
    return config, PlannedFor(peak, name, shape[0] if len(shape) == 1 else None, plan["batch_of"])


def _plan(trainer: Any, per_node: int, device_bytes: int) -> dict[str, Any]:
    """`hf-zero plan --json` for this job on this machine, `device_bytes` a rank (rank 0's answer for every rank)."""
    args, model = trainer.args, trainer.model
    config: ZeroConfig = args.zero_engine_config
    flag = trainer_flag(args.zero_planned[0])
    deadline = time.monotonic() + PLAN_TIME_LIMIT
    fixed = {key: str(getattr(config, key)) for key in ("zero_stage", "offload_optimizer", "offload_param")
             if key not in args.zero_planned}
    if "zero_stage" in args.zero_planned and args.zero_stages != (0, 1, 2, 3):
        fixed["zero_stage"] = ",".join(map(str, args.zero_stages))
    if compute_device().type == "cpu":  # the device's memory is the host's: offloading to it frees nothing
        fixed |= offloads_to_check(dataclasses.asdict(config), args.zero_planned)
    # The NVMe an offload may use: the folder's disk, which the node's ranks share.
    nvme_folder = config.nvme_path or args.zero_nvme_to_plan
    nvme = ["--nvme", f"{shutil.disk_usage(nvme_folder).free / 1e9:.9f}GB"] if nvme_folder else []
    topology = config.ranks_per_node or per_node  # the nodes the links are counted by, as the engine counts them
    with tempfile.TemporaryDirectory(prefix="hf_zero_plan_") as folder:
        base = unwrap_peft_model(model)
        model_config = base.config.__class__.from_dict(base.config.to_dict())
        model_config.architectures = [type(base).__name__]
        Path(folder, "config.json").write_text(model_config.to_json_string())
        # What trains: the adapter around the model, and exactly the parameters the run's model trains.
        adapter = []
        if _is_peft_model(model):
            (name, peft_config), = model.peft_config.items()  # one adapter (check_model)
            peft_config.save_pretrained(Path(folder, "adapter"))
            adapter = ["--adapter", str(Path(folder, "adapter")), "--adapter_name", name]
        Path(folder, "frozen.json").write_text(json.dumps([n for n, p in model.named_parameters()
                                                           if not p.requires_grad]))
        optimizer = _optimizer_of(trainer.optimizer, flag, deadline)
        batch, which = longest_batch(trainer)
        sample = _sample(batch, args)
        Path(folder, "sample.json").write_text(json.dumps(sample))
        command = [sys.executable, "-m", "hf_zero", "plan", "--json", "--model", folder,
                   "--sample", str(Path(folder, "sample.json")), *adapter,
                   "--frozen", str(Path(folder, "frozen.json")),
                   *optimizer,
                   "--engine_settings", json.dumps(engine_settings_for_a_plan(dataclasses.asdict(config))),
                   "--nodes", str(args.world_size // topology), "--gpus_per_node", str(topology),
                   "--gpu_memory", f"{device_bytes / 1e9:.9f}GB",
                   "--host_memory", f"{psutil.virtual_memory().available / 1e9:.9f}GB",
                   "--dtype", config.dtype, "--micro_batch", str(args.per_device_train_batch_size),
                   "--gradient_checkpointing", str(bool(args.gradient_checkpointing)).lower(),
                   "--hpz_partition_size", str(config.hpz_partition_size), *nvme,
                   *(arg for key, value in fixed.items() for arg in (f"--{key}", value))]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=_plan_environment(),
                                  timeout=_seconds_left(deadline))
        except subprocess.TimeoutExpired:
            raise ZeroConfigError(f"{flag} auto: planning took longer than {PLAN_TIME_LIMIT:.0f} s: give {flag} a "
                                  f"value (`hf-zero plan` answers beforehand)") from None
    try:
        plan = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ZeroConfigError(f"{flag} auto: the plan failed (exit status {done.returncode}; {' '.join(command)}): "
                              f"{done.stderr.strip()[-2000:]}") from None
    if not plan["fits"]:
        raise ZeroConfigError(f"{flag} auto: no setting fits {device_bytes / 1e9:.3g} GB a process: "
                              f"{plan['what_would']}")
    return plan | {"sample": sample, "batch_of": which}


def _sample(batch: dict[str, Any], args: Any) -> dict[str, dict[str, Any]]:
    """One sample's tensors of `batch`, as `hf-zero plan --sample` takes them. A tensor whose first dimension is not
    the batch's (a collator that packs sequences into one row) is refused: the plan would run other shapes."""
    samples, flag = args.per_device_train_batch_size, trainer_flag(args.zero_planned[0])
    sample = {}
    for name, tensor in batch.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            logger.warning(f"{flag} auto: the batch's {name!r} is not a tensor of samples; the plan runs without it")
            continue
        if tensor.shape[0] != samples:
            raise ZeroConfigError(f"{flag} auto plans batches of --per_device_train_batch_size {samples} samples; the "
                                  f"planned batch's {name!r} has shape {tuple(tensor.shape)} (a collator that packs "
                                  f"samples): give {flag} a value")
        sample[name] = {"shape": list(tensor.shape[1:]), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "high": 1 if tensor.is_floating_point() else max(1, int(tensor.max()) + 1)}
    return sample


# Where torch's and transformers' optimizers are named from: their public names, not the modules defining them.
PUBLIC_OPTIMIZER_MODULES = ("torch.optim", "transformers.optimization")


def _optimizer_of(optimizer: torch.optim.Optimizer, flag: str, deadline: float) -> list[str]:
    """The Trainer's optimizer as `hf-zero plan` takes it: --optimizer, its class by its public name (torch's and
    transformers', else its top package's where that exports it, else its module's); --optimizer_kwargs, its
    settings as JSON; and --optimizer_folder where its module is not where a new interpreter looks (beside the
    script)."""
    cls = type(optimizer)
    top = cls.__module__.split(".")[0]
    # A script's classes live in __main__ (__mp_main__ in processes multiprocessing started), which no other process
    # imports by that name.
    named_in = [] if top in ("__main__", "__mp_main__") else [*PUBLIC_OPTIMIZER_MODULES, top, cls.__module__]
    name = next((f"{module}.{cls.__qualname__}" for module in named_in if _exports(module, cls)), None)
    if name is None:
        raise ZeroConfigError(f"{flag} auto plans the run's optimizer in a process of its own, which imports its class "
                              f"by name; this run's is {cls.__module__}.{cls.__qualname__}, which no other process "
                              f"can import by that name (a class of the script, or one made inside a function or "
                              f"class): define it at the top of a module, or give {flag} a value")
    # Its settings as its constructor takes them (torch's defaults also hold what a class sets itself).
    accepted = inspect.signature(cls).parameters
    try:
        settings = json.dumps({key: value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value
                               for key, value in optimizer.defaults.items() if key in accepted})
    except TypeError as error:
        raise ZeroConfigError(f"{flag} auto: {name}'s settings cannot be planned ({error}): give {flag} a "
                              f"value") from None
    folder = None if name.rpartition(".")[0] in PUBLIC_OPTIMIZER_MODULES else \
        _folder_to_import(sys.modules[top], flag, deadline)
    return ["--optimizer", name, "--optimizer_kwargs", settings, *(["--optimizer_folder", folder] if folder else [])]


def _exports(module: str, cls: type) -> bool:
    """Whether importing `module` gives `cls` by its qualified name."""
    try:
        found = sys.modules.get(module) or importlib.import_module(module)
    except ImportError:
        return False
    return getattr(found, cls.__qualname__, None) is cls


def _folder_to_import(top: Any, flag: str, deadline: float) -> str | None:
    """The folder package or module `top` was imported from, where a new interpreter (as the plan starts: this
    environment and working folder) would find none (a module beside the script); None where it finds this one.
    Where it would find another copy, refused: the plan would step another optimizer."""
    spec = top.__spec__
    here = code_location(spec) if spec is not None else ""
    if not here:
        return None
    try:
        found = subprocess.run([sys.executable, "-c", "import importlib.util, sys\n"
                                "from hf_zero.runtime.trusted import code_location\n"
                                "spec = importlib.util.find_spec(sys.argv[1])\n"
                                "print(code_location(spec) if spec else '')", top.__name__],
                               capture_output=True, text=True, env=_plan_environment(),
                               timeout=_seconds_left(deadline))
    except subprocess.TimeoutExpired:
        raise ZeroConfigError(f"{flag} auto: looking for {top.__name__} as the plan's process would took longer "
                              f"than the plan may ({PLAN_TIME_LIMIT:.0f} s): give {flag} a value") from None
    if found.returncode != 0:
        raise ZeroConfigError(f"{flag} auto: looking for {top.__name__} as the plan's process would failed: "
                              f"{found.stderr.strip()[-1000:]}")
    there = found.stdout.strip()
    if not there:
        return str(Path(here).parent)
    if Path(there).resolve() != Path(here).resolve():
        raise ZeroConfigError(f"{flag} auto: a new process would import {top.__name__} from {there}, not from "
                              f"{here} as this run did, so the plan would step another optimizer: give {flag} a "
                              f"value")
    return None


def _seconds_left(deadline: float) -> float:
    """The plan's time left before `deadline`, for a process it starts; where none is left (the ranks no longer wait
    for it), TimeoutExpired, as a process that ran out of it raises."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise subprocess.TimeoutExpired("the plan", 0)
    return left


def _plan_environment() -> dict[str, str]:
    """The environment the plan's process runs in: this one's, outside the run's world and without GPUs."""
    return {k: v for k, v in os.environ.items() if k not in _WORLD_VARIABLES} | {"CUDA_VISIBLE_DEVICES": ""}


def longest_batch(trainer: Any) -> tuple[dict[str, Any], str]:
    """--per_device_train_batch_size samples collated as the Trainer's data loader collates them: the longest of the
    training data (by the model's main input, as transformers' length-grouped sampler measures them; of an iterable
    dataset, the longest of its first ITERABLE_SAMPLES_READ), or where their lengths cannot be known (samples without
    that input as a sequence), the first; and which. torch's,
    Python's and NumPy's random generators are left as they were, and the collator's own (transformers' masking
    collators keep one): a collator may draw (masked language modelling). An iterable dataset is read from a new
    iterator."""
    import numpy

    dataset, collate = trainer.train_dataset, trainer.data_collator
    count = trainer.args.per_device_train_batch_size
    flag = trainer_flag(trainer.args.zero_planned[0])
    empty = f"{flag} auto plans for the training data's batches; the training dataset is empty"
    if dataset is None:  # a Trainer made to evaluate or predict only, whose model was built partitioned for auto
        raise ZeroConfigError(f"{flag} auto plans for the training data's batches, and the Trainer was given no "
                              f"train_dataset: give {flag} a value (3 keeps a model built partitioned so)")
    if not _iterable(dataset) and not len(dataset):
        raise ZeroConfigError(empty)
    name = _main_input(trainer)
    picked = None if _iterable(dataset) else _longest(dataset, count, name)
    if _is_datasets_dataset(dataset):  # as Trainer._get_dataloader
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]), _collators_generator_kept(collate):
            if _iterable(dataset):
                samples, which = _longest_read(dataset, count, name)
                if not samples:
                    raise ZeroConfigError(empty)
                return collate(samples), which
            if picked is None:
                return collate([dataset[i] for i in range(min(count, len(dataset)))]), FIRST_SAMPLES
            return collate([dataset[i] for i in picked]), "the longest samples"
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


def _iterable(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__")


def _main_input(trainer: Any) -> str:
    """The input samples are measured by: the processor's first model input, as transformers' LengthGroupedSampler
    takes it, else the model's main input."""
    names = getattr(trainer.processing_class, "model_input_names", None)
    return names[0] if names else getattr(unwrap_peft_model(trainer.model), "main_input_name", "input_ids")


FIRST_SAMPLES = "the first samples (their lengths are not known beforehand)"
# An iterable dataset's length is not known, and it may not end: the longest batch is looked for among this many
# samples from its start (a few seconds of reading for a dataset tokenized as it streams).
ITERABLE_SAMPLES_READ = 1024


def _longest_read(dataset: Any, count: int, name: str) -> tuple[list[Any], str]:
    """The `count` longest samples by their `name` among an iterable dataset's first ITERABLE_SAMPLES_READ, read from a
    new iterator (the first of equal ones, in the dataset's order), and which; where a sample has no `name` as a
    sequence, the first `count`."""
    samples = list(itertools.islice(iter(dataset), ITERABLE_SAMPLES_READ))
    lengths = [_length(sample, name) for sample in samples]
    if None in lengths:
        return samples[:count], FIRST_SAMPLES
    if len(samples) < ITERABLE_SAMPLES_READ:
        which = f"the longest samples (all {len(samples)} of the iterable dataset read)"
    else:
        which = (f"the longest of the iterable dataset's first {ITERABLE_SAMPLES_READ} samples (its length is not "
                 f"known: a longer sample after them is not planned for)")
    return [samples[i] for i in _longest_of(lengths, count)], which


def _longest(dataset: Any, count: int, name: str) -> list[int] | None:
    """The indices of a map-style dataset's `count` longest samples by their `name` (the first of equal ones), or
    None where a sample has no `name` as a sequence."""
    if _is_datasets_dataset(dataset):
        import pyarrow
        import pyarrow.compute

        if name not in dataset.column_names:
            return None
        # One pass over the column in Arrow, in the dataset's order (a shuffle's or a select's indices applied).
        column = dataset.with_format("arrow").select_columns([name])[:][name]
        if not pyarrow.types.is_list(column.type) and not pyarrow.types.is_large_list(column.type):
            return None
        lengths = pyarrow.compute.fill_null(pyarrow.compute.list_value_length(column), 0).to_pylist()
    else:
        lengths = [_length(dataset[i], name) for i in range(len(dataset))]
        if None in lengths:
            return None
    return _longest_of(lengths, count)


def _longest_of(lengths: list[int], count: int) -> list[int]:
    """The indices of the `count` largest `lengths`, the first of equal ones, in order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: the first of equal ones
    return sorted(order[:count])


def _length(sample: Any, name: str) -> int | None:
    """The length of `sample[name]`, a sequence (a list, or a tensor or array of one dimension or more), or None."""
    value = sample.get(name) if isinstance(sample, Mapping) else None
    if isinstance(value, (list, tuple)):
        return len(value)
    shape = getattr(value, "shape", None)
    return shape[0] if shape else None


@contextlib.contextmanager
def _collators_generator_kept(collate: Any) -> Iterator[None]:
    """The collator's own random generator (`generator`, made at its first call), as it was before."""
    holder = getattr(collate, "data_collator", collate)  # the Trainer's column-removing wrapper holds the user's
    if not hasattr(holder, "generator"):
        yield
        return
    generator, maker = holder.generator, getattr(holder, "_generator_pid", None)
    state = generator.get_state() if isinstance(generator, torch.Generator) else \
        copy.deepcopy(generator.bit_generator.state) if hasattr(generator, "bit_generator") else None
    try:
        yield
    finally:
        holder.generator = generator
        if hasattr(holder, "_generator_pid"):
            holder._generator_pid = maker
        if isinstance(generator, torch.Generator):
            generator.set_state(state)
        elif state is not None:
            generator.bit_generator.state = state


def _is_datasets_dataset(dataset: Any) -> bool:
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def _shapes(sample: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{name} {' x '.join(map(str, spec['shape'])) or '(one value)'}" for name, spec in sample.items())


def _said(plan: dict[str, Any], chosen: dict[str, Any]) -> str:
    rank = plan["per_rank"]
    lines = [f"planned: {', '.join(f'{trainer_flag(key)} {value}' for key, value in chosen.items())} "
             f"({plan['params']:,} parameters, {plan['trained_params']:,} trained; a batch of {plan['batch_of']}, "
             f"a sample: {_shapes(plan['sample'])}); "
             f"rank {rank['rank']} at the step's peak: device {rank['device']['peak'] / 1e9:.3g} GB of "
             f"{plan['gpu_memory'] / 1e9:.3g} GB, host {rank['host']['peak'] / 1e9:.3g} GB. Candidates:"]
    lines += [f"  {c['setting']}: {c['outcome']}" for c in plan["candidates"]]
    return "\n".join(lines)
