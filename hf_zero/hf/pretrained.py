"""Partitioned from_pretrained and from_config at stage 3: a model larger than one process's memory, built
by an unmodified script.

A script such as run_clm.py calls `AutoModelForCausalLM.from_pretrained(...)` (or `from_config`) before the
Trainer exists. Once its arguments are parsed with `--zero_stage 3` or `auto` (`ZeroTrainingArguments`; on by
default, `--zero_init_partitioned false` turns it off), those calls build the model on the meta device and no weight
is read: every rank gets the model's structure, and `ZeroTrainer` then hands it to the engine, which reads
this rank's slices of the safetensors files (`construct.PretrainedWeights`) or runs transformers' own init
(`stock_init.StockInit`) one unit at a time. At stage 3 no rank ever holds the whole model; where `auto`'s plan
chooses stages 0-2, which hold it whole, each rank fills it whole (`construct.fill_whole`).

transformers asks `is_deepspeed_zero3_enabled()` at these two points and then enters DeepSpeed's
`zero.Init` and its rank-0 loader; without DeepSpeed it offers no hook for another engine. hf_zero replaces
the same two points on `PreTrainedModel` itself (no model class is touched), as long as the arguments
that asked for it are alive (transformers ties its DeepSpeed switch to the arguments the same way):

- `_load_pretrained_model`, the step of `from_pretrained` that reads weights: transformers' own loader runs
  on meta stand-ins of the checkpoint's tensors (names, shapes and dtypes from the safetensors headers).
  Everything else `from_pretrained` does keeps working as it would: renames of the checkpoint's keys,
  `_keys_to_ignore_on_load_*`, the missing, unexpected and mismatched keys and their report, tied weights,
  the generation config, the dtype. Missing keys (a new classifier head) are materialised and initialised
  by transformers exactly as in a plain `from_pretrained`; the engine takes their values as they are.
- `_from_config`: the model is built on meta with transformers' initialisation recorded
  (`stock_init.record_stock_init`), and the engine fills it unit by unit with the values a plain `from_config`
  gives at the same point of the script (bitwise; the global generator is left where a plain build leaves it).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from hf_zero.hf.stock_init import record_stock_init
from hf_zero.zero.construct import PretrainedWeights

# Logged where transformers logs its own "Detected DeepSpeed ZeRO-3" (seen with the script's --log_level info).
logger = logging.get_logger("transformers.modeling_utils")

_asked_by: Any = None  # a weak reference to the arguments that turned partitioned construction on
_sources: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
# The values peft gave the adapters it put around a base built partitioned, by peft layer and parameter name.
_adapter_values: "weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()
_originals: dict[str, Any] = {}


def enable(arguments: Any) -> None:
    """From now on, while `arguments` is alive, from_pretrained and from_config build partitioned models."""
    global _asked_by
    _install()
    _asked_by = weakref.ref(arguments)


def end(arguments: Any) -> None:
    """The Trainer given `arguments` has taken its model: later from_pretrained and from_config calls build whole
    models (a model loaded after training to evaluate or compare would otherwise stay on meta, as no engine
    fills it). Other arguments that turned partitioned construction on keep it on."""
    global _asked_by
    if _asked_by is not None and _asked_by() is arguments:
        _asked_by = None


def enabled() -> bool:
    return _asked_by is not None and _asked_by() is not None


def _stage_flag() -> str:
    """The stage of the arguments that turned partitioned construction on, as a flag: auto, or 3 (given by the flag
    or by a configuration file). Named while from_pretrained runs under them."""
    return "--zero_stage auto" if "zero_stage" in _asked_by().zero_planned else "--zero_stage 3"


def init_source(model: nn.Module) -> Any:
    """Where the engine takes the values of a model built partitioned (`init_from`), or None for a whole model. A
    peft model around a base built partitioned has the base's: the engine fills the base's shards through peft's
    wrapper (`PretrainedWeights.key_of` reads the wrapper's names as the base's) and takes the adapter's values as
    peft initialised them."""
    if model in _sources:
        return _sources[model]
    base = _peft_base(model)
    source = _sources.get(base) if base is not None else None
    if source is not None:  # first asked for this peft model: its adapters' values are taken in once
        source.given.update({f"{prefix}.{name}": values for prefix, layer in model.named_modules()
                             if layer in _adapter_values for name, values in _adapter_values[layer].items()})
        _refuse_lost_adapter_values(model, source)
        _sources[model] = source
    return source


def _refuse_lost_adapter_values(model: nn.Module, source: PretrainedWeights) -> None:
    """A trained tensor peft made on the meta base that neither kept values nor is in the checkpoint (a prompt
    learning method's encoder, which peft builds on the base's device) has nothing to be filled from."""
    lost = []
    for name, param in model.named_parameters():
        if param.requires_grad and param.is_meta and name not in source.given:
            try:
                source.key_of(model, name)
            except KeyError:
                lost.append(name)
    if lost:
        raise ValueError(f"{', '.join(lost)} of the peft model ({type(model).__name__}) have no values: peft made "
                         f"them on the meta device of a base built partitioned (arguments building it so were parsed "
                         f"before from_pretrained), and the checkpoint does not hold them. Pass "
                         f"--zero_init_partitioned false to build the base whole first")


def _peft_base(model: nn.Module) -> nn.Module | None:
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else None


def describe(source: Any) -> str:
    """What a rank did to fill its shards (or, at stages 0-2, its whole model), for the log once the engine has
    started."""
    if isinstance(source, PretrainedWeights):
        return (f"read {source.bytes_read / 2**20:.2f} MiB of the checkpoint's {source.total_bytes() / 2**20:.2f} "
                f"MiB ({len(set(source.file_of.values()))} file(s))")
    return "transformers' initialisation of the whole model, replayed for what this rank holds"


def forget(model: nn.Module) -> bool:
    """The engine has taken the model's values from its source; says whether it had one."""
    base = _peft_base(model)
    return any(_sources.pop(built, None) is not None for built in (model, base) if built is not None)


def _install() -> None:
    from transformers import PreTrainedModel

    if _originals:
        return
    _originals["load"] = PreTrainedModel.__dict__["_load_pretrained_model"].__func__
    _originals["from_config"] = PreTrainedModel.__dict__["_from_config"].__func__
    PreTrainedModel._load_pretrained_model = staticmethod(_load_pretrained_model)
    PreTrainedModel._from_config = classmethod(_from_config)
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # without peft there is no adapter to keep
        return
    _originals["move_adapter"] = BaseTunerLayer.__dict__["_move_adapter_to_device_of_base_layer"]
    BaseTunerLayer._move_adapter_to_device_of_base_layer = _move_adapter_to_device_of_base_layer


def _move_adapter_to_device_of_base_layer(layer: Any, adapter_name: str, device: torch.device | None = None) -> None:
    """peft initialises a new adapter in host memory and then moves it onto its base layer's device (here, and
    again as it puts the layer in the model): onto the meta device of a base built partitioned, its values would be
    lost. They are kept first, for the engine to take as they are (`init_source`)."""
    base_weight = getattr(layer.get_base_layer(), "weight", None)
    if enabled() and isinstance(base_weight, torch.Tensor) and base_weight.is_meta:
        _adapter_values.setdefault(layer, {}).update(
            {name: param.detach().clone() for name, param in layer.named_parameters() if not param.is_meta})
    _originals["move_adapter"](layer, adapter_name, device)


def _from_config(cls: type, config: Any, **kwargs: Any) -> nn.Module:
    if not enabled():
        return _originals["from_config"](cls, config, **kwargs)
    model, stock_init = record_stock_init(lambda: _originals["from_config"](cls, config, **kwargs))
    _sources[model] = stock_init
    logger.info(f"{cls.__name__}.from_config built on meta: each rank will initialise only its own shards, with "
                f"transformers' initialisation of the whole model, when the engine starts")
    return model


def _load_pretrained_model(model: nn.Module, state_dict: dict | None, checkpoint_files: list[str] | None,
                           load_config: Any, expected_keys: list[str] | None = None) -> Any:
    load = _originals["load"]
    if not enabled() or state_dict is not None:  # weights handed over in memory are whole already
        return load(model, state_dict, checkpoint_files, load_config, expected_keys)
    _check_loadable(checkpoint_files or [], load_config)
    weights = PretrainedWeights(files=checkpoint_files)
    weights.follow(model, load_config.weight_mapping)
    stand_ins = {key: torch.empty(shape, dtype=dtype, device="meta")
                 for key, (shape, dtype) in weights.header_of.items()}
    # Loaded onto meta, nothing is read: transformers' loader does its bookkeeping on the stand-ins.
    on_meta = dataclasses.replace(load_config, device_map={"": torch.device("meta")})
    result = load(model, stand_ins, None, on_meta, expected_keys)
    loading_info = result[0]
    # Missing and mismatched weights are tied or initialised by transformers next, never read.
    not_read = loading_info.missing_keys | {name for name, *_ in loading_info.mismatched_keys}
    _check_readable(model, weights, not_read)
    _sources[model] = weights
    logger.info(f"{type(model).__name__}.from_pretrained built on meta: each rank will read only its own shards of "
                f"{len(checkpoint_files)} safetensors file(s) when the engine starts")
    return result


def _check_loadable(checkpoint_files: list[str], load_config: Any) -> None:
    """What partitioned loading cannot do is refused before anything is built."""
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            raise ValueError(f"{_stage_flag()} builds the model partitioned, reading each rank's slices of safetensors "
                             f"files, and {file} is not one (it cannot be read in slices). Save the model with "
                             f"save_pretrained(..., safe_serialization=True), or pass --zero_init_partitioned false "
                             f"to load it whole on every rank first")
    if not checkpoint_files:
        raise ValueError(f"{_stage_flag()} builds the model partitioned from checkpoint files, and from_pretrained "
                         f"found none")
    if load_config.hf_quantizer is not None:
        raise ValueError(f"a quantized model cannot be built partitioned at {_stage_flag()} (hf_zero trains "
                         f"unquantized weights): pass --zero_init_partitioned false")
    if load_config.device_map is not None:
        raise ValueError(f"from_pretrained(device_map={load_config.device_map!r}) places the whole model, and "
                         f"{_stage_flag()} partitions it over the ranks instead: drop device_map")


def _check_readable(model: nn.Module, weights: PretrainedWeights, not_read: set[str]) -> None:
    """Every weight transformers found in the checkpoint must be readable: a checkpoint key with the model's shape,
    or made by one of transformers' conversions (`PretrainedWeights.follow`) in that shape. Anything else is refused
    here, before any work, rather than read wrongly later."""
    for name, tensor in model.state_dict(keep_vars=True).items():  # what a checkpoint holds: no non-persistent buffers
        if not tensor.is_meta or name in not_read:
            continue
        try:
            shape = weights.shape_of(model, name)
        except KeyError:
            shape = None
        if shape != tuple(tensor.shape):
            raise ValueError(f"{name} ({tuple(tensor.shape)}) is neither stored as one tensor of that shape in the "
                             f"checkpoint nor made so by transformers' conversions of it, and partitioned loading at "
                             f"{_stage_flag()} reads nothing else: pass --zero_init_partitioned false")
