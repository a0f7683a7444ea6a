"""ZeroTrainer's --zero_stage auto (and --zero_offload_optimizer / --zero_offload_param auto): the settings left to a
plan of this job on this machine, made when the Trainer has the model and its first batch, just before the engine
starts; then the second optimizer step's measured peak is checked against the plan's.

Rank 0 plans: `hf-zero plan --json` in a process of its own, since the plan simulates its own world and this process
is a rank of a real one. It plans the model's class from its config, for the first batch's tensors at
--per_device_train_batch_size, with --gradient_checkpointing as given, at this world's size and processes per node,
with the device memory this rank has left (the model's own tensors counted back in: the plan builds it too) and the
host's available memory. Every rank takes rank 0's answer, or raises rank 0's error. The first batch is read with
every random generator kept as it was, so that the run trains as the same run with the chosen settings given.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers
from torch import nn
from transformers.utils import is_datasets_available, logging

from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.ledger import Ledger
from hf_zero.runtime.memory import memory_left
from hf_zero.settings.config import ZeroConfig, ZeroConfigError, trainer_flag
from hf_zero.settings.environment import processes_per_node

logger = logging.get_logger(__name__)

# What torchrun tells a rank about its world: a plan's own process runs outside it.
_WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def check_model(model: nn.Module, flag: str) -> None:
    """Refuses, before any work starts, a model the plan cannot build and train as the run will."""
    name = type(model).__name__
    if getattr(transformers, name, None) is not type(model) or not hasattr(model, "config"):
        raise ZeroConfigError(f"{flag} auto plans transformers' own model classes (built from their config); "
                              f"{name} is not one: give {flag} a value (`hf-zero plan` shows what each takes)")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    if frozen:
        raise ZeroConfigError(f"{flag} auto plans training every parameter; this model freezes {frozen:,} of "
                              f"{sum(p.numel() for p in model.parameters()):,} (an adapter, frozen layers): give "
                              f"{flag} a value")


def model_bytes(model: nn.Module, device: torch.device) -> int:
    """The bytes of the model's parameters and buffers on `device`: what a plan counts as built by it, held by this
    process already."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)


def planned_config(trainer: Any) -> tuple[ZeroConfig, int]:
    """The engine's configuration with the `auto` settings planned, and the peak the plan expects of a step (bytes;
    on a CPU device and host memory together)."""
    args = trainer.args
    config: ZeroConfig = args.zero_engine_config
    flag = trainer_flag(args.zero_planned[0])
    per_node = processes_per_node(args.world_size)
    comm = Communicator(Ledger(), ranks_per_node=per_node)
    if comm.rank == 0:
        logger.warning(f"planning {', '.join(trainer_flag(key) for key in args.zero_planned)} for {args.world_size} "
                       f"process(es), {per_node} a node (the other ranks wait) ...")
    plan = comm.agree(lambda: _plan(trainer, per_node) if comm.rank == 0 else None, f"planning {flag} auto",
                      ZeroConfigError)[0]
    chosen = {key: plan["setting"][key] for key in args.zero_planned}
    config = dataclasses.replace(config, **chosen)
    config.validate(name=trainer_flag)
    if comm.rank == 0:
        logger.warning(_said(plan, chosen))
    measured = plan["per_rank"]["measured_peak"]
    return config, measured["device_and_host" if compute_device().type == "cpu" else "device"]


def _plan(trainer: Any, per_node: int) -> dict[str, Any]:
    """`hf-zero plan --json` for this job on this machine (rank 0's answer for every rank)."""
    args, model = trainer.args, trainer.model
    config: ZeroConfig = args.zero_engine_config
    device = compute_device()
    device_bytes = memory_left(device, per_node)[0] + model_bytes(model, device)
    batch = first_batch(trainer)
    with tempfile.TemporaryDirectory(prefix="hf_zero_plan_") as folder:
        model_config = model.config.__class__.from_dict(model.config.to_dict())
        model_config.architectures = [type(model).__name__]
        Path(folder, "config.json").write_text(model_config.to_json_string())
        sample = {name: {"shape": list(tensor.shape[1:]), "dtype": str(tensor.dtype).removeprefix("torch."),
                         "high": 1 if tensor.is_floating_point() else max(1, int(tensor.max()) + 1)}
                  for name, tensor in batch.items() if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1}
        Path(folder, "sample.json").write_text(json.dumps(sample))
        command = [sys.executable, "-m", "hf_zero", "plan", "--json", "--model", folder,
                   "--sample", str(Path(folder, "sample.json")),
                   "--nodes", str(args.world_size // per_node), "--gpus_per_node", str(per_node),
                   "--gpu_memory", f"{device_bytes / 1e9:.9f}GB",
                   "--host_memory", f"{psutil.virtual_memory().available / 1e9:.9f}GB",
                   "--dtype", config.dtype, "--micro_batch", str(args.per_device_train_batch_size),
                   "--gradient_checkpointing", str(bool(args.gradient_checkpointing)).lower(),
                   "--hpz_partition_size", str(config.hpz_partition_size)]
        command += [arg for key in ("zero_stage", "offload_optimizer", "offload_param")
                    if key not in args.zero_planned for arg in (f"--{key}", str(getattr(config, key)))]
        env = {k: v for k, v in os.environ.items() if k not in _WORLD_VARIABLES} | {"CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    try:
        plan = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ZeroConfigError(f"the plan failed ({' '.join(command)}): {done.stderr.strip()[-2000:]}") from None
    if not plan["fits"]:
        losers = "; ".join(f"{c['setting']}: {c['outcome']}" for c in plan["candidates"])
        raise ZeroConfigError(f"{trainer_flag(args.zero_planned[0])} auto: no setting fits "
                              f"{device_bytes / 1e9:.3g} GB a process ({losers}); give a smaller "
                              f"--per_device_train_batch_size, --gradient_checkpointing, or more processes")
    return plan


def first_batch(trainer: Any) -> dict[str, Any]:
    """The training data's first --per_device_train_batch_size samples, collated as the Trainer's data loader
    collates them, with torch's, Python's and NumPy's random generators left as they were (a collator may draw:
    masked language modelling)."""
    import numpy

    dataset, collate = trainer.train_dataset, trainer.data_collator
    if _is_datasets_dataset(dataset):  # as Trainer._get_dataloader
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    count = trainer.args.per_device_train_batch_size
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            samples = [dataset[i] for i in range(min(count, len(dataset)))] if hasattr(dataset, "__getitem__") \
                and hasattr(dataset, "__len__") else list(itertools.islice(iter(dataset), count))
            return collate(samples)
    finally:
        random.setstate(python_state)
        numpy.random.set_state(numpy_state)


def _is_datasets_dataset(dataset: Any) -> bool:
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def _said(plan: dict[str, Any], chosen: dict[str, Any]) -> str:
    rank = plan["per_rank"]
    lines = [f"planned: {', '.join(f'{trainer_flag(key)} {value}' for key, value in chosen.items())} "
             f"({plan['params']:,} parameters, {plan['seq_len']} tokens a sample); rank {rank['rank']} at "
             f"the step's peak: device {rank['device']['peak'] / 1e9:.3g} GB of {plan['gpu_memory'] / 1e9:.3g} GB, "
             f"host {rank['host']['peak'] / 1e9:.3g} GB. Candidates:"]
    lines += [f"  {c['setting']}: {c['outcome']}" for c in plan["candidates"]]
    return "\n".join(lines)
