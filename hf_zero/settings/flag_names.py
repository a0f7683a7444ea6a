"""The names of the flags hf_zero adds to a script's TrainingArguments, and the check that a --zero_* flag among a
script's arguments is one of them. Nothing here imports torch or transformers: `hf-zero run` reports a misspelt flag
before it imports them (3-4 s on a 2-core machine), and hf_zero.hf.flags makes the flags from these names."""
from __future__ import annotations

from typing import Any

from hf_zero.settings.config import (
    ZeroConfigError,
    described_settings,
    did_you_mean,
    trainer_flag,
)

# The engine settings the Trainer already has a flag for (dtype: --bf16/--fp16, ...); a --zero_config file
# may not repeat them.
TRAINER_OWNED = {s.name: s.metadata["trainer_flag"] for s in described_settings() if s.metadata["trainer_flag"]}
# Every other engine setting is a --zero_* flag: the flag's field name -> the setting.
ENGINE_FLAGS = {trainer_flag(s.name).removeprefix("--"): s.name for s in described_settings()
                if s.name not in TRAINER_OWNED}
# Flags of the Trainer integration that are not engine settings: default, help, metavar, what it replaces.
EXTRA_FLAGS: dict[str, tuple[Any, str, str, str]] = {
    "zero_config": (None, "JSON file of engine settings: hf_zero.ZeroConfig keys, or a DeepSpeed configuration "
                          "(ds_config.json, also taken by --deepspeed) read as it is; flags win over it", "FILE.json",
                    "the whole DeepSpeed configuration (docs/deepspeed.md)"),
    "tensor_parallel_size": (1, "ranks per tensor-parallel group (Megatron-style, DTensor): each transformer block "
                             "is split over them and ZeRO runs over the remaining data-parallel dimension", "N",
                             "Megatron's model parallel size (`mpu`)"),
    "zero_init_partitioned": (True, "stage 3 (and auto, which may choose it): from_pretrained and from_config, called "
                              "once these arguments are parsed and until a ZeroTrainer given them takes its model, "
                              "build the model partitioned (each rank reads only its slices of the safetensors files, "
                              "or initialises only its shards; where auto chooses stages 0-2, each rank then fills the "
                              "whole model); false builds the whole model on every rank first",
                              "[BOOL]", "DeepSpeed's `zero.Init` (accelerate's `zero3_init_flag`)"),
    "tensor_parallel_across_nodes": (False, "let a tensor-parallel group span nodes (its all-reduces in every layer "
                                     "then cross the network); refused otherwise", "[BOOL]",
                                     "Megatron's model parallel size larger than a node"),
}
# The Trainer's own flag that hf_zero gives another default (hf_zero.hf.flags.zero_flag_fields).
DDP_TIMEOUT_FLAG = "ddp_timeout"


def flag_names() -> set[str]:
    """Every flag hf_zero adds to the script's TrainingArguments (or gives a default of its own), as `--name`."""
    return {f"--{name}" for name in (*ENGINE_FLAGS, *EXTRA_FLAGS, DDP_TIMEOUT_FLAG)}


def check_flag_names(script_args: list[str]) -> None:
    """Raises ZeroConfigError, in one line, for a --zero* flag among a script's arguments that is near one of hf_zero's
    and is not one: a misspelling. One far from all of them may be the script's own (--zero_shot)."""
    ours = flag_names()
    for arg in script_args:
        flag = "--" + arg.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if arg.startswith("--zero") and flag not in ours and (near := did_you_mean(flag, ours)):
            raise ZeroConfigError(f"unknown flag {arg.split('=', 1)[0]}{near} (the README's flag table lists every "
                                  f"--zero_* flag)")
