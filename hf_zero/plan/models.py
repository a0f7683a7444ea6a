"""The model a plan is for: a model_zoo name, a local folder, or a model id in the Hugging Face cache (never
downloaded: a plan runs before any machine is rented, possibly offline)."""
from __future__ import annotations

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


def build_model(model: str) -> torch.nn.Module:
    """The model to train, built from its config (random weights: a plan needs sizes only). Attention dropout is
    0: a GPU's fused attention (flash) keeps no sequence x sequence matrices with or without dropout, and the CPU's
    fused kernel, which the plan runs, takes none; with it the CPU would fall back to the unfused form."""
    import transformers

    config = copy.deepcopy(model_config(model))  # the cached one serves the next plan and `hf-zero estimate` as it is
    no_attention_dropout = {name: 0.0 for name, value in config.to_dict().items()
                            if "drop" in name and ("attn" in name or "attention" in name) and isinstance(value, float)}
    if is_zoo_model(model) and model != model_zoo.MINILM:
        return model_zoo.build(model, **no_attention_dropout)
    config.update(no_attention_dropout)
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    return (model_class or transformers.AutoModelForCausalLM)._from_config(config)
