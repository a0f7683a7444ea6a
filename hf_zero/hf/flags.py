"""The Trainer's --zero_* flags, made from the ZeroConfig declarations and resolved into one validated ZeroConfig:
for ZeroTrainingArguments (hf_zero.hf.arguments) when a script parses them, and for a launcher (`hf-zero run`),
which checks a script's flags before any process starts. Nothing here imports transformers' TrainingArguments or
torch: that import takes 3-4 s on a 2-core machine, which the launcher would pay before starting the processes
that import it again.

Every flag defaults to None, meaning "not given": a flag given on the command line wins over the
same key in --zero_config FILE.json, which wins over the engine's default. Precision, gradient
accumulation and clipping are the Trainer's own flags (--bf16/--fp16, --gradient_accumulation_steps,
--max_grad_norm), so neither a --zero_* flag nor the file sets them a second time.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys
import typing
from dataclasses import field, fields, make_dataclass
from pathlib import Path
from typing import Any

from transformers.hf_argparser import HfArgumentParser

from hf_zero.settings import deepspeed_config, environment
from hf_zero.settings.config import (
    AUTO,
    PLANNED,
    PLANNED_HELP,
    ZeroConfig,
    ZeroConfigError,
    check_compile_backend,
    check_tp_within_a_node,
    described_settings,
    help_of,
    plan_conflict,
    read_settings_file,
    to_check_before_a_plan,
    trainer_flag,
)
from hf_zero.settings.environment import COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT
from hf_zero.settings.flag_names import (
    DDP_TIMEOUT_FLAG,
    ENGINE_FLAGS,
    EXTRA_FLAGS,
    TRAINER_OWNED,
    check_flag_names,
)


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


def take_deepspeed_config(args: Any) -> None:
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


def check_engine_flags(args: Any, processes: int, per_node: int) -> None:
    """The validation of the engine flags, for the arguments dataclass and for a launcher's parse alike;
    `processes` in all and `per_node` on each node."""
    args.zero_engine_config = zero_config_from_flags(args, processes)
    if args.zero_planned and processes % per_node:
        raise ZeroConfigError(f"{trainer_flag(args.zero_planned[0])} auto plans whole nodes: {processes} processes "
                              f"are not a whole number of nodes of {per_node} (torchrun's LOCAL_WORLD_SIZE); give "
                              f"{trainer_flag(args.zero_planned[0])} a value")
    check_tensor_parallel_flags(args)
    check_tp_within_a_node(args.tensor_parallel_size, per_node, args.tensor_parallel_across_nodes)
    import torch  # here: what a machine's GPUs are needs torch, which a launcher imports to start the processes

    from hf_zero.runtime.device import has_accelerator

    if not args.use_cpu and has_accelerator() and per_node > torch.cuda.device_count():
        raise ZeroConfigError(f"{per_node} processes per node but this machine has {torch.cuda.device_count()} "
                              f"GPU(s): each process needs a GPU of its own. Start at most that many per node "
                              f"(--nproc_per_node), or pass --use_cpu to train on CPU")
    if processes > 1 and not args.use_cpu and not has_accelerator():
        raise ZeroConfigError(f"{processes} processes without a GPU need --use_cpu: without it transformers does "
                              f"not start distributed training on CPU, and each process would train alone on the same "
                              f"data into the same output folder")


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
    flags = make_dataclass("ScriptFlags", zero_flag_fields() + trainer_flag_fields())
    # No --help of its own: the script's parser answers that.
    args, _ = _FlagParser([flags], add_help=False).parse_known_args(script_args)
    args.world_size = world_size
    take_deepspeed_config(args)
    check_engine_flags(args, world_size, per_node or world_size)


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


def zero_flag_fields() -> list[tuple[str, Any, Any]]:
    """hf_zero's Trainer flags as dataclass fields: the engine settings' --zero_* flags, the other flags hf_zero adds,
    and --ddp_timeout with hf_zero's default; ZeroArgumentsMixin's fields, and the launcher's parse."""
    extra = [(name, str | None if default is None else type(default),
              field(default=default, metadata={"help": text if default is None else f"{text} (default {default})"}))
             for name, (default, text, _, _) in EXTRA_FLAGS.items()]
    # The Trainer's --ddp_timeout (torch's 30 minutes by default) with hf_zero's default instead, so that a rank
    # that stopped answering is an error within minutes under the Trainer too; resolved in ZeroArgumentsMixin.
    ddp_timeout = (DDP_TIMEOUT_FLAG, int | None, field(default=None, metadata={
        "help": f"seconds a rank waits in one collective before it fails (default {COLLECTIVE_TIMEOUT_ENV}, else "
                f"{DEFAULT_COLLECTIVE_TIMEOUT.total_seconds():.0f})"}))
    return _engine_flag_fields() + extra + [ddp_timeout]


# The names a TrainingArguments annotation of a flag in _TRAINER_FLAGS_READ is written with.
_ANNOTATION_NAMES = {"bool": bool, "int": int, "float": float, "str": str, "dict": dict, "list": list, "None": None,
                     "Any": Any, "Optional": typing.Optional, "Union": typing.Union}


def trainer_flag_fields() -> list[tuple[str, Any, Any]]:
    """The Trainer's flags hf_zero reads (_TRAINER_FLAGS_READ) as dataclass fields, typed and defaulted as
    transformers' TrainingArguments declares them. Read from its source, as `ast` parses it, unless the class is
    imported already: importing it is what the launcher's check must not pay. A source the reading does not follow
    (a default that is not a literal, a flag declared elsewhere than in the class's own body, no readable file)
    makes it import the class, for the same fields."""
    module = sys.modules.get("transformers.training_args")
    if module is None:
        try:
            declared = _declared_in_source(Path(importlib.util.find_spec("transformers.training_args").origin))
            if {name for name, _, _ in declared} == set(_TRAINER_FLAGS_READ):
                return declared
        except (StopIteration, ValueError, NameError, SyntaxError, TypeError, AttributeError, OSError):
            pass
        module = importlib.import_module("transformers.training_args")
    hints = typing.get_type_hints(module.TrainingArguments)
    return [(f.name, hints[f.name], field(default=f.default)) for f in fields(module.TrainingArguments)
            if f.name in _TRAINER_FLAGS_READ]


def _declared_in_source(source: Path) -> list[tuple[str, Any, Any]]:
    """_TRAINER_FLAGS_READ's fields as the class TrainingArguments in `source` declares them, in its order."""
    declared = next(node for node in ast.parse(source.read_text()).body
                    if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments")
    found = []
    for node in declared.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id in _TRAINER_FLAGS_READ:
            default = node.value
            if isinstance(default, ast.Call) and getattr(default.func, "id", None) == "field":
                default = next(keyword.value for keyword in default.keywords if keyword.arg == "default")
            hint = eval(ast.unparse(node.annotation), {"__builtins__": {}}, _ANNOTATION_NAMES)  # names only
            found.append((node.target.id, hint, field(default=ast.literal_eval(default))))
    return found
