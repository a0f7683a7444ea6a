"""ZeroTrainingArguments: transformers' TrainingArguments with the --zero_* flags (hf_zero.hf.flags), resolved into
one validated ZeroConfig when the arguments are parsed.

The public import path is `training_args` (the design card's package), which re-exports these classes;
they are defined here so that `hf_zero.cli.run` can put them in place of transformers' without hf_zero
importing the packages built on it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, make_dataclass
from typing import Any

import torch.distributed as dist
from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments
from transformers.utils import logging

from hf_zero.hf import pretrained
from hf_zero.hf.flags import check_engine_flags, take_deepspeed_config, zero_flag_fields
from hf_zero.runtime.launch import (
    collective_timeout,
    rendezvous_apart_from_earlier_starts,
)
from hf_zero.settings import environment
from hf_zero.settings.config import ZeroConfigError, flag_rows
from hf_zero.settings.environment import processes_per_node
from hf_zero.settings.flag_names import EXTRA_FLAGS

logger = logging.get_logger(__name__)


def _post_init(self: Any) -> None:
    if self.fsdp:
        raise ZeroConfigError("--fsdp and hf_zero's ZeRO engine cannot both run the training: drop --fsdp and use "
                              "--zero_stage (see the README's flag table)")
    take_deepspeed_config(self)
    # The launcher's layout, read before transformers sets up its own (accelerate may fill in LOCAL_WORLD_SIZE);
    # self.world_size is 1 when transformers does not start distributed training.
    processes = dist.get_world_size() if dist.is_initialized() else environment.world_size()
    per_node = processes_per_node(processes)
    if self.ddp_timeout is None:  # before transformers starts the process group with it
        self.ddp_timeout = math.ceil(collective_timeout().total_seconds())
    rendezvous_apart_from_earlier_starts()  # a script under plain torchrun --max-restarts too
    _take_accelerate_dynamo(self)  # before transformers fills --torch_compile_backend's default in
    super(ZeroArgumentsMixin, self).__post_init__()
    check_engine_flags(self, processes, per_node)
    if self.zero_deepspeed is not None and (warning := self.zero_deepspeed.warning()) \
            and environment.integer("RANK", 0, 0) == 0:
        logger.warning(warning)
    # The engine keeps the fp32 masters and casts the model itself; accelerate's autocast or
    # GradScaler on top would cast twice and scale the loss twice.
    self.mixed_precision = "no"
    # Where --zero_stage auto may choose stage 3 the model is built partitioned too; where the plan then chooses
    # stages 0-2, the engine fills it whole on every rank (hf_zero.zero.construct.fill_whole).
    stage3 = 3 in self.zero_stages if "zero_stage" in self.zero_planned else self.zero_engine_config.zero_stage == 3
    if stage3 and self.zero_init_partitioned:
        pretrained.enable(self)


def _take_accelerate_dynamo(args: Any) -> None:
    """`accelerate launch --dynamo_backend X [--dynamo_mode M]` (accelerate's ACCELERATE_DYNAMO_* variables) asks for
    what --torch_compile_backend X [--torch_compile_mode M] does: the engine compiles each block. The Accelerator
    never compiles the model (ZeroTrainer gives it no dynamo plugin), so the request is taken here or it would do
    nothing. accelerate always passes a mode, "default" unless told otherwise, which is inductor's default too."""
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if backend == "no":
        return
    mode = os.environ.get("ACCELERATE_DYNAMO_MODE", "default")
    for flag, given, wanted in (("backend", args.torch_compile_backend, backend),
                                ("mode", args.torch_compile_mode, None if mode == "default" else mode)):
        if given is not None and wanted is not None and given != wanted:
            raise ZeroConfigError(f"accelerate launch --dynamo_{flag} {wanted} and --torch_compile_{flag} {given} "
                                  f"disagree; give one")
    args.torch_compile, args.torch_compile_backend = True, backend
    if mode != "default":
        args.torch_compile_mode = mode


ZeroArgumentsMixin = make_dataclass(
    "ZeroArgumentsMixin", zero_flag_fields(),
    namespace={"__post_init__": _post_init, "__module__": __name__,
               "__doc__": "The engine's settings as Trainer flags (DeepSpeed config key in brackets)."})


def flags_help() -> str:
    """The flags hf_zero adds to the script's TrainingArguments, as argparse lists them: for `hf-zero run --help`,
    which parses only the launch flags itself and hands the rest to the script."""
    listing = HfArgumentParser(ZeroArgumentsMixin).format_help().split("\noptions:\n", 1)[1]
    return "\n".join(line for line in listing.splitlines() if not line.lstrip().startswith("-h, --help"))


def readme_flag_table() -> str:
    """README's table of the Trainer flags: the engine settings' rows (config.flag_rows), then the rest.
    Regenerate it with `python -c "from hf_zero.hf.arguments import readme_flag_table; print(readme_flag_table())"`."""
    rows = [f"| `--{name} {metavar}` | {'' if default is None else default} | {key} | {text} |"
            for name, (default, text, metavar, key) in EXTRA_FLAGS.items()]
    return "\n".join(["| flag | default | DeepSpeed config key it replaces | what it does |", "|---|---|---|---|",
                      *flag_rows(), *rows])


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """transformers.TrainingArguments with the --zero_* flags; use with hf_zero.ZeroTrainer."""


@dataclass
class ZeroSeq2SeqTrainingArguments(ZeroArgumentsMixin, Seq2SeqTrainingArguments):
    """transformers.Seq2SeqTrainingArguments with the --zero_* flags; use with hf_zero.ZeroSeq2SeqTrainer."""
