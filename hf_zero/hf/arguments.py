"""The Trainer's --zero_* flags, made from the ZeroConfig declarations and resolved into one validated
ZeroConfig when the arguments are parsed.

Every flag defaults to None, meaning "not given": a flag given on the command line wins over the
same key in --zero_config FILE.json, which wins over the engine's default. Precision, gradient
accumulation and clipping are the Trainer's own flags (--bf16/--fp16, --gradient_accumulation_steps,
--max_grad_norm), so neither a --zero_* flag nor the file sets them a second time.

The public import path is `training_args` (the design card's package), which re-exports these classes;
they are defined here so that `hf_zero.cli.run` can put them in place of transformers' without hf_zero
importing the packages built on it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments
from transformers.utils import logging

from hf_zero.hf import pretrained
from hf_zero.runtime.device import has_accelerator
from hf_zero.runtime.launch import (
    collective_timeout,
    rendezvous_apart_from_earlier_starts,
)
from hf_zero.runtime.tensor_parallel import check_tp_within_a_node
from hf_zero.settings import deepspeed_config, environment
from hf_zero.settings.config import (
    AUTO,
    PLANNED,
    PLANNED_HELP,
    ZeroConfig,
    ZeroConfigError,
    check_compile_backend,
    described_settings,
    flag_rows,
    help_of,
    plan_conflict,
    read_settings_file,
    to_check_before_a_plan,
    trainer_flag,
)
from hf_zero.settings.environment import (
    COLLECTIVE_TIMEOUT_ENV,
    DEFAULT_COLLECTIVE_TIMEOUT,
    processes_per_node,
)
from hf_zero.settings.flag_names import (
    DDP_TIMEOUT_FLAG,
    ENGINE_FLAGS,
    EXTRA_FLAGS,
    TRAINER_OWNED,
    check_flag_names,
)

logger = logging.get_logger(__name__)

def _flag_field(name: str, setting: Any, hint: Any) -> tuple[str, Any, Any]:
    """The --zero_* dataclass field for an engine setting: optional, None when not given. A PLANNED one also takes
    `auto` (its choices then read as strings: HfArgumentParser gives a field one type)."""
    metadata: dict[str, Any] = {"help": help_of(setting)}
    if setting.metadata["choices"]:
        metadata["choices"] = list(setting.metadata["choices"])
    if setting.name in PLANNED:
        metadata["choices"] = [str(choice) for choice in metadata["choices"]] + [AUTO]
        metadata["help"] += f"; auto: {PLANNED_HELP}, by ZeroTrainer (docs/plan.md)"
        hint = hint | str
    if hint is bool:  # given bare (--zero_cpu_checkpointing) or with a value, as the Trainer's switches are
        metadata.update(nargs="?", const=True)
    optional = hint if type(None) in typing.get_args(hint) else hint | None
    return name, optional, field(default=None, metadata=metadata)


def _engine_flag_fields() -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(ZeroConfig)
    settings = {s.name: s for s in described_settings()}
    return [_flag_field(flag, settings[key], hints[key]) for flag, key in ENGINE_FLAGS.items()]


def _post_init(self: Any) -> None:
    if self.fsdp:
        raise ZeroConfigError("--fsdp and hf_zero's ZeRO engine cannot both run the training: drop --fsdp and use "
                              "--zero_stage (see the README's flag table)")
    _take_deepspeed_config(self)
    # The launcher's layout, read before transformers sets up its own (accelerate may fill in LOCAL_WORLD_SIZE);
    # self.world_size is 1 when transformers does not start distributed training.
    processes = dist.get_world_size() if dist.is_initialized() else environment.world_size()
    per_node = processes_per_node(processes)
    if self.ddp_timeout is None:  # before transformers starts the process group with it
        self.ddp_timeout = math.ceil(collective_timeout().total_seconds())
    rendezvous_apart_from_earlier_starts()  # a script under plain torchrun --max-restarts too
    _take_accelerate_dynamo(self)  # before transformers fills --torch_compile_backend's default in
    super(ZeroArgumentsMixin, self).__post_init__()
    _check_engine_flags(self, processes, per_node)
    if self.zero_deepspeed is not None and (warning := self.zero_deepspeed.warning()) \
            and environment.integer("RANK", 0, 0) == 0:
        logger.warning(warning)
    # The engine keeps the fp32 masters and casts the model itself; accelerate's autocast or
    # GradScaler on top would cast twice and scale the loss twice.
    self.mixed_precision = "no"
    if self.zero_engine_config.zero_stage == 3 and self.zero_init_partitioned:
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


def _take_deepspeed_config(args: Any) -> None:
    """--deepspeed, or `accelerate launch --use_deepspeed`, names the configuration hf_zero's engine reads (as
    --zero_config does); neither transformers nor accelerate may start DeepSpeed itself."""
    given = [(flag, config) for flag, config in (("--deepspeed", args.deepspeed), ("--zero_config", args.zero_config),
                                                 ("accelerate launch --use_deepspeed", _accelerate_deepspeed(args)))
             if config]
    if len(given) > 1:
        named = [f"{flag} {config}" if isinstance(config, str) else flag for flag, config in given]
        raise ZeroConfigError(f"{' and '.join(named)} each name the engine's configuration; give one")
    if given:
        args.zero_config_flag, args.zero_config = given[0]
    args.deepspeed = None


def _accelerate_deepspeed(args: Any) -> str | dict[str, Any] | None:
    """What `accelerate launch --use_deepspeed` hands the processes (accelerate's prepare_deepspeed_cmd_env):
    its --deepspeed_config_file, or its DeepSpeed flags as a configuration. Turned off in this process, so that
    accelerate builds no DeepSpeed plugin."""
    env = os.environ
    if not environment.truth("ACCELERATE_USE_DEEPSPEED", False):  # "1" too, as transformers reads it
        return None
    env["ACCELERATE_USE_DEEPSPEED"] = "false"
    if env.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
        raise ZeroConfigError("accelerate launch --deepspeed_moe_layer_cls_names is DeepSpeed's; hf_zero gathers "
                              "whole units: drop it (and see --zero_unit_module_classes)")
    if not environment.truth("ACCELERATE_DEEPSPEED_ZERO3_INIT", True):
        args.zero_init_partitioned = False
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        return env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    # accelerate's default stage is 2
    zero: dict[str, Any] = {"stage": environment.integer("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2, 0)}
    for key, name in (("offload_optimizer", "OFFLOAD_OPTIMIZER_DEVICE"), ("offload_param", "OFFLOAD_PARAM_DEVICE")):
        if env.get(f"ACCELERATE_DEEPSPEED_{name}"):
            zero[key] = {"device": env[f"ACCELERATE_DEEPSPEED_{name}"]}
    if env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"):
        zero["stage3_gather_16bit_weights_on_model_save"] = env["ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"]
    config: dict[str, Any] = {"zero_optimization": zero}
    if env.get("ACCELERATE_GRADIENT_CLIPPING") not in (None, "none"):
        config["gradient_clipping"] = environment.number("ACCELERATE_GRADIENT_CLIPPING")
    if env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        config["gradient_accumulation_steps"] = environment.integer("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1, 1)
    return config


def _check_engine_flags(args: Any, processes: int, per_node: int) -> None:
    """The validation of the engine flags, for the arguments dataclass and for a launcher's parse alike;
    `processes` in all and `per_node` on each node."""
    args.zero_engine_config = zero_config_from_flags(args, processes)
    if args.zero_planned and processes % per_node:
        raise ZeroConfigError(f"{trainer_flag(args.zero_planned[0])} auto plans whole nodes: {processes} processes "
                              f"are not a whole number of nodes of {per_node} (torchrun's LOCAL_WORLD_SIZE); give "
                              f"{trainer_flag(args.zero_planned[0])} a value")
    check_tensor_parallel_flags(args)
    check_tp_within_a_node(args.tensor_parallel_size, per_node, args.tensor_parallel_across_nodes)
    if not args.use_cpu and has_accelerator() and per_node > torch.cuda.device_count():
        raise ZeroConfigError(f"{per_node} processes per node but this machine has {torch.cuda.device_count()} "
                              f"GPU(s): each process needs a GPU of its own. Start at most that many per node "
                              f"(--nproc_per_node), or pass --use_cpu to train on CPU")
    if processes > 1 and not args.use_cpu and not has_accelerator():
        raise ZeroConfigError(f"{processes} processes without a GPU need --use_cpu: without it transformers does "
                              f"not start distributed training on CPU, and each process would train alone on the same "
                              f"data into the same output folder")


# The Trainer's --ddp_timeout (torch's 30 minutes by default) with hf_zero's default instead, so that a rank
# that stopped answering is an error within minutes under the Trainer too; resolved in _post_init.
DDP_TIMEOUT = (DDP_TIMEOUT_FLAG, int | None, field(default=None, metadata={
    "help": f"seconds a rank waits in one collective before it fails (default {COLLECTIVE_TIMEOUT_ENV}, else "
            f"{DEFAULT_COLLECTIVE_TIMEOUT.total_seconds():.0f})"}))

ZeroArgumentsMixin = make_dataclass(
    "ZeroArgumentsMixin",
    _engine_flag_fields() + [
        (name, str | None if default is None else type(default),
         field(default=default, metadata={"help": text if default is None else f"{text} (default {default})"}))
        for name, (default, text, _, _) in EXTRA_FLAGS.items()] + [DDP_TIMEOUT],
    namespace={"__post_init__": _post_init, "__module__": __name__,
               "__doc__": "The engine's settings as Trainer flags (DeepSpeed config key in brackets)."})


def flags_help() -> str:
    """The flags hf_zero adds to the script's TrainingArguments, as argparse lists them: for `hf-zero run --help`,
    which parses only the launch flags itself and hands the rest to the script."""
    listing = HfArgumentParser(ZeroArgumentsMixin).format_help().split("\noptions:\n", 1)[1]
    return "\n".join(line for line in listing.splitlines() if not line.lstrip().startswith("-h, --help"))


# The Trainer's own flags the engine settings depend on, read by check_script_flags with the --zero_* flags
# (a DeepSpeed configuration is checked against the batch sizes and optimizer hyperparameters).
_TRAINER_FLAGS_READ = ("bf16", "fp16", "max_grad_norm", "eval_use_gather_object", "use_cpu", "deepspeed",
                       "bf16_full_eval", "fp16_full_eval", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "torch_compile",
                       "torch_compile_backend", "torch_compile_mode")


class _FlagParser(HfArgumentParser):
    """A parse error is a ZeroConfigError (one line) rather than the usage and an exit."""

    def error(self, message: str) -> typing.NoReturn:
        raise ZeroConfigError(message)


def check_script_flags(script_args: list[str], world_size: int, per_node: int | None = None) -> None:
    """Resolves the --zero_* flags (and --zero_config, --tensor_parallel_size) among a script's arguments as the
    script's TrainingArguments will, so a launcher can refuse a bad one before any process starts; the
    script's other flags are its own. Raises ZeroConfigError in one line, naming the flag."""
    check_flag_names(script_args)
    trainer_hints = typing.get_type_hints(TrainingArguments)
    trainer_fields = make_dataclass("TrainerFlags", [
        (f.name, trainer_hints[f.name], field(default=f.default)) for f in fields(TrainingArguments)
        if f.name in _TRAINER_FLAGS_READ])
    # No --help of its own: the script's parser answers that.
    args, _ = _FlagParser([ZeroArgumentsMixin, trainer_fields], add_help=False).parse_known_args(script_args)
    args.world_size = world_size
    _take_deepspeed_config(args)
    _check_engine_flags(args, world_size, per_node or world_size)


def zero_config_from_flags(args: Any, processes: int = 1) -> ZeroConfig:
    """Flags given > keys in --zero_config (hf_zero's, or a DeepSpeed configuration filled and checked against the
    Trainer's flags, kept as `args.zero_deepspeed`) > engine defaults; raises ZeroConfigError naming the flag."""
    settings: dict[str, Any] = {}
    args.zero_deepspeed = None
    if args.zero_config:
        settings, args.zero_deepspeed = _read_config_file(args, processes)
    # `auto` settings keep their default until ZeroTrainer plans them (hf_zero.hf.auto); the rest are checked now.
    args.zero_planned = tuple(key for flag, key in ENGINE_FLAGS.items() if getattr(args, flag) == AUTO)
    for flag, key in ENGINE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None and value != AUTO:
            settings[key] = int(value) if key == "zero_stage" and isinstance(value, str) and value.isdigit() \
                else value
            if args.zero_deepspeed is not None and key in args.zero_deepspeed.sized_by_model:
                args.zero_deepspeed = dataclasses.replace(args.zero_deepspeed, sized_by_model=tuple(
                    name for name in args.zero_deepspeed.sized_by_model if name != key))
    # The Trainer scales each micro-batch's loss for accumulation and decides where each window
    # ends (the last one of an epoch may be short), so the engine reduces when told and does not
    # divide the loss again.
    settings.update(dtype=_engine_dtype(args), gradient_clipping=float(args.max_grad_norm or 0.0),
                    gradient_accumulation_steps=1, compile=deepspeed_config.compiles(args),
                    compile_backend=args.torch_compile_backend, compile_mode=args.torch_compile_mode)
    if args.zero_planned:
        check_plannable(args, settings)
    config = ZeroConfig(**settings)
    config.validate(name=trainer_flag)
    check_compile_backend(config, trainer_flag)
    return config


def check_plannable(args: Any, settings: dict[str, Any]) -> None:
    """What a plan of --zero_stage (or an offload) auto cannot cover, refused before any work starts; the planned
    settings are taken out of `settings` (a --zero_config file's value too: the flag asked for the plan's)."""
    tp = args.tensor_parallel_size
    conflict = plan_conflict(tp if isinstance(tp, int) else 1, trainer_flag(args.zero_planned[0]))
    if conflict:
        raise ZeroConfigError(conflict)
    args.zero_nvme_to_plan, args.zero_stages = to_check_before_a_plan(settings, args.zero_planned, trainer_flag)


def _engine_dtype(args: Any) -> str:
    """--fp16 or --bf16, else what `accelerate launch --mixed_precision` asked for, which transformers reads into
    `mixed_precision` (ACCELERATE_MIXED_PRECISION): the engine then computes in that dtype over fp32 masters,
    where the stock Trainer would autocast to it over fp32 weights."""
    if args.fp16:
        return "fp16"
    if args.bf16:
        return "bf16"
    from_accelerate = getattr(args, "mixed_precision", None) or "no"
    if from_accelerate not in ("no", "fp16", "bf16"):
        raise ZeroConfigError(f"accelerate's --mixed_precision {from_accelerate} is not a dtype hf_zero's engine "
                              f"computes in: launch with --mixed_precision bf16, fp16 or no")
    return "fp32" if from_accelerate == "no" else from_accelerate


def readme_flag_table() -> str:
    """README's table of the Trainer flags: the engine settings' rows (config.flag_rows), then the rest.
    Regenerate it with `python -c "from hf_zero.hf.arguments import readme_flag_table; print(readme_flag_table())"`."""
    rows = [f"| `--{name} {metavar}` | {'' if default is None else default} | {key} | {text} |"
            for name, (default, text, metavar, key) in EXTRA_FLAGS.items()]
    return "\n".join(["| flag | default | DeepSpeed config key it replaces | what it does |", "|---|---|---|---|",
                      *flag_rows(), *rows])


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


def _read_config_file(args: Any, processes: int) -> tuple[dict[str, Any], deepspeed_config.DeepSpeedConfig | None]:
    """The settings of --zero_config (a file, or the dict a script passed as `deepspeed=`), and what a DeepSpeed
    configuration asks beyond them."""
    config = args.zero_config
    flag = getattr(args, "zero_config_flag", "--zero_config")
    source = f"{flag} " + (config if isinstance(config, str) else "(a dict)")
    settings = dict(config) if isinstance(config, dict) else read_settings_file(config, flag)
    if deepspeed_config.is_deepspeed(settings):
        tp = args.tensor_parallel_size if isinstance(args.tensor_parallel_size, int) else 1
        deepspeed = deepspeed_config.read(settings, source, args, max(1, processes // max(1, tp)))
        return dict(deepspeed.settings), deepspeed
    known = {f.name for f in fields(ZeroConfig)} - set(TRAINER_OWNED)
    for key in settings:
        if key in TRAINER_OWNED:
            raise ZeroConfigError(f"{source} sets {key!r}, which the Trainer's {TRAINER_OWNED[key]} "
                                  f"sets; remove it from the file")
        if key not in known:
            raise ZeroConfigError(f"{source}: unknown setting {key!r}; known: {sorted(known)}")
    return settings, None


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """transformers.TrainingArguments with the --zero_* flags; use with hf_zero.ZeroTrainer."""


@dataclass
class ZeroSeq2SeqTrainingArguments(ZeroArgumentsMixin, Seq2SeqTrainingArguments):
    """transformers.Seq2SeqTrainingArguments with the --zero_* flags; use with hf_zero.ZeroSeq2SeqTrainer."""
