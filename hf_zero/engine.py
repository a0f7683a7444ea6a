"""ZeroEngine: forward, backward and step with the model states partitioned as `zero_stage` says.

Construction applies, in this order:
  1. check_inputs          bad settings, optimizers and models are refused before any work
  2. sync_module_states    every rank starts from rank 0's weights and buffers, as DDP does
  3. apply_partitioning    flat buffers and buckets (stages 0-2) or units and shards (stage 3)
  4. apply_precision       parameters become compute-dtype views; fp32 masters stay on the shard
  5. apply_optimizer       the user's optimizer is re-targeted at this rank's shard
  6. apply_activation_checkpointing   ZeRO-R: block checkpoints partitioned over tp / in host memory

With a ("dp", "tp") DeviceMesh (`mesh`), the model's blocks are already tensor-parallel DTensors
(hf_zero/tensor_parallel.py): ZeRO partitions each rank's local parts over the "dp" dimension, and
the gradient norm adds the tp ranks' parts, counting the replicated parameters once.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hf_zero import checkpoint
from hf_zero.comm import Communicator, Ledger
from hf_zero.config import ZeroConfig
from hf_zero.launch import destroy_process_group_at_exit
from hf_zero.offload.delayed import DelayedUpdate
from hf_zero.offload.host import HOST
from hf_zero.offload.nvme import ParamReader
from hf_zero.precision import LossScaler
from hf_zero.zero.activations import CheckpointStore, apply_activation_checkpointing, check_supports_checkpointing
from hf_zero.zero.optimizer import ShardedOptimizer, check_optimizer
from hf_zero.zero.partition import FlatParamBuffer, is_tp_replicated, local
from hf_zero.zero.stage1 import ReplicatedGradients
from hf_zero.zero.stage2 import PartitionedGradients
from hf_zero.zero.stage3 import Stage3Params

logger = logging.getLogger("hf_zero")


def check_model(model: nn.Module, init_from: Any, zero_stage: int) -> None:
    if isinstance(model, DistributedDataParallel):
        raise TypeError("the model is already wrapped in DistributedDataParallel; pass the bare model "
                        "(model.module): ZeRO replaces DDP's gradient all-reduce with its own collectives")
    if init_from is not None and zero_stage != 3:
        raise ValueError(f"init_from builds the model straight into stage-3 shards; it needs zero_stage 3, "
                         f"not {zero_stage}")
    # With init_from the trainable parameters are still on meta; the rest must be on one device.
    devices = sorted({str(p.device) for p in model.parameters() if not (init_from is not None and p.is_meta)})
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({', '.join(devices)}); "
                         f"move it to one device (model.to(device)) before hf_zero.initialize")
    if devices == ["meta"]:
        raise ValueError("the model is on the meta device (no values): pass init_from=hf_zero.construct.SeededInit"
                         "(seed) or PretrainedWeights(folder) with zero_stage 3 to build it shard by shard")
    if not devices and init_from is None:
        raise ValueError("the model has no parameters to train")


def check_mesh(mesh: DeviceMesh | None, group: torch.distributed.ProcessGroup | None, init_from: Any
               ) -> tuple[torch.distributed.ProcessGroup | None, torch.distributed.ProcessGroup | None]:
    """The data-parallel and tensor-parallel process groups of a ("dp", "tp") mesh."""
    if mesh is None:
        return group, None
    if mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError(f"mesh must have the dimensions ('dp', 'tp') (hf_zero.tensor_parallel.init_mesh builds "
                         f"it); got {mesh.mesh_dim_names}")
    if group is not None:
        raise ValueError("pass either group or mesh: with a mesh, ZeRO runs over its 'dp' dimension")
    if mesh.size() != torch.distributed.get_world_size():
        raise ValueError(f"the mesh must span every process ({torch.distributed.get_world_size()}), not "
                         f"{mesh.size()}: hf_zero.tensor_parallel.init_mesh builds such a mesh")
    if init_from is not None:
        raise ValueError("init_from with a tensor-parallel mesh is not available yet; build the model, apply "
                         "hf_zero.tensor_parallel.apply_tensor_parallel, then initialize without init_from")
    return mesh["dp"].get_group(), mesh["tp"].get_group()


def trainable_params_by_group(model: nn.Module, optimizer: torch.optim.Optimizer
                              ) -> list[list[tuple[str, nn.Parameter]]]:
    """The named parameters of each optimizer param group, in model order."""
    group_of: dict[int, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in group_of:
                raise ValueError("a parameter appears in two optimizer param groups; give each parameter one group")
            group_of[id(p)] = g
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in optimizer.param_groups]
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in group_of:
            if not p.requires_grad:
                raise ValueError(f"parameter {name} is in an optimizer param group but does not require grad; "
                                 f"build the optimizer on the trainable parameters only")
            groups[group_of[id(p)]].append((name, p))
            seen.add(id(p))
        elif p.requires_grad:
            raise ValueError(f"parameter {name} requires grad but is in no optimizer param group; add it to the "
                             f"optimizer or set requires_grad=False")
    if len(seen) != len(group_of):
        raise ValueError("the optimizer holds tensors that are not parameters of the model; build it on "
                         "model.parameters()")
    if any(not named for named in groups):
        raise ValueError("an optimizer param group has no parameters of the model; drop empty groups")
    return groups


class ZeroEngine(nn.Module):
    """Wraps a model and its optimizer. Use `out = engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    An nn.Module holding the model as `engine.module`, as DeepSpeed's engine and DDP do, so that a
    training loop written for a wrapped model (the Trainer's) can call it, train() it and zero_grad() it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: ZeroConfig | dict[str, Any] | str | None = None,
                 group: torch.distributed.ProcessGroup | None = None, init_from: Any = None,
                 mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        # 1. check_inputs
        self.config = cfg = ZeroConfig.from_any(config)
        check_model(model, init_from, cfg.zero_stage)
        group, tp_group = check_mesh(mesh, group, init_from)
        if cfg.partition_activations or cfg.cpu_checkpointing:
            check_supports_checkpointing(model)
        check_optimizer(optimizer, cfg)
        groups = trainable_params_by_group(model, optimizer)
        self.module, self.optimizer = model, optimizer
        self.zero_stage, self.dtype = cfg.zero_stage, cfg.torch_dtype
        self.ledger = Ledger()
        self.comm = Communicator(self.ledger, group)
        self.tp_comm = Communicator(self.ledger, tp_group) if tp_group is not None else None
        # Every rank holding part of the model's state: the dp group, times the tp group with a mesh.
        # Checkpoints agree over it, so that a failure on any rank stops every rank.
        self.world_comm = Communicator(self.ledger) if mesh is not None else self.comm
        if torch.distributed.is_initialized():
            destroy_process_group_at_exit()
        self.scaler = LossScaler(cfg)
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.global_grad_norm: float | None = None
        self.last_step_skipped = False
        # 2. sync_module_states (a model built on meta gets its buffers and frozen weights first; its
        # trainable parameters are filled unit by unit in step 3, identically on every rank)
        build_device = None
        if init_from is not None:
            build_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
            init_from.fill_rest(model, build_device)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                if not t.is_meta:
                    self.comm.broadcast_(local(t.data))
        # 3-4. apply_partitioning, apply_precision
        self.stage3: Stage3Params | None = None
        self.flats: list[FlatParamBuffer] = []
        if self.zero_stage == 3:
            param_chunks, grad_chunks, fp32_init = self._apply_stage3(model, groups, init_from, build_device)
        else:
            param_chunks, grad_chunks, fp32_init = self._apply_flat_buffers(groups)
        # What the engine partitions; everything else in the model stays replicated as it is.
        self.managed_slices = {id(s.param): s for flats in self.managed_flats() for flat in flats
                               for s in flat.slices}
        self._cast_rest(model)
        # 5. apply_optimizer
        self.sharded_optimizer = ShardedOptimizer(
            optimizer, param_chunks, grad_chunks, fp32_init, self.comm, self.scaler, cfg,
            grads_replicated=self.zero_stage == 0,
            delayed=DelayedUpdate(cfg.delayed_param_update_warmup) if cfg.delayed_param_update else None,
            tp_comm=self.tp_comm, tp_replicated=self._tp_replicated_ranges() if self.tp_comm else None)
        if self.sharded_optimizer.params_on_nvme:
            self.stage3.read_shards_from(ParamReader(self.sharded_optimizer.nvme))
        # 6. apply_activation_checkpointing
        self.checkpoints: CheckpointStore | None = None
        if cfg.partition_activations or cfg.cpu_checkpointing:
            self.checkpoints = CheckpointStore(self.tp_comm, cfg.partition_activations, cfg.cpu_checkpointing)
            apply_activation_checkpointing(model, self.checkpoints)
        self._update_state_bytes()
        logger.info(self.ledger.report(self.comm.rank))

    def _tp_replicated_ranges(self) -> list[list[list[tuple[int, int]]]]:
        """For each owned chunk, the element ranges of parameters every tp rank holds whole (norms,
        embeddings, row-wise biases): the gradient norm counts them once, not tp times."""
        ranges = []
        for chunks in self.owned_chunk_ranges():
            ranges.append([])
            for flat, lo, hi in chunks:
                ranges[-1].append([(piece.range_lo, piece.range_lo + piece.param_hi - piece.param_lo)
                                   for piece in flat.pieces_between(lo, hi) if is_tp_replicated(piece.slice.param)])
        return ranges

    # ---- construction ------------------------------------------------------------------------
    def _apply_flat_buffers(self, groups):
        shards = self.comm.world_size if self.zero_stage >= 1 else 1
        self.shard = self.comm.rank if self.zero_stage >= 1 else 0
        # Reverse model order: backward produces the last layers' gradients first, so buckets fill in turn.
        self.flats = [FlatParamBuffer(list(reversed(named)), shards, self.dtype, self.config.reduce_bucket_size)
                      for named in groups]
        fp32_init = None
        if self.dtype != torch.float32:
            fp32_init = []
            for flat in self.flats:
                fp32_init.append([])
                for b in flat.buckets:
                    lo, hi = b.owned_range(self.shard)
                    fp32_init[-1].append(torch.empty(hi - lo, device=flat.data.device))
                    flat.read_params(lo, hi, fp32_init[-1][-1])
        for flat in self.flats:
            flat.pack_and_bind()
        if self.zero_stage == 2:
            self.grads = PartitionedGradients(self.flats, self.comm, self.config.overlap_comm,
                                              shard_device=HOST if self.config.offload_optimizer != "none" else None)
        else:
            self.grads = ReplicatedGradients(self.flats, self.comm, self.config.overlap_comm,
                                             partitioned=self.zero_stage == 1)
        param_chunks = [[flat.owned_chunk(b, self.shard) for b in flat.buckets] for flat in self.flats]
        grad_chunks = [[self.grads.owned_grad(fi, b.index) for b in flat.buckets]
                       for fi, flat in enumerate(self.flats)]
        return param_chunks, grad_chunks, fp32_init

    def _apply_stage3(self, model, groups, init_from, build_device):
        cfg = self.config
        self.stage3 = Stage3Params(model, groups, self.dtype, self.comm, cfg.unit_module_classes,
                                   cfg.param_persistence_threshold, cfg.prefetch_bucket_size, cfg.overlap_comm,
                                   cfg.reshard_root_after_forward, init_from, build_device,
                                   param_shard_device=HOST if cfg.offload_param != "none" else None,
                                   grad_shard_device=HOST if cfg.offload_optimizer != "none" else None)
        self.grads = self.stage3.grads
        fp32_init, self.stage3.fp32_init = self.stage3.fp32_init, None
        return self.stage3.param_chunks, self.stage3.grad_chunks(), fp32_init

    def _cast_rest(self, model: nn.Module) -> None:
        """Frozen parameters and floating buffers follow the compute dtype, as model.to(dtype) would."""
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in self.managed_slices and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
            for m in model.modules():
                for name, b in m.named_buffers(recurse=False):
                    if b.is_floating_point():
                        setattr(m, name, b.to(self.dtype))

    # ---- training ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, *, last_micro_batch: bool | None = None) -> None:
        """Back-propagates `loss` of one micro-batch; gradients are reduced as their buckets fill.

        The loss is divided by gradient_accumulation_steps. `last_micro_batch` says whether this
        backward closes the accumulation window; by default the engine counts micro-batches itself.
        Callers that decide the window themselves (the Trainer, whose last window of an epoch may be
        short) pass it, set gradient_accumulation_steps to 1 and scale the loss themselves.
        """
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss of one micro-batch")
        self._check_params_bound()
        if last_micro_batch is None:
            last_micro_batch = self.is_gradient_accumulation_boundary()
        self.sharded_optimizer.norm_is_current = False
        # Stages 0-1 keep whole gradients and reduce once per step; stages 2-3 reduce every backward.
        self.grads.begin(reduce=self.zero_stage >= 2 or last_micro_batch)
        try:
            (loss * (self.scaler.scale / self.gradient_accumulation_steps)).backward()
        finally:
            self.grads.finish()
            if self.stage3 is not None:
                self.stage3.free_all()

    def _check_params_bound(self) -> None:
        moved = [name for flat in self.flats for name in flat.moved_params()]
        if moved:
            raise RuntimeError(
                f"parameters {moved[:3]}{' ...' if len(moved) > 3 else ''} no longer live in the engine's flat "
                f"buffers: model.to(...), model.half() or `param.data = ...` was called after hf_zero.initialize. "
                f"Move or cast the model before initialize; after it, the engine owns the parameters' storage")

    def step(self) -> None:
        """Counts a micro-batch; at the accumulation boundary runs optimizer_step()."""
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps == 0:
            self.optimizer_step()

    def compute_grad_norm(self) -> float:
        """The global gradient norm of the reduced gradients (one all-reduce); the next optimizer_step()
        clips to gradient_clipping with it instead of computing it again."""
        self.grads.allocate()
        return self.sharded_optimizer.compute_grad_norm()

    def optimizer_step(self) -> None:
        """Updates this rank's shard from the reduced gradients and re-shares the parameters."""
        self.grads.allocate()
        stepped = self.sharded_optimizer.step(self.global_steps)
        self.global_grad_norm = self.sharded_optimizer.global_grad_norm
        self.last_step_skipped = not stepped
        if stepped:
            self._share_updated_params()
        else:
            self.skipped_steps += 1
            logger.warning("rank %d: gradient overflow, step %d skipped; loss scale is now %g",
                           self.comm.rank, self.global_steps, self.scaler.scale)
        self.grads.zero_grad()
        self.global_steps += 1
        self.ledger.close_step()
        self._update_state_bytes()

    def _share_updated_params(self) -> None:
        """Stages 1-2: all-gather every bucket in place, at most allgather_bucket_size elements in flight.
        Stage 3: only the persistent parameters are replicated; the rest are gathered on use."""
        if self.stage3 is not None:
            self.stage3.regather_persistent()
            return
        if self.zero_stage == 0:
            return
        in_flight: deque[tuple[Any, int]] = deque()
        numel_in_flight = 0
        for flat in self.flats:
            for b in flat.buckets:
                work = self.comm.all_gather_(flat.data[b.start:b.end], flat.owned_chunk(b, self.shard), async_op=True)
                in_flight.append((work, b.numel))
                numel_in_flight += b.numel
                while numel_in_flight > self.config.allgather_bucket_size and len(in_flight) > 1:
                    done, n = in_flight.popleft()
                    done.wait()
                    numel_in_flight -= n
        for work, _ in in_flight:
            work.wait()

    def finish_pending_update(self) -> None:
        """With delayed_param_update: waits for the update still running on the host and gives its
        parameters to the model on every rank. Saving, loading and gathered_parameters() call it; call
        it yourself before reading parameters directly (all ranks must)."""
        if self.sharded_optimizer.finish_pending():
            self._share_updated_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the accumulated gradients; they live in the engine's buffers, so `set_to_none` changes nothing."""
        self.grads.zero_grad()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """Yields the module with every parameter whole (stage 3 gathers them and frees them after)."""
        self.finish_pending_update()
        if self.stage3 is None:
            yield self.module
        else:
            with self.stage3.gathered():
                yield self.module

    @torch.no_grad()
    def gathered_masters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's fp32 master weights, whole, on every rank (with tensor parallelism:
        this rank's local parts). For inspection and tests: it holds the model in fp32. All ranks must call it."""
        self.finish_pending_update()
        masters = {s.name: torch.zeros(s.numel) for flats in self.managed_flats() for flat in flats
                   for s in flat.slices}
        for g, chunks in enumerate(self.owned_chunk_ranges()):
            for k, (flat, lo, hi) in enumerate(chunks):
                master, _ = self.sharded_optimizer.chunk_state(g, k)
                for piece in flat.pieces_between(lo, hi):
                    n = piece.param_hi - piece.param_lo
                    masters[piece.slice.name][piece.param_lo:piece.param_hi] = \
                        master.detach()[piece.range_lo:piece.range_lo + n].float().cpu()
        shapes = {s.name: s.shape for flats in self.managed_flats() for flat in flats for s in flat.slices}
        for name, values in masters.items():
            if self.zero_stage >= 1:  # each element is owned by one rank; the others hold zeros
                values = values.to(self.comm.device)
                self.comm.all_reduce_(values)
            masters[name] = values.cpu().view(shapes[name])
        return masters

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, directory: str | os.PathLike, client_state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own partition (safetensors) and rank 0 a manifest; all ranks must call it.
        `client_state` (JSON: a scheduler's state, a data position) comes back from load_checkpoint."""
        self.finish_pending_update()
        return checkpoint.save(self, directory, client_state)

    def load_checkpoint(self, directory: str | os.PathLike) -> dict[str, Any] | None:
        """Loads a checkpoint saved at any data-parallel size and stage (with tensor parallelism: the same
        tp size); returns its client_state."""
        self.finish_pending_update()
        return checkpoint.load(self, directory)

    def managed_flats(self) -> list[list[FlatParamBuffer]]:
        """The flat buffers of each optimizer param group."""
        if self.stage3 is not None:
            return [[self.stage3.flats[fi] for fi in flats] for flats in self.stage3.chunk_flats]
        return [[flat] for flat in self.flats]

    def owned_chunk_ranges(self) -> list[list[tuple[FlatParamBuffer, int, int]]]:
        """For each param group, the (flat buffer, lo, hi) of every chunk this rank steps, in the
        optimizer's order."""
        if self.stage3 is not None:
            return [[(flat, *flat.buckets[0].owned_range(self.comm.rank)) for flat in flats]
                    for flats in self.managed_flats()]
        return [[(flat, *b.owned_range(self.shard)) for b in flat.buckets] for flat in self.flats]

    def unmanaged_state(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers: replicated on every rank, outside the engine's shards."""
        return {name: t for name, t in self.module.state_dict(keep_vars=True).items()
                if id(t) not in self.managed_slices}

    @torch.no_grad()
    def restore(self, module_state: dict[str, torch.Tensor], manifest: dict[str, Any]) -> None:
        """After the masters are set from a checkpoint: the rest of the state, then whole parameters again."""
        own = self.unmanaged_state()
        for name, value in module_state.items():
            local(own[name]).copy_(value)
        self.global_steps, self.micro_steps = manifest["global_steps"], manifest["micro_steps"]
        self.skipped_steps = manifest["skipped_steps"]
        self.scaler.load_state_dict(manifest["loss_scaler"])
        if self.stage3 is not None:
            self.stage3.free_all()
        self._share_updated_params()
        self.zero_grad()

    # ---- accounting --------------------------------------------------------------------------
    def _update_state_bytes(self) -> None:
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        unmanaged = nbytes(p for p in self.module.parameters() if id(p) not in self.managed_slices)
        if self.stage3 is not None:
            params = self.stage3.held_bytes()
        else:
            params = nbytes(flat.data for flat in self.flats)
        comm_buffers = self.grads.buffer_bytes() if isinstance(self.grads, PartitionedGradients) else 0
        self.ledger.state_bytes = {
            "parameters": params + unmanaged,
            "gradients": self.grads.held_bytes(),
            "optimizer_states": self.sharded_optimizer.held_bytes(),
            "buffers": nbytes(self.module.buffers()) + comm_buffers,
        }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer,
               config: ZeroConfig | dict[str, Any] | str | None = None,
               group: torch.distributed.ProcessGroup | None = None, init_from: Any = None,
               mesh: DeviceMesh | None = None) -> ZeroEngine:
    """Partitions `model` and `optimizer` across the ranks of `group` (default: the whole world), or
    across the "dp" dimension of a ("dp", "tp") `mesh` whose "tp" dimension the model was made
    tensor-parallel over (hf_zero.tensor_parallel).
    A model built on the meta device is materialised shard by shard from `init_from` (stage 3):
    hf_zero.construct.SeededInit(seed) or PretrainedWeights(folder)."""
    return ZeroEngine(model, optimizer, config, group, init_from, mesh)
