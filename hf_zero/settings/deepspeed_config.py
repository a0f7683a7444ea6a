"""A DeepSpeed configuration (ds_config.json) read as it is.

Users arrive with the file they ran under DeepSpeed, often transformers' documented ds_config_zero2.json or
ds_config_zero3.json. `read` turns it into ZeroConfig settings. Under the Trainer it also fills and checks the
file against the TrainingArguments as transformers' DeepSpeed integration does (HfTrainerDeepSpeedConfig):
"auto" takes the Trainer's value, and a value that disagrees with a Trainer flag is refused naming both.

Every key is one of four kinds:
  - a ZeroConfig setting: the DeepSpeed key each setting declares (hf_zero/settings/config.py), numbers in any JSON
    form (5e7 is an integer);
  - one of the Trainer's own values: batch sizes, precision, clipping, the optimizer's and the scheduler's
    hyperparameters;
  - a key that means nothing for hf_zero (contiguous_gradients: its gradients always lie in one flat buffer),
    named with the reason in one warning;
  - anything else, refused by name before any work starts, never dropped.
Keys the file leaves out take hf_zero's defaults, not DeepSpeed's (docs/deepspeed.md lists where they differ).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:  # torch is imported where an optimizer is built: the settings layer is read without it
    import torch
    from torch import nn

from hf_zero.settings.config import (
    ZeroConfig,
    ZeroConfigError,
    described_settings,
    did_you_mean,
    read_settings_file,
)

AUTO = "auto"

# The DeepSpeed key each ZeroConfig setting declares, where it is one key of the same meaning.
SETTING_OF_KEY = {s.metadata["deepspeed"]: s.name for s in described_settings()
                  if s.metadata["deepspeed"] and re.fullmatch(r"[a-z0-9_.]+", s.metadata["deepspeed"])}
# DeepSpeed accepts its stage-3 keys with and without the prefix (pydantic aliases).
SETTING_OF_KEY.update({key.replace(".stage3_", "."): name for key, name in list(SETTING_OF_KEY.items())
                       if ".stage3_" in key})
# The Trainer sets these itself (--gradient_accumulation_steps, --max_grad_norm, --bf16/--fp16): under the
# Trainer the file's values are checked against its flags rather than taken.
# The compile block's keys hf_zero reads: the Trainer's --torch_compile, --torch_compile_backend, --torch_compile_mode.
COMPILE_KEYS = ("compile.enabled", "compile.backend", "compile.kwargs.mode")
TRAINER_KEYS = ("gradient_accumulation_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled", *COMPILE_KEYS)

_OUR_BUFFERS = "hf_zero sizes and pins its own offload buffers"
_ONE_WINDOW = ("hf_zero holds the unit in use and the next, plus what --zero_prefetch_bucket_size prefetches: "
               "that bounds the gathered parameters")
_MONITORS = "DeepSpeed's own logging; the Trainer's --logging_steps and --report_to do this"
# Keys, or whole blocks, that mean nothing for hf_zero, with why.
WITHOUT_EFFECT = {
    "zero_optimization.contiguous_gradients": "hf_zero's gradients always lie in one flat buffer",
    "zero_optimization.reduce_scatter": "hf_zero always reduce-scatters gradients",
    "zero_optimization.allgather_partitions": "hf_zero always all-gathers the updated partitions",
    "zero_optimization.use_multi_rank_bucket_allreduce": "hf_zero reduces each bucket in one collective",
    "zero_optimization.sub_group_size": "hf_zero steps each rank's shard whole, in tiles of "
                                        "--zero_nvme_tile_numel on NVMe",
    "zero_optimization.stage3_max_live_parameters": _ONE_WINDOW,
    "zero_optimization.stage3_max_reuse_distance": _ONE_WINDOW,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "save_model always writes the whole model",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "save_model always writes the whole model",
    "zero_optimization.elastic_checkpoint": "hf_zero's checkpoints load on any number of ranks",
    "zero_optimization.load_from_fp32_weights": "hf_zero always resumes from the fp32 master weights",
    "zero_optimization.ignore_unused_parameters": "a parameter without a gradient always contributes zeros",
    "zero_optimization.round_robin_gradients": "hf_zero's offloaded gradients are copied by the rank that owns them",
    "zero_optimization.memory_efficient_linear": "hf_zero does not replace the model's Linear layers",
    "zero_optimization.log_trace_cache_warnings": "hf_zero learns the unit order every step",
    "zero_optimization.cpu_offload_use_pin_memory": _OUR_BUFFERS,
    **{f"zero_optimization.offload_{what}.{key}": _OUR_BUFFERS
       for what, keys in (("optimizer", ("pin_memory", "buffer_count", "fast_init", "pipeline", "pipeline_read",
                                         "pipeline_write")),
                          ("param", ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu")))
       for key in keys},
    "aio": "hf_zero streams NVMe in tiles of --zero_nvme_tile_numel elements",
    "activation_checkpointing.contiguous_memory_optimization": "hf_zero's checkpoints always lie in one buffer",
    "activation_checkpointing.number_checkpoints": "hf_zero checkpoints each transformer block",
    "activation_checkpointing.synchronize_checkpoint_boundary": "hf_zero does not time checkpoints",
    "activation_checkpointing.profile": "hf_zero does not time checkpoints",
    "prescale_gradients": "the gradients' average is the same whether divided before or after the sum",
    "fp16.consecutive_hysteresis": "hf_zero's dynamic scale halves at every overflow",
    "bf16.immediate_grad_update": "hf_zero accumulates gradients in the reduce dtype (--zero_reduce_dtype)",
    "bf16.check_grad_overflow": "hf_zero always skips a step whose gradients are not finite",
    "optimizer.params.torch_adam": "hf_zero always steps torch's Adam (or its C++ CPU Adam, which matches it)",
    "zero_allow_untested_optimizer": "hf_zero steps any torch optimizer",
    "zero_force_ds_cpu_optimizer": "hf_zero picks its CPU Adam itself when the optimizer is offloaded",
    "checkpoint": "hf_zero's checkpoints are the Trainer's (--save_strategy, --output_dir)",
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard",
                     "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger"), _MONITORS),
}
# DeepSpeed features hf_zero does not have: a block that turns one on is refused, one with "enabled": false
# means nothing.
FEATURES = {"amp": "apex AMP", "elasticity": "elastic training",
            "autotuning": "the autotuner", "curriculum_learning": "curriculum learning",
            "data_efficiency": "data efficiency", "compression_training": "compression training",
            "sparse_attention": "sparse attention", "zero_optimization.zenflow": "ZenFlow"}
# Keys hf_zero implements only at one value, which is DeepSpeed's default or what hf_zero always does.
# DeepCompile (compile.deepcompile) is DeepSpeed's own compiler passes; hf_zero compiles each block with torch.compile.
ONLY_VALUE = {"gradient_predivide_factor": 1.0, "compile.deepcompile": False,
              "zero_optimization.offload_optimizer.ratio": 1.0,
              "fp16.auto_cast": False, "fp16.fp16_master_weights_and_grads": False,
              "optimizer.params.bias_correction": True, "optimizer.params.amsgrad": False,
              "scheduler.params.last_batch_iteration": -1}
# Keys whose "auto" transformers fills from the model's hidden size (trainer_config_finalize).
SIZED_BY_MODEL = {"reduce_bucket_size": lambda hidden: hidden * hidden,
                  "prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
                  "param_persistence_threshold": lambda hidden: 10 * hidden}
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW"}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")
_TOP_LEVEL = {"zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "train_batch_size",
              "train_micro_batch_size_per_gpu", "communication_data_type", "activation_checkpointing",
              *{key.split(".")[0] for key in [*WITHOUT_EFFECT, *FEATURES, *ONLY_VALUE, *TRAINER_KEYS]}}


@dataclass(frozen=True)
class OptimizerSpec:
    """The `optimizer` block: torch's AdamW (Adam with adam_w_mode false) over every trainable parameter in one
    group, weight decay included, as DeepSpeed builds it from the configuration."""
    decoupled_weight_decay: bool
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        import torch

        optimizer = torch.optim.AdamW if self.decoupled_weight_decay else torch.optim.Adam
        trainable = [p for p in model.parameters() if p.requires_grad]
        return optimizer(trainable, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True)
class SchedulerSpec:
    """The `scheduler` block, DeepSpeed's WarmupLR or WarmupDecayLR; "auto" steps are filled once the Trainer
    knows the number of training steps."""
    kind: str
    min_lr: float
    max_lr: float | None  # None: the optimizer's learning rate (WarmupLR's default)
    warmup_steps: int | str
    total_steps: int | str
    warmup_type: str

    def build(self, optimizer: torch.optim.Optimizer, training_steps: int,
              trainer_warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        """DeepSpeed's schedule as a LambdaLR, so that the Trainer saves and resumes it as its own."""
        import torch

        if self.total_steps not in (AUTO, training_steps) and self.kind == "WarmupDecayLR":
            raise ZeroConfigError(f"DeepSpeed scheduler.params.total_num_steps={self.total_steps} vs the Trainer's "
                                  f"{training_steps} training steps: set it to \"auto\"")
        total = training_steps if self.total_steps == AUTO else self.total_steps
        # transformers keeps an "auto" warmup positive; DeepSpeed warms up over at least 2 steps.
        warmup = max(2, max(1, trainer_warmup_steps) if self.warmup_steps == AUTO else self.warmup_steps)
        base_lrs = [group["lr"] for group in optimizer.param_groups]
        if not all(base_lrs):
            raise ZeroConfigError("DeepSpeed's scheduler needs a learning rate above 0 (--learning_rate)")

        def gamma(iteration: int) -> float:
            if iteration < warmup:
                if self.warmup_type == "log":
                    return math.log(iteration + 1) / math.log(warmup)
                return iteration / warmup
            if self.kind == "WarmupDecayLR":
                return max(0.0, (total - iteration) / max(1.0, total - warmup))
            return 1.0

        def factors(base_lr: float) -> Any:
            max_lr = base_lr if self.max_lr is None else self.max_lr

            # DeepSpeed sets min_lr when it is built and moves the rate after each optimizer step, so step k
            # runs at gamma(k - 1).
            def factor(step: int) -> float:
                return (self.min_lr + (max_lr - self.min_lr) * (gamma(step - 1) if step else 0.0)) / base_lr
            return factor

        return torch.optim.lr_scheduler.LambdaLR(optimizer, [factors(lr) for lr in base_lrs])


@dataclass(frozen=True)
class DeepSpeedConfig:
    """What a DeepSpeed configuration asks of hf_zero."""
    source: str  # how messages name the configuration ("--deepspeed ds_config.json")
    settings: dict[str, Any]  # ZeroConfig keys
    sized_by_model: tuple[str, ...]  # settings left "auto" that transformers fills from the model's hidden size
    optimizer: OptimizerSpec | None
    scheduler: SchedulerSpec | None
    without_effect: tuple[tuple[str, str], ...]  # (key or block, why) for each that means nothing for hf_zero

    def warning(self) -> str | None:
        """One line naming the keys that mean nothing for hf_zero, grouped by why."""
        keys_of: dict[str, list[str]] = {}
        for key, why in self.without_effect:
            keys_of.setdefault(why, []).append(key)
        if not keys_of:
            return None
        return (f"{self.source}: DeepSpeed keys not used, as they mean nothing for hf_zero: "
                + "; ".join(f"{', '.join(keys)} ({why})" for why, keys in keys_of.items()))

    def sized_for(self, config: ZeroConfig, model: nn.Module) -> ZeroConfig:
        """`config` with the "auto" sizes filled from the model's hidden size as transformers fills them."""
        if not self.sized_by_model:
            return config
        hidden = hidden_size(getattr(model, "config", None))
        if hidden is None:
            raise ZeroConfigError(f"the model's config has no hidden_size to fill the DeepSpeed \"auto\" values of "
                                  f"{list(self.sized_by_model)} from: give these keys numbers")
        return replace(config, **{name: SIZED_BY_MODEL[name](hidden) for name in self.sized_by_model})


def hidden_size(model_config: Any) -> int | None:
    """The hidden size transformers' DeepSpeed integration reads: hidden_size, the largest of hidden_sizes, or
    the same of a text_config."""
    for config in (model_config, getattr(model_config, "text_config", None)):
        if getattr(config, "hidden_size", None):
            return config.hidden_size
        if getattr(config, "hidden_sizes", None):
            return max(config.hidden_sizes)
    return None


def is_deepspeed(config: dict[str, Any]) -> bool:
    """Whether a JSON object is a DeepSpeed configuration rather than one of hf_zero's ZeroConfig keys; a mix of
    both is refused."""
    ours = {s.name for s in described_settings()}
    theirs, only_ours = set(config) & (_TOP_LEVEL - ours), set(config) - _TOP_LEVEL
    if theirs and only_ours & ours:
        raise ZeroConfigError(f"the configuration mixes DeepSpeed keys {sorted(theirs)} with hf_zero keys "
                              f"{sorted(only_ours & ours)}; write it in one form")
    return bool(theirs)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; a block's own keys under its dotted name."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def read(config: dict[str, Any], source: str, trainer: Any = None, data_parallel_ranks: int = 1) -> DeepSpeedConfig:
    """Reads a DeepSpeed configuration. `trainer`: the TrainingArguments the file is filled from and checked
    against (None for hf_zero.initialize, where "auto" has nothing to take its value from)."""
    flat = flatten({"bf16" if key == "bfloat16" else key: value for key, value in config.items()})
    if isinstance(flat.get("zero_optimization"), bool):
        raise ZeroConfigError(f"{source}: zero_optimization must be a block ({{\"stage\": 2, ...}}), not "
                              f"{flat['zero_optimization']}")
    trainer_values = _trainer_values(trainer, data_parallel_ranks) if trainer is not None else {}
    return _Reader(flat, source, trainer_values).result()


def compiles(args: Any) -> bool:
    """--torch_compile, also turned on by --torch_compile_backend or --torch_compile_mode (as TrainingArguments
    does once parsed)."""
    return bool(args.torch_compile or args.torch_compile_backend or args.torch_compile_mode)


def _trainer_values(args: Any, data_parallel_ranks: int) -> dict[str, tuple[Any, str]]:
    """What "auto" becomes under the Trainer, keyed as in the file, with the flag that gives it (as
    HfTrainerDeepSpeedConfig.trainer_config_process fills them)."""
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": (micro, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (steps, "--gradient_accumulation_steps"),
        "train_batch_size": (data_parallel_ranks * micro * steps,
                             f"--per_device_train_batch_size x --gradient_accumulation_steps x "
                             f"{data_parallel_ranks} data-parallel ranks"),
        "gradient_clipping": (args.max_grad_norm, "--max_grad_norm"),
        "fp16.enabled": (bool(args.fp16 or args.fp16_full_eval), "--fp16"),
        "bf16.enabled": (bool(args.bf16 or args.bf16_full_eval), "--bf16"),
        "optimizer.params.lr": (args.learning_rate, "--learning_rate"),
        "optimizer.params.betas": ([args.adam_beta1, args.adam_beta2], "--adam_beta1, --adam_beta2"),
        "optimizer.params.eps": (args.adam_epsilon, "--adam_epsilon"),
        "optimizer.params.weight_decay": (args.weight_decay, "--weight_decay"),
        "compile.enabled": (compiles(args), "--torch_compile"),
        "compile.backend": (args.torch_compile_backend or "inductor", "--torch_compile_backend"),
        "compile.kwargs.mode": (args.torch_compile_mode, "--torch_compile_mode"),
        "scheduler.params.warmup_min_lr": (0.0, None),  # not a Trainer flag: filled, never checked
        "scheduler.params.warmup_max_lr": (args.learning_rate, "--learning_rate"),
    }


class _Reader:
    """One pass over the file's keys, each taken, filled, checked or named, then the result."""

    def __init__(self, flat: dict[str, Any], source: str, trainer_values: dict[str, tuple[Any, str]]) -> None:
        self.flat, self.source, self.trainer = flat, source, trainer_values
        self.settings: dict[str, Any] = {}
        self.sized_by_model: list[str] = []
        self.without_effect: dict[str, str] = {}  # key or block -> why
        self.mismatches: list[str] = []

    def fail(self, message: str) -> None:
        raise ZeroConfigError(f"{self.source}: {message}")

    def value(self, key: str, default: Any = None) -> Any:
        """The file's value, with "auto" filled from the Trainer (and checked against it when it is a number)."""
        value = self.flat.get(key, default)
        if key not in self.trainer:
            if value == AUTO:
                self.fail(f"{key} is \"auto\", which transformers' DeepSpeed integration does not fill; give a value"
                          if self.trainer else f"{key} is \"auto\", which only the Hugging Face Trainer fills (from "
                                               f"its TrainingArguments); hf_zero.initialize needs a value")
            return value
        wanted, flag = self.trainer[key]
        if value == AUTO:
            return wanted
        if key in self.flat and flag is not None and not _same(value, wanted):
            self.mismatches.append(f"{key}={value} vs the Trainer's {flag}={wanted}")
        return value

    def result(self) -> DeepSpeedConfig:
        precision = self._precision()
        for key in list(self.flat):
            self._take(key, precision)
        optimizer, scheduler = self._optimizer(), self._scheduler()
        if self.mismatches:
            self.fail("these DeepSpeed values disagree with the TrainingArguments: " + "; ".join(self.mismatches)
                      + ". Set them to \"auto\" (as transformers' DeepSpeed integration asks), or change the flags")
        return DeepSpeedConfig(self.source, self.settings, tuple(self.sized_by_model), optimizer, scheduler,
                               tuple(self.without_effect.items()))

    def _precision(self) -> str:
        """The file's precision; a block it leaves out is the Trainer's (or off, for hf_zero.initialize)."""
        fp16, bf16 = (bool(self.value(key) if key in self.flat else self.trainer.get(key, (False,))[0])
                      for key in ("fp16.enabled", "bf16.enabled"))
        if fp16 and bf16:
            self.fail("fp16.enabled and bf16.enabled are both true; enable one")
        precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        if not self.trainer:
            self.settings["dtype"] = precision
        return precision

    def _take(self, key: str, precision: str) -> None:
        value = self.flat[key]
        block = key.split(".")[0]
        named = key in ONLY_VALUE or key in WITHOUT_EFFECT
        if key in ("fp16.enabled", "bf16.enabled") or block in ("optimizer", "scheduler") and not named:
            return  # read by _precision, _optimizer and _scheduler
        if block in ("fp16", "bf16") and precision != block:
            self.without_effect[block] = f"{block} is not enabled"
        elif feature := next((f for f in FEATURES if key == f or key.startswith(f + ".")), None):
            if self.flat.get(f"{feature}.enabled", key != feature):  # an empty block turns nothing on
                self.fail(f"{key}: {FEATURES[feature]} is a DeepSpeed feature hf_zero does not have; remove the "
                          f"\"{feature}\" block (or set its \"enabled\" to false)")
            self.without_effect[feature] = "not enabled"
        elif key in ONLY_VALUE:
            if not _same(value, ONLY_VALUE[key]):
                self.fail(f"{key}={value} is not implemented by hf_zero, which only runs it as {ONLY_VALUE[key]}; "
                          f"set it so or remove it")
        elif named_as := next((k for k in (key, block) if k in WITHOUT_EFFECT), None):
            self.without_effect[named_as] = WITHOUT_EFFECT[named_as]
        elif key == "fp16.hysteresis":
            if not _same(value, 1):
                self.fail(f"fp16.hysteresis={value}: hf_zero's dynamic loss scale halves at every overflow "
                          f"(hysteresis 1); set it to 1 or remove it, or train in bf16 (--bf16)")
        elif block == "compile" and key != "compile.enabled":
            self._compile_key(key, value)
        elif key in ("train_micro_batch_size_per_gpu", "train_batch_size") or key in TRAINER_KEYS:
            self._batch_or_trainer_key(key)
        elif key in ("zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"):
            if self.settings.get("nvme_path", value) != value:
                self.fail(f"offload_optimizer.nvme_path and offload_param.nvme_path differ ({self.settings['nvme_path']!r}"
                          f" and {value!r}); hf_zero keeps both in one folder")
            self.settings["nvme_path"] = value
        elif key in ("zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param"):
            if value:  # DeepSpeed's older spelling of the offload blocks
                self.settings["offload_optimizer" if key.endswith("offload") else "offload_param"] = "cpu"
        elif key == "communication_data_type":
            names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}
            if value not in names:
                self.fail(f"communication_data_type must be one of {sorted(names)}; got {value!r}")
            self.settings["reduce_dtype"] = names[value]
        elif key in SETTING_OF_KEY:
            self._setting(key, SETTING_OF_KEY[key], value)
        else:
            self.fail(f"{key} is not a DeepSpeed key hf_zero reads{did_you_mean(key, self.known_keys())}; remove it "
                      f"(docs/deepspeed.md lists the keys hf_zero reads and those it refuses)")

    def _compile_key(self, key: str, value: Any) -> None:
        """A compile key besides `enabled`: an empty block means nothing, and so does the whole block while it is
        not enabled (DeepSpeed's default); the backend and mode are taken; anything else is refused saying why."""
        if value == {}:
            self.without_effect[key] = "an empty block"
        elif not self.value("compile.enabled", False):
            self.without_effect["compile"] = "compile.enabled is not true"
        elif key in COMPILE_KEYS:
            self._batch_or_trainer_key(key)
        elif key.startswith("compile.kwargs."):
            self.fail(f"{key}: hf_zero passes torch.compile its backend and mode only (compile.backend, "
                      f"compile.kwargs.mode); remove it")
        else:
            self.fail(f"{key} is not a key of DeepSpeed's compile block that hf_zero reads: it reads enabled, backend "
                      f"and kwargs.mode, and runs no DeepCompile (compile.deepcompile); remove it")

    def _batch_or_trainer_key(self, key: str) -> None:
        if self.trainer:
            self.value(key)  # filled or checked: the Trainer's own flags set these
        elif key in ("gradient_accumulation_steps", "gradient_clipping") or key.startswith("compile."):
            self._setting(key, SETTING_OF_KEY[key], self.flat[key])
        elif key == "train_batch_size" and "gradient_accumulation_steps" not in self.flat:
            self.fail("train_batch_size: hf_zero.initialize trains on the batches your loop gives it and does not "
                      "derive gradient_accumulation_steps from it; give gradient_accumulation_steps")
        else:
            self.without_effect[key] = "hf_zero.initialize trains on the batches your loop gives it"

    def _setting(self, key: str, name: str, value: Any) -> None:
        if value == AUTO and name in SIZED_BY_MODEL and self.trainer:
            stage = self.flat.get("zero_optimization.stage", ZeroConfig.zero_stage)
            if name == "reduce_bucket_size" or stage == 3:  # transformers fills the stage-3 keys at stage 3 only
                self.sized_by_model.append(name)
            return
        value = self.value(key)
        kind = ZeroConfig.__dataclass_fields__[name].type
        if kind.startswith("int") and type(value) is float and value.is_integer():
            value = int(value)  # JSON's 5e7
        if name in ("offload_optimizer", "offload_param") and value is None:
            value = "none"
        self.settings[name] = value

    def _optimizer(self) -> OptimizerSpec | None:
        if "optimizer.type" not in self.flat and not any(k.startswith("optimizer.") for k in self.flat):
            return None
        if not self.trainer:
            self.fail("optimizer: hf_zero.initialize steps the torch optimizer you pass it; build it (e.g. "
                      "torch.optim.AdamW(model.parameters(), lr=...)) and remove the optimizer block")
        kind = str(self.flat.get("optimizer.type", "")).lower()
        if kind not in OPTIMIZERS:
            self.fail(f"optimizer.type {self.flat.get('optimizer.type')!r} is not one hf_zero builds from a DeepSpeed "
                      f"configuration (it builds {', '.join(OPTIMIZERS.values())}); remove the optimizer block to "
                      f"use the Trainer's --optim")
        known = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad"}
        for key in self.flat:
            if key.startswith("optimizer.params.") and key.removeprefix("optimizer.params.") not in known:
                self.fail(f"{key} is not an {OPTIMIZERS[kind]} parameter hf_zero reads; remove it")
        # A parameter the block leaves out is the default of DeepSpeed's Adam, not the Trainer's flag.
        params = {name: self.value(f"optimizer.params.{name}", default) for name, default in
                  (("lr", 1e-3), ("betas", [0.9, 0.999]), ("eps", 1e-8), ("weight_decay", 0.0))}
        decoupled = kind == "adamw" or self.flat.get("optimizer.params.adam_w_mode", True) is not False
        return OptimizerSpec(decoupled, float(params["lr"]), tuple(params["betas"]), float(params["eps"]),
                             float(params["weight_decay"]))

    def _scheduler(self) -> SchedulerSpec | None:
        if not any(k.startswith("scheduler.") for k in self.flat):
            return None
        if not self.trainer:
            self.fail("scheduler: hf_zero.initialize does not step a learning-rate scheduler; step a torch scheduler "
                      "in your loop and remove the scheduler block")
        kind = self.flat.get("scheduler.type")
        if kind not in SCHEDULERS:
            self.fail(f"scheduler.type {kind!r} is not one hf_zero runs from a DeepSpeed configuration (it runs "
                      f"{', '.join(SCHEDULERS)}); remove the scheduler block to use the Trainer's --lr_scheduler_type")
        known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
        known |= {"total_num_steps"} if kind == "WarmupDecayLR" else set()
        for key in self.flat:
            if key.startswith("scheduler.params.") and key.removeprefix("scheduler.params.") not in known:
                self.fail(f"{key} is not a {kind} parameter; remove it")
        warmup_type = self.flat.get("scheduler.params.warmup_type", "log")
        if warmup_type not in ("log", "linear"):
            self.fail(f"scheduler.params.warmup_type must be \"log\" or \"linear\"; got {warmup_type!r}")
        default_max = None if kind == "WarmupLR" else 0.001
        steps = {name: _integer(self.flat.get(f"scheduler.params.{name}", default), f"scheduler.params.{name}",
                                self.fail)
                 for name, default in (("warmup_num_steps", 1000), ("total_num_steps", AUTO))}
        max_lr = self.value("scheduler.params.warmup_max_lr", default_max)
        return SchedulerSpec(kind, float(self.value("scheduler.params.warmup_min_lr", 0.0)),
                             None if max_lr is None else float(max_lr), steps["warmup_num_steps"],
                             steps["total_num_steps"], warmup_type)

    def known_keys(self) -> Iterable[str]:
        return [*SETTING_OF_KEY, *WITHOUT_EFFECT, *ONLY_VALUE, *TRAINER_KEYS, "fp16.hysteresis",
                "communication_data_type", "train_batch_size", "train_micro_batch_size_per_gpu",
                "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"]


def _same(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(wanted) and all(map(_same, value, wanted))
    if isinstance(wanted, bool) or isinstance(value, bool):
        return value is wanted
    if isinstance(wanted, str) or wanted is None:
        return value == wanted
    return isinstance(value, (int, float)) and math.isclose(value, wanted, rel_tol=1e-12, abs_tol=0.0)


def _integer(value: Any, key: str, fail: Callable[[str], None]) -> int | str:
    if value == AUTO:
        return AUTO
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or value < 0:
        fail(f"{key} must be an integer >= 0 or \"auto\"; got {value!r}")
    return value


def engine_config(config: ZeroConfig | dict[str, Any] | str | Path | None) -> ZeroConfig:
    """ZeroConfig.from_any, taking a DeepSpeed configuration too (a dict, or a JSON file) as
    hf_zero.initialize's config; its keys that mean nothing for hf_zero are logged once."""
    source = "config"
    if isinstance(config, (str, Path)):
        source, config = str(config), read_settings_file(config, "config file")
    if isinstance(config, dict) and is_deepspeed(config):
        deepspeed = read(config, source)
        if warning := deepspeed.warning():
            logging.getLogger("hf_zero").warning(warning)
        config = deepspeed.settings
    return ZeroConfig.from_any(config)
