"""The --zero_* flags, resolved into one validated ZeroConfig when the arguments are parsed.

Every flag defaults to None, meaning "not given": a flag given on the command line wins over the
same key in --zero_config FILE.json, which wins over the engine's default. Precision, gradient
accumulation and clipping are the Trainer's own flags (--bf16/--fp16, --gradient_accumulation_steps,
--max_grad_norm), so the file may not set them a second time.

The classes live in this importable module because Trainer pickles its arguments into
training_args.bin, and unpickling needs the class.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from hf_zero.config import OFFLOAD_DEVICES, ZeroConfig, ZeroConfigError

# The Trainer flag that already carries each engine key; a --zero_config file may not repeat them.
TRAINER_OWNED = {"dtype": "--bf16/--fp16", "gradient_accumulation_steps": "--gradient_accumulation_steps",
                 "gradient_clipping": "--max_grad_norm"}


def flag_of(key: str) -> str:
    """The command-line flag that sets engine key `key`."""
    if key in TRAINER_OWNED:
        return TRAINER_OWNED[key]
    return f"--{key}" if key.startswith("zero_") else f"--zero_{key}"


def _flag(help_text: str, **metadata: Any) -> Any:
    return field(default=None, metadata={"help": help_text, **metadata})


def _switch(help_text: str) -> Any:
    """A boolean flag that may be given bare (`--zero_cpu_checkpointing`) or with a value, as the Trainer's are."""
    return _flag(help_text, nargs="?", const=True)


@dataclass
class ZeroArgumentsMixin:
    """The engine's settings as Trainer flags (DeepSpeed config key in brackets, for people moving over)."""

    zero_stage: int | None = _flag("ZeRO stage: 0 plain data parallel, 1 partition optimizer states, 2 also "
                                   "gradients, 3 also parameters (default 2) [zero_optimization.stage]",
                                   choices=[0, 1, 2, 3])
    zero_offload_optimizer: str | None = _flag("where optimizer states live: none, cpu, nvme (default none) "
                                               "[zero_optimization.offload_optimizer.device]",
                                               choices=list(OFFLOAD_DEVICES))
    zero_offload_param: str | None = _flag("stage 3: where parameter shards live: none, cpu, nvme (default none) "
                                           "[zero_optimization.offload_param.device]", choices=list(OFFLOAD_DEVICES))
    zero_nvme_path: str | None = _flag("folder for nvme offload [offload_*.nvme_path]")
    zero_reduce_bucket_size: int | None = _flag("gradient elements reduced per bucket (default 5e6) "
                                                "[zero_optimization.reduce_bucket_size]")
    zero_allgather_bucket_size: int | None = _flag("stages 1-2: parameter elements all-gathered at once after "
                                                   "the step (default 5e7) [zero_optimization.allgather_bucket_size]")
    zero_prefetch_bucket_size: int | None = _flag("stage 3: parameter elements gathered ahead of use (default 5e7) "
                                                  "[zero_optimization.stage3_prefetch_bucket_size]")
    zero_param_persistence_threshold: int | None = _flag(
        "stage 3: parameters smaller than this stay whole on every rank (default 0) "
        "[zero_optimization.stage3_param_persistence_threshold]")
    zero_partition_activations: bool | None = _switch("ZeRO-R P_a: split activation checkpoints across the tensor-"
                                                    "parallel group [activation_checkpointing.partition_activations]")
    zero_cpu_checkpointing: bool | None = _switch("ZeRO-R P_a+cpu: keep activation checkpoints in host memory "
                                                "[activation_checkpointing.cpu_checkpointing]")
    zero_delayed_param_update: bool | None = _switch("ZeRO-Offload: overlap the CPU step with the next step "
                                                   "(needs --zero_offload_optimizer)")
    zero_delayed_param_update_warmup: int | None = _flag("ordinary steps before the delayed update starts "
                                                         "(default 10)")
    zero_config: str | None = _flag("JSON file of engine settings (hf_zero.ZeroConfig keys); flags win over it")
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks per tensor-parallel group (Megatron-style, DTensor): each transformer block is split over "
                "them and ZeRO runs over the remaining data-parallel dimension (default 1: no tensor parallelism)"})

    def __post_init__(self) -> None:
        for other in ("deepspeed", "fsdp"):
            if getattr(self, other, None):
                raise ZeroConfigError(
                    f"--{other} and hf_zero's ZeRO engine cannot both run the training: drop --{other} and use "
                    f"--zero_stage (see the README's flag table for the DeepSpeed key each --zero_* flag replaces)")
        super().__post_init__()
        self.zero_engine_config = zero_config_from_flags(self)
        check_tensor_parallel_flags(self)
        # The engine keeps the fp32 masters and casts the model itself; accelerate's autocast or
        # GradScaler on top would cast twice and scale the loss twice.
        self.mixed_precision = "no"


def zero_config_from_flags(args: Any) -> ZeroConfig:
    """Flags given > keys in --zero_config > engine defaults; raises ZeroConfigError naming the flag."""
    settings: dict[str, Any] = {}
    if args.zero_config:
        settings = _read_config_file(args.zero_config)
    for f in fields(ZeroArgumentsMixin):
        value = getattr(args, f.name)
        if f.name not in ("zero_config", "tensor_parallel_size") and value is not None:
            settings[f.name if f.name == "zero_stage" else f.name.removeprefix("zero_")] = value
    # The Trainer scales each micro-batch's loss for accumulation and decides where each window
    # ends (the last one of an epoch may be short), so the engine reduces when told and does not
    # divide the loss again.
    settings.update(dtype="fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
                    gradient_clipping=float(args.max_grad_norm or 0.0), gradient_accumulation_steps=1)
    config = ZeroConfig(**settings)
    config.validate(name=flag_of)
    return config


def check_tensor_parallel_flags(args: Any) -> None:
    """--tensor_parallel_size must split the world into tp groups."""
    tp = args.tensor_parallel_size
    if isinstance(tp, int) and tp > 1 and args.eval_use_gather_object:
        raise ZeroConfigError(f"--tensor_parallel_size {tp} with --eval_use_gather_object: gathered objects would "
                              f"hold every sample {tp} times (once per rank of a tp group); leave "
                              f"--eval_use_gather_object off")
    if not isinstance(tp, int) or tp < 1 or args.world_size % tp:
        raise ZeroConfigError(f"--tensor_parallel_size must be a positive integer dividing the number of processes "
                              f"({args.world_size}); got {tp!r}")


def _read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ZeroConfigError(f"--zero_config {path}: no such file")
    try:
        settings = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ZeroConfigError(f"--zero_config {path} is not valid JSON: {error}") from None
    if not isinstance(settings, dict):
        raise ZeroConfigError(f"--zero_config {path} must hold a JSON object of engine settings")
    known = {f.name for f in fields(ZeroConfig)} - set(TRAINER_OWNED)
    for key in settings:
        if key in TRAINER_OWNED:
            raise ZeroConfigError(f"--zero_config {path} sets {key!r}, which the Trainer's {TRAINER_OWNED[key]} "
                                  f"sets; remove it from the file")
        if key not in known:
            raise ZeroConfigError(f"--zero_config {path}: unknown setting {key!r}; known: {sorted(known)}")
    return settings


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """transformers.TrainingArguments with the --zero_* flags; use with hf_zero.ZeroTrainer."""


@dataclass
class ZeroSeq2SeqTrainingArguments(ZeroArgumentsMixin, Seq2SeqTrainingArguments):
    """transformers.Seq2SeqTrainingArguments with the --zero_* flags; use with hf_zero.ZeroSeq2SeqTrainer."""
