"""The model a plan is for: a model_zoo name, a local folder, or a model id in the Hugging Face cache (never
downloaded: a plan runs before any machine is rented, possibly offline)."""
from __future__ import annotations

import contextlib
import copy
from functools import lru_cache
from typing import Any

import torch

import model_zoo


def is_zoo_model(model: str) -> bool:
    return model in model_zoo.list()


@lru_cache(maxsize=8)
def model_config(model: str) -> Any:
    """The config of a model_zoo name, a local folder, or a model id in the Hugging Face cache (never
    downloaded). Shared by every caller: read it, never change it."""
    if is_zoo_model(model):
        return model_zoo.config(model)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"{model!r} is neither a model_zoo name ({', '.join(sorted(model_zoo.list()))}) nor a folder "
                         f"or cached Hub model with a config.json: {str(error).splitlines()[0]}") from None


def build_model(model: str, adapter: str | None = None, frozen: tuple[str, ...] | None = None,
                adapter_name: str = "default", initialised: bool = True) -> torch.nn.Module:
    """The model to train, built from its config (random weights: a plan needs sizes only), with the peft adapter
    saved in folder `adapter` (its adapter_config.json) around it under `adapter_name`, and, where `frozen` names
    the parameters that do not train, every other one trained (else what the class and the adapter train). Attention
    dropout is 0: a GPU's fused attention (flash) keeps no sequence x sequence matrices with or without dropout, and
    the CPU's fused kernel, which the plan runs, takes none; with it the CPU would fall back to the unfused form.
    Not `initialised`: built without drawing initial values, for a plan's fake tensors, which hold none, as
    transformers' _from_config builds a model under DeepSpeed ZeRO-3 (no_init_weights, then tie_weights). That
    context patches torch's init functions process-wide while it builds: a plan's simulation has its process to
    itself. An adapter's model is built on the meta device, never initialised."""
    built = _base_model(model, initialised) if adapter is None else _with_adapter(model, adapter, adapter_name)
    if frozen is not None:
        names = {name for name, _ in built.named_parameters()}
        unknown = sorted(set(frozen) - names)
        if unknown:
            raise ValueError(f"--frozen names {len(unknown)} parameter(s) the model does not have, such as "
                             f"{unknown[0]!r} (its first: {next(iter(built.named_parameters()))[0]!r})")
        for name, param in built.named_parameters():
            param.requires_grad_(name not in frozen)
    return built


def _with_adapter(model: str, adapter: str, adapter_name: str) -> torch.nn.Module:
    """The model with the peft adapter around it, built on the meta device and then given fake memory (in a plan's
    fake mode) on the host, tied weights kept tied. Built in fake mode directly, peft's move of each adapter layer to
    its base layer's device would fail: torch swaps a fake parameter for its moved copy, which the fake mode's own
    references to it forbid; on the meta device peft leaves it."""
    from peft import PeftConfig, get_peft_model

    with torch.device("meta"):
        built = get_peft_model(_base_model(model), PeftConfig.from_pretrained(adapter), adapter_name=adapter_name)
    given: dict[int, torch.nn.Parameter] = {}
    for module in built.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in given:
                    given[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                          requires_grad=param.requires_grad)
                module._parameters[name] = given[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
    return built


def _base_model(model: str, initialised: bool = True) -> torch.nn.Module:
    """Not `initialised`, its weights are tied as post_init ties them, which no_init_weights skips with the rest of
    init_weights."""
    import transformers
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model_config(model))  # the cached one serves the next plan and `hf-zero estimate` as it is
    no_attention_dropout = {name: 0.0 for name, value in config.to_dict().items()
                            if "drop" in name and ("attn" in name or "attention" in name) and isinstance(value, float)}
    with contextlib.nullcontext() if initialised else no_init_weights():
        if is_zoo_model(model) and model != model_zoo.MINILM:
            built = model_zoo.build(model, **no_attention_dropout)
        else:
            config.update(no_attention_dropout)
            named = model_class(model)
            built = named._from_config(config) if named else transformers.AutoModelForCausalLM.from_config(config)
    if not initialised:
        built.tie_weights()
    return built


def model_class(model: str) -> type | None:
    """The transformers class the config of `model` names first in `architectures`, or None where it names none (then
    transformers' causal language model for its type is built, as AutoModelForCausalLM.from_config builds it).
    ValueError where it names a class transformers does not have, or names none and its type has no causal language
    model: a plan runs no code from a model's folder."""
    import transformers

    config = model_config(model)
    names = getattr(config, "architectures", None) or []
    if names:
        named = getattr(transformers, names[0], None)
        if not (isinstance(named, type) and issubclass(named, transformers.PreTrainedModel)):
            raise ValueError(f"{model}'s config.json names the architecture {names[0]}, which is not a model class "
                             f"of transformers {transformers.__version__} (a plan runs no code from a model's folder)")
        return named
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ValueError(f"{model}'s config.json names no architecture, and {type(config).__name__} has no causal "
                         f"language model in transformers: name the class to build in its \"architectures\"")
    return None
