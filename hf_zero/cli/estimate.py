"""`hf-zero estimate`: memory per device for a model under each ZeRO stage, before any GPU is rented.

Model states follow the paper's accounting (section 5, `hf_zero.runtime.memory.model_state_bytes`): mixed-precision
Adam holds 2Ψ of parameters, 2Ψ of gradients and KΨ (K=12) of fp32 optimizer state, divided by Nd as the
stage partitions them. Offload moves bytes from the device to the host (ZeRO-Offload): the optimizer
state and an fp32 gradient shard (16Ψ/Nd) with `offload_optimizer`, the parameter shard with
`offload_param`. With `--reduce_dtype fp32` stages 2-3 keep an fp32 gradient shard (4Ψ/Nd; the engine's
`reduce_dtype`). ZeRO++ hpZ adds its secondary partition to stage 3's parameters: each device keeps 1/N
of every unit from its first forward to the optimizer step, 2Ψ/N in bf16 for N = `hpz_partition_size`.
Activations use the paper's estimate for GPT-2-like models, 12·hidden·batch·seq·layers values in the
compute dtype (its 60 GB for the 1.5B model at batch 32, sequence 1K); with checkpointing, one block input
per layer is kept and one block at a time is recomputed. Sizes are in the paper's GB
(1e9 bytes), the unit of its Figure 1 and Table 2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

import torch

import model_zoo
from hf_zero.plan.models import is_zoo_model, model_config
from hf_zero.runtime.memory import BYTES_PER_ELEMENT, model_state_bytes
from hf_zero.settings.config import ZeroConfig, offload_conflict

GB = 1e9
STAGES = (0, 1, 2, 3)
OFFLOADS = ("none", "cpu", "nvme")


def parse_count(text: str) -> int:
    """7.5e9, 7.5B, 350M, 1.2T, 13000 -> a count."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise ValueError(f"expected a count such as 7.5e9, 7.5B, 350M or 1.2T; got {text!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)])


def parse_bytes(text: str) -> int:
    """32GB, 80GB, 24GiB, 3.8TB -> bytes (GB = 1e9 as GPU and drive vendors and the paper count, GiB = 2**30)."""
    m = re.fullmatch(r"\s*([0-9]+\.?[0-9]*)\s*(gib|gb|tib|tb)\s*", text.lower())
    if not m:
        raise ValueError(f"expected a size such as 32GB, 80GB or 3.8TB; got {text!r}")
    return int(float(m.group(1)) * {"gb": GB, "gib": 2**30, "tb": 1000 * GB, "tib": 2**40}[m.group(2)])


@dataclass(frozen=True)
class Setting:
    stage: int
    num_gpus: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    reduce_dtype: str | None = None  # ZeroConfig.reduce_dtype: None is the compute dtype
    hpz_partition_size: int = 1  # ZeRO++ hpZ at stage 3 (1: off)

    def __str__(self) -> str:
        offloaded = [(what, {"cpu": "CPU", "nvme": "NVMe"}[where]) for what, where in (
            ("optimizer", self.offload_optimizer), ("parameter", self.offload_param)) if where != "none"]
        if len({to for _, to in offloaded}) == 1:  # "optimizer offload and parameter offload to CPU"
            offload = " and ".join(f"{what} offload" for what, _ in offloaded) + f" to {offloaded[0][1]}"
        else:
            offload = " and ".join(f"{what} offload to {to}" for what, to in offloaded)
        reduce = f", gradients reduced in {self.reduce_dtype}" if self.reduce_dtype else ""
        hpz = f", hpZ secondary partition over {self.hpz_partition_size}" if self.secondary else ""
        return f"stage {self.stage} on {self.num_gpus} GPU{'s' * (self.num_gpus > 1)}" + (
            f" with {offload}" if offloaded else "") + reduce + hpz

    @property
    def secondary(self) -> bool:
        return self.stage == 3 and self.hpz_partition_size > 1


def secondary_bytes(psi: int, setting: Setting, dtype: str) -> float:
    """hpZ's secondary partition per device: 1/N of the parameters in the compute dtype (0 when off)."""
    return BYTES_PER_ELEMENT[dtype] * psi / setting.hpz_partition_size if setting.secondary else 0.0


def model_states(psi: int, setting: Setting, dtype: str = "bf16") -> tuple[dict[str, float], float]:
    """(bytes per device by category, bytes of host memory per process) for model states; what lies on
    NVMe is `nvme_bytes`."""
    device = model_state_bytes(setting.stage, psi, setting.num_gpus, dtype, setting.reduce_dtype)
    host = 0.0
    # In device memory whatever the offload: the backward gathers from it.
    device["parameters"] += secondary_bytes(psi, setting, dtype)
    if setting.offload_optimizer == "cpu":
        host += device["optimizer_states"] + 4 * psi / setting.num_gpus  # + the fp32 gradient shard
    if setting.offload_param == "cpu":
        host += device["parameters"]
    if "nvme" in (setting.offload_optimizer, setting.offload_param):
        # The pool of 3 host buffer sets the NVMe tiles stream through (ZeroConfig.nvme_tile_numel).
        per_element = 16 + 4 * (setting.offload_param == "nvme")
        host += 3 * per_element * ZeroConfig.nvme_tile_numel
    if setting.offload_optimizer != "none":
        device["optimizer_states"] = 0.0
    if setting.offload_param != "none":
        device["parameters"] = 0.0
    return device, host


def nvme_bytes(psi: int, setting: Setting, dtype: str = "bf16") -> float:
    """Bytes on NVMe per process: the optimizer states and the fp32 gradient shard, the parameter shard."""
    states = model_state_bytes(setting.stage, psi, setting.num_gpus, dtype, setting.reduce_dtype)
    on_nvme = 0.0
    if setting.offload_optimizer == "nvme":
        on_nvme += states["optimizer_states"] + 4 * psi / setting.num_gpus
    if setting.offload_param == "nvme":
        on_nvme += states["parameters"]
    return on_nvme


@lru_cache(maxsize=8)
def parameter_count(model: str) -> int:
    """Ψ of a model_zoo name (its closed form), or of any transformers model: its architecture (the config's
    `architectures`, else AutoModel) built on the meta device, each tied weight counted once."""
    if is_zoo_model(model):
        return model_zoo.parameter_count(model)
    import transformers

    config = model_config(model)
    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    with torch.device("meta"):
        built = (model_class or transformers.AutoModel)._from_config(config)
    return sum(p.numel() for p in built.parameters())


def _shape(config: Any) -> tuple[int, int]:
    """(hidden size, layers), under GPT-2's names or the others', of the config or its text_config."""
    for cfg in (config, getattr(config, "text_config", None)):
        hidden = getattr(cfg, "n_embd", None) or getattr(cfg, "hidden_size", None)
        layers = getattr(cfg, "n_layer", None) or getattr(cfg, "num_hidden_layers", None)
        if hidden and layers:
            return hidden, layers
    raise ValueError(f"{type(config).__name__} names no hidden size and layer count: activation memory cannot be "
                     f"estimated; leave out --batch_size and --seq_len")


def activation_bytes(model: str, batch: int, seq: int, checkpointing: bool, dtype: str = "bf16") -> float:
    hidden, layers = _shape(model_config(model))
    element, block = BYTES_PER_ELEMENT[dtype], 12 * hidden * batch * seq
    if checkpointing:
        return element * (hidden * batch * seq * layers + block)
    return element * block * layers


def valid_settings(num_gpus: Iterator[int], reduce_dtype: str | None = None) -> Iterator[Setting]:
    """Every combination hf_zero accepts, fewest GPUs first, then the lowest stage, then the least offload."""
    for nd in num_gpus:
        for stage in STAGES:
            for opt in OFFLOADS:
                for param in OFFLOADS:
                    if offload_conflict(stage, opt, param) is None:
                        yield Setting(stage, nd, opt, param, reduce_dtype)


def device_total(psi: int, setting: Setting, activations: float, dtype: str = "bf16") -> float:
    return sum(model_states(psi, setting, dtype)[0].values()) + activations


def smallest_fitting(psi: int, gpu_bytes: int, activations: float, dtype: str = "bf16",
                     num_gpus: int | None = None, reduce_dtype: str | None = None) -> Setting | None:
    """The first setting (fewest GPUs, lowest stage, least offload) whose device memory fits; on exactly
    `num_gpus` GPUs when given, else on any power of two up to 65536."""
    counts = [num_gpus] if num_gpus else [2**k for k in range(17)]
    return next((s for s in valid_settings(counts, reduce_dtype) if device_total(psi, s, activations, dtype)
                 <= gpu_bytes), None)


def largest_params(setting: Setting, gpu_bytes: int, dtype: str = "bf16") -> int:
    """Table 2's theoretical maximum: the Ψ whose model states alone fill the device."""
    per_param = device_total(1_000_000, setting, 0.0, dtype) / 1_000_000
    return int(gpu_bytes / per_param)


def largest_zoo_model(setting: Setting, gpu_bytes: int, batch: int, seq: int, checkpointing: bool,
                      family: str, dtype: str = "bf16") -> str | None:
    """The zoo entry of `family` with the most parameters that fits, activations included."""
    fitting = [(model_zoo.parameter_count(n), n) for n in model_zoo.list()
               if model_zoo.entry(n).family == family and n != model_zoo.MINILM
               and device_total(model_zoo.parameter_count(n), setting,
                                activation_bytes(n, batch, seq, checkpointing, dtype) if batch else 0.0,
                                dtype) <= gpu_bytes]
    return max(fitting)[1] if fitting else None


def report(psi: int, setting: Setting, gpu_bytes: int, dtype: str = "bf16", model: str | None = None,
           batch: int = 0, seq: int = 0, checkpointing: bool = False) -> str:
    """What `hf-zero estimate` prints: every stage on these GPUs, the chosen one marked, and what fits."""
    activations = activation_bytes(model, batch, seq, checkpointing, dtype) if model and batch else 0.0
    name = f"{model} " if model else ""
    lines = [f"{name}Ψ = {psi / 1e9:.3f}B parameters, {dtype} mixed-precision Adam (K=12), "
             f"{setting.num_gpus} GPU(s) of {gpu_bytes / GB:.0f} GB; GB = 1e9 bytes", "",
             "| stage | parameters | gradients | optimizer states | model states | + activations | host (offload) "
             "| fits |", "|---|---|---|---|---|---|---|---|"]
    for stage in STAGES:
        s = Setting(stage, setting.num_gpus, setting.offload_optimizer if stage >= 1 else "none",
                    setting.offload_param if stage == 3 else "none", setting.reduce_dtype, setting.hpz_partition_size)
        device, host = model_states(psi, s, dtype)
        total = sum(device.values()) + activations
        mark = " (chosen)" if stage == setting.stage else ""
        lines.append(f"| {stage}{mark} | {device['parameters'] / GB:.2f} | {device['gradients'] / GB:.2f} | "
                     f"{device['optimizer_states'] / GB:.2f} | {sum(device.values()) / GB:.2f} | "
                     f"{total / GB:.2f} | {host / GB:.2f} | {'yes' if total <= gpu_bytes else 'no'} |")
    lines.append("")
    if setting.secondary:
        lines.append(f"stage 3's parameters include hpZ's secondary partition: "
                     f"{secondary_bytes(psi, setting, dtype) / GB:.2f} GB per device "
                     f"({BYTES_PER_ELEMENT[dtype]}Ψ/{setting.hpz_partition_size})")
    if model and batch:
        how = "with activation checkpointing" if checkpointing else "without checkpointing"
        lines.append(f"activations: {activations / GB:.2f} GB per device for batch {batch} x {seq} tokens, {how}")
    total = device_total(psi, setting, activations, dtype)
    lines.append(f"largest model whose model states fit {setting}: {largest_params(setting, gpu_bytes, dtype) / 1e9:.1f}B "
                 f"parameters")
    if nvme_bytes(psi, setting, dtype):
        lines.append(f"on NVMe: {nvme_bytes(psi, setting, dtype) / GB:.2f} GB per process for {setting} (the host "
                     f"column holds the pool of tiles they stream through)")
    if model and is_zoo_model(model):
        family = model_zoo.entry(model).family
        best = largest_zoo_model(setting, gpu_bytes, batch, seq, checkpointing, family, dtype)
        lines.append(f"largest {family} model of the zoo that fits {setting}: "
                     f"{best} ({model_zoo.parameter_count(best) / 1e9:.2f}B)" if best else
                     f"no {family} model of the zoo fits {setting}")
    if total <= gpu_bytes:
        lines.append(f"fits: {setting} needs {total / GB:.2f} GB per device of {gpu_bytes / GB:.0f} GB")
    else:
        lines.append(f"does not fit: {setting} needs {total / GB:.2f} GB per device, more than {gpu_bytes / GB:.0f} GB")
        for label, fit in (("on these GPUs", smallest_fitting(psi, gpu_bytes, activations, dtype, setting.num_gpus,
                                                              setting.reduce_dtype)),
                           ("with the fewest GPUs", smallest_fitting(psi, gpu_bytes, activations, dtype,
                                                                     reduce_dtype=setting.reduce_dtype))):
            lines.append(f"  smallest configuration that fits {label}: {fit} "
                         f"({device_total(psi, fit, activations, dtype) / GB:.2f} GB per device)" if fit else
                         f"  nothing fits {label} (up to 65536 GPUs; the activations alone may not fit)")
    return "\n".join(lines)
