"""How ZeroEngine is built: these functions, called in this order by ZeroEngine.__init__.

  1. check_inputs          bad settings, optimizers, meshes and models are refused before any work
  2. sync_module_states    every rank starts from rank 0's weights and buffers, as DDP does (a model built
                           on meta first gets its buffers and frozen weights from `init_from`)
  3. apply_partitioning    the stage's parameter holder (hf_zero/zero/holder.py): flat buffers and buckets
                           (stages 0-2) or units and shards (stage 3), parameters as compute-dtype views,
                           the fp32 start of this rank's chunks kept for the masters
  4. apply_precision       frozen parameters and floating buffers follow the compute dtype
  5. apply_optimizer       the user's optimizer re-targeted at this rank's chunks, stepped by the update
                           backend of where its states live (device, host memory, NVMe)
  6. apply_activation_checkpointing   ZeRO-R: block checkpoints partitioned over tp / in host memory
  7. compile_blocks        --torch_compile: each block's forward compiled, the hooks above outside it
                           (hf_zero/engine/compile.py)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hf_zero.optim.delayed import DelayedUpdate
from hf_zero.optim.optimizer import ShardedOptimizer, check_optimizer, update_backend
from hf_zero.optim.precision import LossScaler
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.comm import rank as global_rank
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.trace import spanned
from hf_zero.settings.config import ZeroConfig, ZeroConfigError, check_compile_backend
from hf_zero.settings.environment import processes_per_node
from hf_zero.zero import activations
from hf_zero.zero.activations import CheckpointStore, check_supports_checkpointing
from hf_zero.zero.construct import place_rest
from hf_zero.zero.holder import ParamHolder
from hf_zero.zero.partition import is_tp_replicated, local
from hf_zero.zero.stages import param_holder


def check_model(model: nn.Module, init_from: Any) -> None:
    if isinstance(model, DistributedDataParallel):
        raise TypeError("the model is already wrapped in DistributedDataParallel; pass the bare model "
                        "(model.module): ZeRO replaces DDP's gradient all-reduce with its own collectives")
    # With init_from the trainable parameters are still on meta; the rest must be on one device.
    devices = sorted({str(p.device) for p in model.parameters() if not (init_from is not None and p.is_meta)})
    if len(devices) > 1:
        raise ZeroConfigError(f"the model's parameters are on several devices ({', '.join(devices)}); "
                              f"move it to one device (model.to(device)) before hf_zero.initialize")
    if devices == ["meta"]:
        raise ZeroConfigError("the model is on the meta device (no values): pass "
                              "init_from=hf_zero.zero.construct.SeededInit(seed) or PretrainedWeights(folder) to build "
                              "it (shard by shard at zero_stage 3)")
    if not devices and init_from is None:
        raise ZeroConfigError("the model has no parameters to train")
    if devices and devices[0].startswith("cuda"):
        # The engine's collectives, streams and pinned copies use this process's own accelerator: a script that
        # moves its model to cuda:LOCAL_RANK without torch.cuda.set_device would put every rank's on GPU 0.
        where, own = torch.device(devices[0]), compute_device()
        if own.type != "cuda" or (where.index if where.index is not None else own.index) != own.index:
            raise ZeroConfigError(f"the model is on {where} but this process computes on {own}: call "
                                  f"torch.cuda.set_device(local_rank) before init_process_group "
                                  f"(hf_zero.runtime.launch.init_distributed and `hf-zero run` do), or move the "
                                  f"model to {own}")


def check_mesh(mesh: DeviceMesh | None, group: torch.distributed.ProcessGroup | None
               ) -> tuple[torch.distributed.ProcessGroup | None, torch.distributed.ProcessGroup | None]:
    """The data-parallel and tensor-parallel process groups of a ("dp", "tp") mesh."""
    if mesh is None:
        return group, None
    if mesh.mesh_dim_names != ("dp", "tp"):
        raise ZeroConfigError(f"mesh must have the dimensions ('dp', 'tp') "
                              f"(hf_zero.runtime.tensor_parallel.init_mesh builds it); got {mesh.mesh_dim_names}")
    if group is not None:
        raise ZeroConfigError("pass either group or mesh: with a mesh, ZeRO runs over its 'dp' dimension")
    if mesh.size() != torch.distributed.get_world_size():
        raise ZeroConfigError(f"the mesh must span every process ({torch.distributed.get_world_size()}), not "
                              f"{mesh.size()}: hf_zero.runtime.tensor_parallel.init_mesh builds such a mesh")
    return mesh["dp"].get_group(), mesh["tp"].get_group()


def trainable_params_by_group(model: nn.Module, optimizer: torch.optim.Optimizer
                              ) -> list[list[tuple[str, nn.Parameter]]]:
    """The named parameters of each optimizer param group, in model order."""
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise ZeroConfigError("a parameter appears in two optimizer param groups; give each parameter one "
                                      "group")
            group_of[id(p)] = g
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in optimizer.param_groups]
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in group_of:
            if not p.requires_grad:
                raise ZeroConfigError(f"parameter {name} is in an optimizer param group but does not require grad; "
                                      f"build the optimizer on the trainable parameters only")
            groups[group_of[id(p)]].append((name, p))
            seen.add(id(p))
        elif p.requires_grad:
            raise ZeroConfigError(f"parameter {name} requires grad but is in no optimizer param group; add it to the "
                                  f"optimizer or set requires_grad=False")
    if not seen:
        raise ZeroConfigError("the optimizer holds no parameter of the model that requires grad: there is nothing to "
                              "train")
    if len(seen) != len(group_of):
        raise ZeroConfigError("the optimizer holds tensors that are not parameters of the model; build it on "
                              "model.parameters()")
    return groups


# ---- construction, in the order ZeroEngine.__init__ calls it ---------------------------------------
def check_inputs(model: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig,
                 group: torch.distributed.ProcessGroup | None, init_from: Any, mesh: DeviceMesh | None
                 ) -> tuple[list[list[tuple[str, nn.Parameter]]], Any, Any]:
    """1. The trainable parameters of each param group, and the data- and tensor-parallel process groups;
    anything the engine cannot train is refused here, before any work."""
    check_model(model, init_from)
    dp_group, tp_group = check_mesh(mesh, group)
    if config.partition_activations or config.cpu_checkpointing:
        check_supports_checkpointing(model)
    check_optimizer(optimizer, config)
    check_compile_backend(config)
    check_topology(config, dp_group)
    return trainable_params_by_group(model, optimizer), dp_group, tp_group


def check_topology(config: ZeroConfig, dp_group: torch.distributed.ProcessGroup | None) -> None:
    """Ranks fill nodes in order; ZeRO++'s node groups (hpZ, qgZ) are cut from the whole world."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    config.check_topology(world, processes_per_node(world))
    zeropp_groups = [key for key, on in (("hpz_partition_size", config.hpz_partition_size > 1),
                                         ("quantized_gradients", config.quantized_gradients)) if on]
    if zeropp_groups and dp_group is not None and torch.distributed.get_world_size(dp_group) != world:
        raise ZeroConfigError(f"{' and '.join(zeropp_groups)} with a data-parallel group smaller than the world "
                              f"(a tensor-parallel mesh) is not supported yet; drop them or the mesh")


@torch.no_grad()
def sync_module_states(model: nn.Module, comm: Communicator, init_from: Any) -> torch.device | None:
    """2. Every rank starts from rank 0's weights and buffers. A model built on meta instead gets its
    buffers and frozen weights from `init_from`, in host memory, and its trainable parameters unit by unit
    in step 3: the same seed or files on every rank give the same values, so nothing is broadcast. Returns
    the device such a model is built on."""
    if init_from is not None:
        init_from.fill_rest(model)
        return compute_device()
    for t in [*model.parameters(), *model.buffers()]:
        comm.broadcast_(local(t))
    return None


@spanned("partition_parameters")
def apply_partitioning(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], config: ZeroConfig,
                       comm: Communicator, init_from: Any, build_device: torch.device | None) -> ParamHolder:
    """3. The stage's parameter holder; the parameters become compute-dtype views of its buffers. A model
    built from `init_from` has the rest of its tensors filled now too, and moved to the device."""
    holder = param_holder(model, groups, config, comm, init_from, build_device)
    if build_device is not None:
        place_rest(model, build_device)
    return holder


@torch.no_grad()
@spanned("partition_parameters")
def apply_precision(model: nn.Module, params: ParamHolder, dtype: torch.dtype) -> None:
    """4. Frozen parameters and the floating buffers of the state dict follow the compute dtype, as a model
    transformers builds in that dtype has them. Buffers a module computes for itself (non-persistent: RoPE's
    inv_freq) keep theirs: the module casts them where it uses them, and rounding inv_freq to bf16 would
    move every rotary angle."""
    for p in model.parameters():
        if id(p) not in params.managed and id(p) not in params.frozen and p.is_floating_point():
            p.data = p.data.to(dtype)
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point() and name not in m._non_persistent_buffers_set:
                setattr(m, name, b.to(dtype))


@spanned("shard_optimizer")
def apply_optimizer(optimizer: torch.optim.Optimizer, params: ParamHolder, config: ZeroConfig, comm: Communicator,
                    scaler: LossScaler, tp_comm: Communicator | None) -> ShardedOptimizer:
    """5. The user's optimizer, re-targeted at this rank's chunks through the update backend of where its
    states live; stage 3 with parameters on NVMe reads its shards from that backend from now on."""
    backend = update_backend(optimizer, params.param_chunks, params.grad_chunks(), params.take_fp32_init(), config,
                             global_rank(), params.chunks_lent, grads_partitioned=params.reduces_every_backward)
    params.attach(backend)
    delayed = DelayedUpdate(config.delayed_param_update_warmup) if config.delayed_param_update else None
    tp_replicated = tp_replicated_ranges(params) if tp_comm is not None else None
    sharded = ShardedOptimizer(backend, params.grads, params.grad_chunks, comm, scaler, config,
                               grads_replicated=params.replicated, delayed=delayed, tp_comm=tp_comm,
                               tp_replicated=tp_replicated)
    params.grads.measure_with(params.chunk_keys(), sharded.chunk_square_sum)
    return sharded


def apply_activation_checkpointing(model: nn.Module, config: ZeroConfig,
                                   tp_comm: Communicator | None) -> CheckpointStore | None:
    """6. ZeRO-R: every block checkpointed into a store that partitions (P_a) or offloads (P_a+cpu) it."""
    if not (config.partition_activations or config.cpu_checkpointing):
        return None
    store = CheckpointStore(tp_comm, config.partition_activations, config.cpu_checkpointing)
    activations.apply_activation_checkpointing(model, store)
    return store


def tp_replicated_ranges(params: ParamHolder) -> list[list[list[tuple[int, int]]]]:
    """For each owned chunk, the element ranges of parameters every tp rank holds whole (norms, embeddings,
    row-wise biases): the gradient norm counts them once, not tp times."""
    return [[[(piece.range_lo, piece.range_lo + piece.param_hi - piece.param_lo)
              for piece in flat.pieces_between(lo, hi) if is_tp_replicated(piece.slice.param)]
             for flat, lo, hi in chunks] for chunks in params.owned_ranges()]
