"""Megatron-style tensor parallelism for the zoo's GPT-2 (and Turing-style) and BERT models, and for any
transformers model whose config has a `base_model_tp_plan` of column-wise and row-wise layers (Llama, Qwen2,
Mistral, ...), with torch's DTensor API: a ("dp", "tp") DeviceMesh, and `parallelize_module` with column-wise
plans for the first matrix of attention (Q, K, V) and of the MLP, row-wise plans for the second.

Each block then holds 1/tp of its attention heads and MLP columns; its input and output stay
replicated across the tp group (the row-wise output is all-reduced), which is what ZeRO-R's
partitioned activation checkpointing (hf_zero/zero/activations.py) removes from memory. Embeddings,
norms and the LM head stay replicated: the zoo's vocabularies are small beside the blocks, and
GPT-2 ties its head to the embedding.

GPT-2 computes with transformers' `Conv1D` (weight stored in x out), which torch's styles do not
know, and fuses Q, K and V into one matrix: `Conv1DColwise` shards it with `_StridedShard`, so that
each rank gets its heads' columns of each of Q, K and V while the global tensor keeps transformers'
layout (checkpoints and exports are unchanged).

Engine checkpoints store each rank's local part as its own tensor; `split_of` records how the parts
make the whole and `join_parts` puts them back together (`hf-zero consolidate`), without a process
group: DTensor's own redistribution needs every tp rank alive.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from transformers.pytorch_utils import Conv1D

from hf_zero.runtime import groups
from hf_zero.runtime.device import compute_device
from hf_zero.settings.config import check_tp_within_a_node
from hf_zero.settings.environment import processes_per_node


def init_mesh(tensor_parallel_size: int, across_nodes: bool = False) -> DeviceMesh:
    """The ("dp", "tp") mesh over the whole world: consecutive ranks form a tp group (inside a node, as
    Megatron and the ZeRO paper place model parallelism), ZeRO data parallelism runs across them. A group
    larger than a node (torchrun's LOCAL_WORLD_SIZE) is refused unless `across_nodes`."""
    world = dist.get_world_size()
    if tensor_parallel_size < 1 or world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size must divide the world size {world}; got {tensor_parallel_size}")
    check_tp_within_a_node(tensor_parallel_size, processes_per_node(world), across_nodes)
    shape = (world // tensor_parallel_size, tensor_parallel_size)
    return groups.device_mesh(compute_device().type, shape, ("dp", "tp"))


def _distribute_weight_and_bias(name: str, module: nn.Module, mesh: DeviceMesh,
                                placements: tuple[Placement, Placement], src_data_rank: int | None) -> None:
    """distribute_module's partition function: the module's weight and bias become DTensors so placed."""
    for pname, placement in zip(("weight", "bias"), placements):
        param = getattr(module, pname)
        module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement],
                                                                        src_data_rank=src_data_rank),
                                                      requires_grad=param.requires_grad))


class Conv1DColwise(ParallelStyle):
    """Column-wise sharding of a transformers Conv1D (y = x W + b, W in x out): W and b split on the
    output dimension. `fused` > 1 splits it as that many concatenated matrices (GPT-2's Q|K|V)."""

    def __init__(self, fused: int = 1) -> None:
        self.placement: Placement = _StridedShard(1, split_factor=fused) if fused > 1 else Shard(1)
        self.bias_placement: Placement = _StridedShard(0, split_factor=fused) if fused > 1 else Shard(0)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, Conv1D), f"Conv1DColwise shards transformers' Conv1D, not {type(module).__name__}"
        # The output stays this rank's columns as a plain tensor: no redistribution (it would undo the
        # strided layout that keeps each head's Q, K and V on one rank).
        partition = partial(_distribute_weight_and_bias, placements=(self.placement, self.bias_placement),
                            src_data_rank=self.src_data_rank)
        return distribute_module(module, device_mesh, partition,
                                 partial(ColwiseParallel._prepare_input_fn, (Replicate(),), (Replicate(),)),
                                 lambda mod, outputs, mesh: outputs.to_local())


class Conv1DRowwise(RowwiseParallel):
    """Row-wise sharding of a Conv1D: W split on the input dimension, b replicated, output all-reduced."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, Conv1D), f"Conv1DRowwise shards transformers' Conv1D, not {type(module).__name__}"
        partition = partial(_distribute_weight_and_bias, placements=(Shard(0), Replicate()),
                            src_data_rank=self.src_data_rank)
        return distribute_module(module, device_mesh, partition,
                                 partial(self._prepare_input_fn, (Shard(-1),), (Shard(-1),)),
                                 partial(self._prepare_output_fn, (Replicate(),), True))


def split_of(param: DTensor) -> dict[str, Any]:
    """How a tensor-parallel parameter splits across its 1-D tp mesh: the dimension, and how many
    concatenated matrices each rank takes a slice of (`split_factor`, 3 for GPT-2's Q|K|V)."""
    (placement,) = param.placements
    if isinstance(placement, _StridedShard):
        return {"shape": list(param.shape), "dim": placement.dim, "split_factor": placement.split_factor}
    if isinstance(placement, Shard):
        return {"shape": list(param.shape), "dim": placement.dim, "split_factor": 1}
    raise ValueError(f"a tensor-parallel parameter placed as {placement} has no checkpoint layout; hf_zero "
                     f"stores parameters that are sharded (Shard, _StridedShard) or replicated")


def join_parts(parts: list[torch.Tensor], dim: int, split_factor: int) -> torch.Tensor:
    """The whole tensor from every tp rank's local part, in tp-rank order (the inverse of `split_of`'s
    placement): rank r holds slice r of each of the `split_factor` matrices laid along `dim`."""
    pieces = [part.chunk(split_factor, dim) for part in parts]
    return torch.cat([torch.cat([rank_pieces[m] for rank_pieces in pieces], dim) for m in range(split_factor)], dim)


def local_ranges(param: DTensor) -> tuple[int, list[tuple[int, int]]]:
    """Which ranges of the whole tensor along which dimension make this rank's local part of a split
    parameter, in order (one per concatenated matrix): what reading the part from a file needs, without the
    whole tensor."""
    split = split_of(param)
    tp, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    matrix = split["shape"][split["dim"]] // split["split_factor"]
    width = matrix // tp
    return split["dim"], [(m * matrix + rank * width, m * matrix + (rank + 1) * width)
                          for m in range(split["split_factor"])]


def _check_divisible(what: str, count: int, tp: int) -> None:
    if count % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {what} ({count}); choose a "
                         f"tensor_parallel_size that divides it")


def _source_rank(block: nn.Module) -> int | None:
    """Rank 0's values are scattered to the tp group; a block on meta has none, and each rank cuts its own."""
    return None if any(p.is_meta for p in block.parameters()) else 0


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shards every transformer block of a GPT-2 or BERT model, or the layers a model's `base_model_tp_plan` names,
    over `tp_mesh` (in place; returns it).
    Call it on the full model, the same on every rank, before hf_zero.initialize. A block still on meta (built
    for `init_from`) is cut without communication: its values come later, each rank's part its own."""
    tp = tp_mesh.size()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        if config.add_cross_attention:
            raise ValueError("tensor parallelism of GPT-2 with cross-attention (add_cross_attention) has no plan; "
                             "use tensor_parallel_size 1 for it")
        _check_divisible("attention heads", config.n_head, tp)
        _check_divisible("MLP width", config.n_inner or 4 * config.n_embd, tp)
        for block in model.transformer.h:
            parallelize_module(block, tp_mesh, {"attn.c_attn": Conv1DColwise(fused=3), "attn.c_proj": Conv1DRowwise(),
                                                "mlp.c_fc": Conv1DColwise(), "mlp.c_proj": Conv1DRowwise()},
                               src_data_rank=_source_rank(block))
            block.attn.split_size //= tp  # the local width of each of Q, K, V
            block.attn.num_heads //= tp
    elif model_type == "bert":
        _check_divisible("attention heads", config.num_attention_heads, tp)
        _check_divisible("intermediate size", config.intermediate_size, tp)
        for layer in model.bert.encoder.layer:
            parallelize_module(layer, tp_mesh, {
                "attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
                "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
                "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()},
                src_data_rank=_source_rank(layer))
            layer.attention.self.num_attention_heads //= tp
            layer.attention.self.all_head_size //= tp
    elif getattr(config, "base_model_tp_plan", None):
        _apply_config_plan(model, config, tp_mesh)
    else:
        raise ValueError(f"tensor parallelism has plans for transformers' GPT-2 and BERT models and for models whose "
                         f"config has a base_model_tp_plan (Llama, Qwen2, Mistral, ...); got {type(model).__name__} "
                         f"(model_type {model_type!r}). Use tensor_parallel_size 1 for it")
    return model


# transformers' plan styles that torch's own styles are: a Linear split on its output, or on its input.
CONFIG_PLAN_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _apply_config_plan(model: nn.Module, config: Any, tp_mesh: DeviceMesh) -> None:
    """The model's own `base_model_tp_plan` (module patterns of its base model, '*' for a layer's index), as
    transformers applies it: 'colwise' and 'rowwise' nn.Linear layers. The attention of these models reshapes its
    projections by head_dim (`view(..., -1, head_dim)`), so each rank computes its own heads with no change to the
    modules; the heads and key-value heads must divide by tp, or a head would be cut in two."""
    tp = tp_mesh.size()
    plan = config.base_model_tp_plan
    other = sorted({style for style in plan.values() if style not in CONFIG_PLAN_STYLES})
    if other:
        raise ValueError(f"{type(model).__name__}'s base_model_tp_plan uses {', '.join(map(repr, other))}; hf_zero "
                         f"applies 'colwise' and 'rowwise' layers only. Use tensor_parallel_size 1 for it")
    _check_divisible("attention heads", config.num_attention_heads, tp)
    _check_divisible("key-value heads", getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                     tp)
    base = model.base_model
    patterns = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+")), style) for pattern, style in plan.items()]
    layers = {}
    for name, module in base.named_modules():
        style = next((style for pattern, style in patterns if pattern.fullmatch(name)), None)
        if style is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"base_model_tp_plan makes {name} {style}, and it is a {type(module).__name__}; hf_zero "
                             f"splits nn.Linear layers. Use tensor_parallel_size 1 for it")
        _check_divisible(f"{name} {'output' if style == 'colwise' else 'input'} features",
                         module.out_features if style == "colwise" else module.in_features, tp)
        layers[name] = CONFIG_PLAN_STYLES[style]()
    if not layers:
        raise ValueError(f"{type(model).__name__}'s base_model_tp_plan matches no layer of its base model; use "
                         f"tensor_parallel_size 1 for it")
    parallelize_module(base, tp_mesh, layers, src_data_rank=_source_rank(base))
