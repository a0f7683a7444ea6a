"""torch.compile under the engine (the `compile` setting, the Trainer's --torch_compile): each repeated block
compiled on its own, as torchtitan and accelerate compile ("regional compilation"), the engine's hooks outside the
compiled code.

Stage 3 gathers a unit in its forward pre-hook, frees it in its forward hook and marks its post-backward on the
unit's inputs there; stages 0-2 reduce from each parameter's post-accumulate-grad hook, which autograd runs after
a compiled backward as after an eager one. Only the block's own `forward` is compiled (an attribute of the
instance, so the state dict and the module tree stay as they are): `block(...)` runs the hooks eagerly around the
compiled code, and every block of one class shares one graph, since dynamo takes the parameters as inputs, not
constants. A parameter whose storage stage 3 refills each step is then a new input of the same shape, which needs
no new graph.

Blocks share a graph only when they compute alike: a block that indexes a KV cache by its layer number (a
transformers model with use_cache on, and generation) gets a graph of its own, for each kind of call (training,
evaluation, prefill, decoding). dynamo's recompile limit (8 per function by default, beyond which it runs the
function eager with a warning) is raised to cover that. The Trainer turns use_cache off for training (its
--use_cache); a training loop of one's own should too.

A block holding a module with forward hooks of its own (stage 3's reads of a tied weight, a user's hook) runs
eager: dynamo would trace the engine's hooks into the graph. So does everything outside the blocks (embeddings,
head, loss), which is where the engine's model-level hooks are. A model with no blocks is compiled whole, said in
one line.
"""
from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from typing import Any

import torch
from torch import nn

from hf_zero.runtime.groups import log_on_rank0
from hf_zero.settings.config import ZeroConfig
from hf_zero.zero.activations import CheckpointStore
from hf_zero.zero.stage3.discovery import repeated_blocks

# Kinds of call a block may see, each its own graph when its blocks cannot share one: training, evaluation, a
# generation's prefill and its decoding steps.
GRAPHS_PER_BLOCK = 4


def compile_blocks(model: nn.Module, config: ZeroConfig, activation_store: CheckpointStore | None) -> dict[str, str]:
    """Compiles each repeated block's forward (`repeated_blocks`: the stage-3 units, or the blocks stage 3 would
    cut), or the whole model's where it has none. Returns what runs eager, by module name, with why; each reason is
    said once in rank 0's log. With ZeRO-R's checkpoints, a compiled block's training forward runs its own forward
    eager and the store compiles what the checkpoint runs: transformers calls the checkpoint inside the block's
    forward, and the checkpoint enters saved-tensor hooks there, which dynamo cannot trace."""
    backend = config.compile_backend or "inductor"
    if backend == "inductor":
        _inductor_cache_per_instruction_set()
    if activation_store is not None:
        activation_store.compile_with(functools.partial(torch.compile, backend=backend, mode=config.compile_mode))
    blocks, chosen_by = repeated_blocks(model, config.unit_module_classes)
    if not blocks:
        log_on_rank0(logging.WARNING, "torch.compile: %s has no repeated blocks to compile one at a time; it is "
                     "compiled whole, the engine's hooks on it outside the compiled code", type(model).__name__)
        blocks, chosen_by = [("", model)], "the whole model"
    _allow_a_graph_per_block(len(blocks))
    if getattr(getattr(model, "config", None), "use_cache", False):
        log_on_rank0(logging.WARNING, "torch.compile: %s's config.use_cache is on, so in training every block indexes "
                     "a KV cache by its layer and compiles a graph of its own; set model.config.use_cache = False for "
                     "training (the Trainer does) and the blocks share one", type(model).__name__)
    eager: dict[str, str] = {}
    said_breaks: set[tuple[str, str]] = set()
    for name, block in blocks:
        if hooked := _modules_with_forward_hooks(block):
            eager[name] = f"its {hooked[0]} has forward hooks of its own, which dynamo would trace into the graph"
            continue
        block.forward = _CompiledForward(name, block, backend, config.compile_mode, activation_store, said_breaks)
    log_on_rank0(logging.INFO, "torch.compile (backend %s%s): %d of %d blocks of %s compiled (chosen by %s)%s",
                 backend, f", mode {config.compile_mode}" if config.compile_mode else "", len(blocks) - len(eager),
                 len(blocks), type(model).__name__, chosen_by,
                 "; in training, inside ZeRO-R's checkpoints" if activation_store is not None else "")
    if eager:  # one line for all: tensor parallelism's hooks make every block eager
        names = [name or type(model).__name__ for name in eager]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        log_on_rank0(logging.WARNING, "torch.compile: %s run%s eager: %s", shown, "s" if len(names) == 1 else "",
                     next(iter(eager.values())))
    return eager


def _inductor_cache_per_instruction_set() -> None:
    """inductor's cache on disk does not tell apart the instruction sets ATEN_CPU_CAPABILITY chooses: CPU kernels it
    cached under AVX-512 and loaded under ATEN_CPU_CAPABILITY=avx2 gave NaN losses, and the other way a corrupted
    heap (torch 2.13). So under ATEN_CPU_CAPABILITY each capability caches in a folder of its own, unless
    TORCHINDUCTOR_CACHE_DIR names another folder than torch's default (which torch writes there itself as soon as
    transformers' model code is imported)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{capability}"
        log_on_rank0(logging.INFO, "torch.compile: inductor caches under %s (ATEN_CPU_CAPABILITY=%s)",
                     os.environ["TORCHINDUCTOR_CACHE_DIR"], capability)


def _allow_a_graph_per_block(blocks: int) -> None:
    """dynamo's recompile limit covers a graph per block and kind of call (the module docstring). torch 2.4-2.6 name
    the limits cache_size_limit and accumulated_cache_size_limit."""
    dynamo_config = torch._dynamo.config
    for limit, wanted in (("recompile_limit", GRAPHS_PER_BLOCK * blocks),
                          ("accumulated_recompile_limit", 2 * GRAPHS_PER_BLOCK * blocks)):
        name = limit if hasattr(dynamo_config, limit) else limit.replace("recompile", "cache_size")
        setattr(dynamo_config, name, max(getattr(dynamo_config, name), wanted))


def _modules_with_forward_hooks(block: nn.Module) -> list[str]:
    return [name for name, m in block.named_modules() if m is not block and (m._forward_hooks or m._forward_pre_hooks)]


class _CompiledForward:
    """A block's forward under torch.compile (its signature kept, for what inspects `model.forward`). A graph break
    found while compiling it is said once per block class and reason, naming the block: the same break cuts every
    block of the class. Under ZeRO-R's checkpoints a training forward runs eager, with the store compiling what the
    checkpoint runs (CheckpointStore.compiling_checkpoints)."""

    def __init__(self, name: str, block: nn.Module, backend: str, mode: str | None,
                 activation_store: CheckpointStore | None, said_breaks: set[tuple[str, str]]) -> None:
        functools.update_wrapper(self, block.forward)
        self.name, self.class_name, self.block = name, type(block).__name__, block
        self.eager_forward, self.activation_store, self.said_breaks = block.forward, activation_store, said_breaks
        self.compiled = torch.compile(block.forward, backend=backend, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.activation_store is not None and self.block.training and torch.is_grad_enabled():
            with self.activation_store.compiling_checkpoints():
                return self.eager_forward(*args, **kwargs)
        breaks = torch._dynamo.utils.counters["graph_break"]
        before = Counter(breaks)
        out = self.compiled(*args, **kwargs)
        if breaks != before:
            self._say_breaks(Counter(breaks) - before)
        return out

    def _say_breaks(self, new: Counter) -> None:
        for reason, times in new.items():
            if (self.class_name, reason) not in self.said_breaks:
                self.said_breaks.add((self.class_name, reason))
                log_on_rank0(logging.WARNING, "torch.compile: graph break in %s (%s, and every block of its class): %s"
                             " (%d time(s) while compiling it)", self.name, self.class_name,
                             " ".join(reason.split(" Hint:")[0].split()), times)
