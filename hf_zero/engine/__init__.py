"""ZeroEngine: forward, backward and step with the model states partitioned as `zero_stage` says.

Construction is these functions, called in this order by ZeroEngine.__init__:
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

The engine never asks which stage or offload mode it runs: the holder and the backend answer for them.

With a ("dp", "tp") DeviceMesh (`mesh`), the model's blocks are already tensor-parallel DTensors
(hf_zero/runtime/tensor_parallel.py): ZeRO partitions each rank's local parts over the "dp" dimension, and
the gradient norm adds the tp ranks' parts, counting the replicated parameters once.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hf_zero import checkpoint
from hf_zero.checkpoint import export
from hf_zero.checkpoint.frozen_source import FrozenSources
from hf_zero.optim.delayed import DelayedUpdate
from hf_zero.optim.optimizer import ShardedOptimizer, check_optimizer, update_backend
from hf_zero.optim.precision import LossScaler
from hf_zero.runtime.comm import Communicator, Ledger
from hf_zero.runtime.comm import rank as global_rank
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.launch import destroy_process_group_at_exit
from hf_zero.settings.config import ZeroConfig, ZeroConfigError
from hf_zero.settings.deepspeed_config import engine_config
from hf_zero.settings.environment import processes_per_node
from hf_zero.testing.simulated_gpu import start_checking
from hf_zero.zero import activations
from hf_zero.zero.activations import CheckpointStore, check_supports_checkpointing
from hf_zero.zero.construct import place_rest
from hf_zero.zero.holder import ParamHolder
from hf_zero.zero.partition import is_tp_replicated, local
from hf_zero.zero.stages import check_builds_from, param_holder

logger = logging.getLogger("hf_zero")


class NonFiniteGradientsError(RuntimeError):
    """Too many optimizer steps in a row had gradients that were not finite (max_skipped_steps_in_a_row)."""


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
        raise ZeroConfigError("the model is on the meta device (no values): pass init_from=hf_zero.zero.construct.SeededInit"
                         "(seed) or PretrainedWeights(folder) with zero_stage 3 to build it shard by shard")
    if not devices and init_from is None:
        raise ZeroConfigError("the model has no parameters to train")
    if devices and devices[0].startswith("cuda"):
        # The engine's collectives, streams and pinned copies use this process's own accelerator: a script that
        # moves its model to cuda:LOCAL_RANK without torch.cuda.set_device would put every rank's on GPU 0.
        where, own = torch.device(devices[0]), compute_device()
        if own.type != "cuda" or (where.index if where.index is not None else own.index) != own.index:
            raise ZeroConfigError(f"the model is on {where} but this process computes on {own}: call "
                                  f"torch.cuda.set_device(local_rank) before init_process_group "
                                  f"(hf_zero.runtime.launch.init_distributed and `hf-zero run` do), or move the model to {own}")


def check_mesh(mesh: DeviceMesh | None, group: torch.distributed.ProcessGroup | None
               ) -> tuple[torch.distributed.ProcessGroup | None, torch.distributed.ProcessGroup | None]:
    """The data-parallel and tensor-parallel process groups of a ("dp", "tp") mesh."""
    if mesh is None:
        return group, None
    if mesh.mesh_dim_names != ("dp", "tp"):
        raise ZeroConfigError(f"mesh must have the dimensions ('dp', 'tp') (hf_zero.runtime.tensor_parallel.init_mesh builds "
                         f"it); got {mesh.mesh_dim_names}")
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
    check_builds_from(init_from, config)
    dp_group, tp_group = check_mesh(mesh, group)
    if config.partition_activations or config.cpu_checkpointing:
        check_supports_checkpointing(model)
    check_optimizer(optimizer, config)
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
    for t in list(model.parameters()) + list(model.buffers()):
        comm.broadcast_(local(t.data))
    return None


def apply_partitioning(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], config: ZeroConfig,
                       comm: Communicator, init_from: Any, build_device: torch.device | None) -> ParamHolder:
    """3. The stage's parameter holder; the parameters become compute-dtype views of its buffers. A model
    built from `init_from` has the rest of its tensors filled now too, and moved to the device."""
    holder = param_holder(model, groups, config, comm, init_from, build_device)
    if build_device is not None:
        place_rest(model, build_device)
    return holder


@torch.no_grad()
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


class ZeroEngine(nn.Module):
    """Wraps a model and its optimizer. Use `out = engine(batch)`, `engine.backward(loss)`, `engine.step()`.

    An nn.Module holding the model as `engine.module`, as DeepSpeed's engine and DDP do, so that a
    training loop written for a wrapped model (the Trainer's) can call it, train() it and zero_grad() it.
    `engine.params` is the stage's parameter holder, `engine.sharded_optimizer` steps its chunks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: ZeroConfig | dict[str, Any] | str | None = None,
                 group: torch.distributed.ProcessGroup | None = None, init_from: Any = None,
                 mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        self.config = cfg = engine_config(config)
        groups, dp_group, tp_group = check_inputs(model, optimizer, cfg, group, init_from, mesh)
        start_checking()  # under the simulation "late": the stream order of everything below (simulated_gpu)
        self.module, self.optimizer = model, optimizer
        self.zero_stage, self.dtype = cfg.zero_stage, cfg.torch_dtype
        self.ledger = Ledger()
        per_node = cfg.ranks_per_node
        self.comm = Communicator(self.ledger, dp_group, per_node)
        self.tp_comm = Communicator(self.ledger, tp_group, per_node) if tp_group is not None else None
        # Every rank holding part of the model's state: the dp group, times the tp group with a mesh.
        # Checkpoints agree over it, so that a failure on any rank stops every rank.
        self.world_comm = Communicator(self.ledger, None, per_node) if mesh is not None else self.comm
        if torch.distributed.is_initialized():
            destroy_process_group_at_exit()
        self.scaler = LossScaler(cfg)
        self.micro_steps = self.global_steps = self._skipped_steps = self.skipped_in_a_row = 0
        self._global_grad_norm: float | None = None
        self._last_step_skipped = False
        self._stop: NonFiniteGradientsError | None = None  # raised by the next optimizer_step, on every rank alike
        self.frozen_sources = FrozenSources()  # where the frozen weights come from, for checkpoints to record
        build_device = sync_module_states(model, self.comm, init_from)
        self.params = apply_partitioning(model, groups, cfg, self.comm, init_from, build_device)
        apply_precision(model, self.params, self.dtype)
        self.sharded_optimizer = apply_optimizer(optimizer, self.params, cfg, self.comm, self.scaler, self.tp_comm)
        self.activation_store = apply_activation_checkpointing(model, cfg, self.tp_comm)
        self._update_state_bytes()

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
        self.params.check_bound()
        if last_micro_batch is None:
            last_micro_batch = self.is_gradient_accumulation_boundary()
        self.sharded_optimizer.norm = None  # the gradients change
        self.params.begin_backward(last_micro_batch)
        try:
            (loss * (self.scaler.scale / self.gradient_accumulation_steps)).backward()
        finally:
            self.params.end_backward()

    def step(self) -> None:
        """Counts a micro-batch; at the accumulation boundary runs optimizer_step()."""
        self.micro_steps += 1
        if self.micro_steps % self.gradient_accumulation_steps == 0:
            self.optimizer_step()

    def compute_grad_norm(self) -> float:
        """The global gradient norm of the reduced gradients (one all-reduce); the next optimizer_step()
        clips to gradient_clipping with it instead of computing it again."""
        return self.grad_norm_on_device().item()

    def grad_norm_on_device(self) -> torch.Tensor:
        """`compute_grad_norm` as a 0-dim fp64 tensor on the compute device, which nothing waits for (the Trainer
        reads it only when it logs)."""
        self.params.grads.allocate()
        return self.sharded_optimizer.norm_on_device()

    def optimizer_step(self) -> None:
        """Updates this rank's shard from the reduced gradients and re-shares the parameters.

        With torch's fused Adam or AdamW on the device and no dynamic loss scale, the host does not wait for the
        gradient norm before it queues the update: the device skips a step whose gradients are not finite, and the
        host learns the step's norm and outcome (`global_grad_norm`, `last_step_skipped`, `skipped_steps`) when one
        of them is read or at the next step, whichever comes first; max_skipped_steps_in_a_row stops training at the
        next step, or at `check_skipped_steps`. A host that waited here would drain the device's queue once a step
        and then feed it from behind."""
        self.check_skipped_steps()
        self.params.grads.allocate()
        unused = self._unused_on_every_rank()
        outcome = self.sharded_optimizer.step(self.global_steps, self.params.chunk_ranges_of(unused) if unused
                                              else None)
        if outcome is None or outcome[1]:  # applied, or the device decides (a skip re-shares unchanged values)
            self.params.after_step()
        if outcome is not None:
            self._count(self.global_steps, *outcome)
            self._stop_if_skipping()
        self._update_state_bytes()  # at the step, while the gradient shards exist
        self.params.grads.zero_grad()
        self.global_steps += 1
        self.ledger.close_step()
        if self.global_steps == 1:  # the first step is when gradients, optimizer states and traffic exist
            logger.info(self.ledger.report(self.comm.rank))

    def _count(self, step: int, norm: float, stepped: bool) -> None:
        """Takes in step `step`'s outcome: its global norm, and whether it stepped or was skipped. Reaching
        max_skipped_steps_in_a_row stops training at the next `_stop_if_skipping`, which every rank reaches at the
        same point (the outcome may be taken in where one rank alone reads it)."""
        self._global_grad_norm, self._last_step_skipped = norm, not stepped
        if stepped:
            self.skipped_in_a_row = 0
            return
        self._skipped_steps += 1
        self.skipped_in_a_row += 1
        logger.warning("rank %d: %s", self.comm.rank, self.scaler.skipped_step_message(step, norm))
        limit = self.config.max_skipped_steps_in_a_row
        if limit and self.skipped_in_a_row >= limit:  # the norm is global: every rank counts alike
            self._stop = NonFiniteGradientsError(
                f"{self.skipped_in_a_row} optimizer steps in a row were skipped because the gradients were not "
                f"finite (last global norm {norm}); stopping rather than training nothing. "
                f"Look for inf or NaN in the loss or the data, or lower the learning rate; "
                f"max_skipped_steps_in_a_row sets how many skipped steps in a row are allowed (0: no limit)")

    def check_skipped_steps(self) -> None:
        """Raises NonFiniteGradientsError when the last max_skipped_steps_in_a_row optimizer steps were all
        skipped, waiting for the last step's outcome where the device decided it. Every rank must call it (the
        Trainer does after each step; the next optimizer_step does too): every rank then stops alike."""
        self._settle()
        self._stop_if_skipping()

    def _stop_if_skipping(self) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    def _settle(self) -> None:
        """Takes in the outcome of the last step the device decided, once its norm has reached the host."""
        outcome = self.sharded_optimizer.settle()
        if outcome is not None:
            self._count(*outcome)

    @property
    def global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last optimizer step."""
        self._settle()
        return self._global_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (gradients not finite)."""
        self._settle()
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (gradients not finite)."""
        self._settle()
        return self._skipped_steps

    def _unused_on_every_rank(self) -> set[nn.Parameter]:
        """The parameters no rank computed a gradient for since the last step. torch's optimizers leave a
        parameter without a gradient as it is (no weight decay, no moment update), and DDP leaves its gradient
        None, so the step leaves them as they are too. One used on some ranks only is stepped with the
        average of its gradients and the others' zeros, as under DDP. On several ranks, where the device decides the
        step, the host reads the ranks' flags back (waiting for the device's queue) only when this rank left a
        parameter unused (a mixture of experts): a rank that used them all knows that none went unused everywhere."""
        params = list(self.params.grads.param_pieces)
        unused_here = set(self.params.grads.take_unused())
        if self.comm.world_size == 1:
            unused = unused_here
        else:
            reads = unused_here or not self.sharded_optimizer.decided_on_device
            # A rank that reads the flags back waits for the device anyway; one that does not makes them on the
            # device, where a copy from pageable host memory would wait for the device's queue too.
            flags = torch.tensor([p not in unused_here for p in params], dtype=torch.uint8).to(self.comm.device) \
                if reads else torch.ones(len(params), dtype=torch.uint8, device=self.comm.device)
            self.comm.any_rank_(flags)  # every rank takes part, whatever it reads
            unused = {p for p, used in zip(params, flags.tolist()) if not used} if reads else set()
        if unused and (self.config.delayed_param_update or self.config.offload_optimizer == "nvme"):
            names = sorted(self.params.managed[id(p)].name for p in unused)
            raise ValueError(f"no rank computed a gradient for {', '.join(names[:5])}"
                             f"{f' and {len(names) - 5} more' if len(names) > 5 else ''} in this step; torch's "
                             f"optimizers leave such parameters untouched, which "
                             f"{'delayed_param_update' if self.config.delayed_param_update else 'offload_optimizer nvme'}"
                             f" cannot do yet. Set requires_grad=False on parameters the model does not use, or "
                             f"turn that setting off")
        return unused

    def finish_pending_update(self) -> None:
        """With delayed_param_update: waits for the update still running on the host and gives its
        parameters to the model on every rank. Saving, loading and gathered_parameters() call it; call
        it yourself before reading parameters directly (all ranks must)."""
        if self.sharded_optimizer.finish_pending():
            self.params.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the accumulated gradients; they live in the engine's buffers, so `set_to_none` changes nothing."""
        self.params.grads.zero_grad()

    # ---- whole parameters --------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self, only: Iterable[nn.Parameter] | None = None) -> Iterator[nn.Module]:
        """Yields the module with every parameter whole, or at least those in `only` (stage 3 gathers the units
        holding them and frees them after)."""
        self.finish_pending_update()
        with self.params.gathered(None if only is None else {id(p) for p in only}):
            yield self.module

    @contextlib.contextmanager
    def units_kept_gathered(self) -> Iterator[None]:
        """For a loop of forwards whose weights do not change (evaluation, prediction): at stage 3 the units stay
        gathered inside, every one gathered on entry where they fit within Stage3Params.keep_limit()
        (Stage3Params.units_kept_gathered), instead of gathered again by every forward. Below stage 3 the
        parameters are whole already. The last update lands first (delayed_param_update)."""
        self.finish_pending_update()
        with self.params.units_kept_gathered() if self.zero_stage == 3 else contextlib.nullcontext():
            yield

    @torch.no_grad()
    def gathered_masters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's fp32 master weights, whole, on every rank (with tensor parallelism:
        this rank's local parts). For inspection and tests: it holds the model in fp32. All ranks must call it."""
        self.finish_pending_update()
        return self._masters_of(list(self.params.slices()))

    def _weights_one_part_at_a_time(self, frozen: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The trained parameters, whole, by slice name, a part at a time (stage 3: a unit), on every rank: in mixed
        precision their fp32 masters, as the stock Trainer's fp32 model under --bf16 holds them; else the parameters
        themselves (valid until the next part is gathered). With `frozen`, also the frozen weights the holder
        partitions (stage 3), as the model holds them. All ranks must call it."""
        managed, mixed = self.params.managed, self.dtype != torch.float32
        frozen = frozen and bool(self.params.frozen)
        for slices in self.params.parts() if mixed and not frozen else self.params.gathered_one_at_a_time():
            trained = [s for s in slices if id(s.param) in managed]
            weights = self._masters_of(trained) if mixed else {s.name: s.param.data for s in trained}
            if frozen:
                weights |= {s.name: s.param.data for s in slices if id(s.param) not in managed}
            yield weights

    @torch.no_grad()
    def _masters_of(self, slices: list[Any]) -> dict[str, torch.Tensor]:
        """Each rank fills the elements of `slices` it owns (the others hold zeros), and one all-reduce per
        parameter makes them whole everywhere."""
        masters = {s.name: torch.zeros(s.numel) for s in slices}
        for g, chunks in enumerate(self.params.owned_ranges()):
            for k, (flat, lo, hi) in enumerate(chunks):
                pieces = [piece for piece in flat.pieces_between(lo, hi) if piece.slice.name in masters]
                if not pieces:
                    continue
                master, _ = self.sharded_optimizer.backend.chunk_state(g, k)
                for piece in pieces:
                    n = piece.param_hi - piece.param_lo
                    masters[piece.slice.name][piece.param_lo:piece.param_hi] = \
                        master.detach()[piece.range_lo:piece.range_lo + n].float().cpu()
        for s in slices:
            values = masters[s.name]
            if not self.params.replicated:  # each element is owned by one rank; the others hold zeros
                values = values.to(self.comm.device)
                self.comm.all_reduce_(values)
            masters[s.name] = values.cpu().view(s.shape)
        return masters

    @torch.no_grad()
    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter whole on every rank, a unit at a time: what a PEFT adapter saves (a few MB),
        never the whole model at once. In mixed precision these are the fp32 masters, as the stock Trainer saves
        its fp32 weights under --bf16; else the parameters themselves. All ranks must call it."""
        self.finish_pending_update()
        return {name: w.clone() for part in self._weights_one_part_at_a_time(frozen=False) for name, w in part.items()}

    def save_weights(self, folder: str | os.PathLike, write: bool,
                     max_shard_size: int | str = export.SAVE_PRETRAINED_MAX_SHARD_SIZE) -> None:
        """The model's weights as save_pretrained writes them (model.safetensors, or shards and an index),
        gathered a part at a time (stage 3: a unit) and written as they arrive, so that no rank holds more
        than its shard and one unit. Every rank calls it; the one with `write` writes.
        In mixed precision the file holds fp32, as the stock Trainer's under --bf16 or --fp16 (its model stays
        fp32 under autocast): the trained parameters are their masters; frozen weights and floating buffers,
        which have none, are written from their compute-dtype values."""
        self.finish_pending_update()
        weights = export.weights_to_save(self.module)
        held = self.params.managed | self.params.frozen
        save_name = {id(t): name for name, t in weights.items()}
        mixed = self.dtype != torch.float32

        def saved_dtype(t: torch.Tensor) -> torch.dtype:
            return torch.float32 if mixed and t.is_floating_point() else t.dtype

        planned = {name: export.meta_like(held[id(t)].shape if id(t) in held else t.shape, saved_dtype(t))
                   for name, t in weights.items()}
        name_of_slice = {s.name: save_name[id(s.param)] for s in held.values() if id(s.param) in save_name}

        def arrivals() -> Iterator[dict[str, torch.Tensor]]:
            for part in self._weights_one_part_at_a_time(frozen=True):
                yield {name_of_slice[name]: w.to(saved_dtype(w)) for name, w in part.items() if name in name_of_slice}
            yield {name: t.to(saved_dtype(t)) for name, t in weights.items() if id(t) not in held}  # buffers, frozen

        error = export.write_as_they_arrive(folder, self.module, planned, arrivals(), write, max_shard_size)

        def raise_error() -> None:
            if error is not None:
                raise error

        self.comm.agree(raise_error, f"writing the weights to {folder}")

    # ---- checkpoints -------------------------------------------------------------------------
    def checkpoint_layout(self) -> checkpoint.ShardLayout:
        """How this engine partitions its model, for checkpoints (with tensor parallelism all ranks call it)."""
        return checkpoint.describe_layout(self.module, self.params.flats_by_group(), self.params.owned_ranges(),
                                          self.params.frozen_chunks(), self.zero_stage, self.config.dtype,
                                          self.world_comm.rank, self.tp_comm)

    def save_checkpoint(self, directory: str | os.PathLike, client_state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own partition (safetensors) and rank 0 a manifest; all ranks must call it.
        `client_state` (JSON: a scheduler's state, a data position) comes back from load_checkpoint. Frozen weights
        are recorded by the pretrained files they came from, or stored where they have none (or with
        checkpoint_frozen_weights "stored")."""
        self.finish_pending_update()
        training_state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                          "skipped_steps": self.skipped_steps, "loss_scaler": self.scaler.state_dict()}
        layout = self.checkpoint_layout()
        source = None
        if self.config.checkpoint_frozen_weights == "by_source" and layout.frozen:
            source = self.frozen_sources.find(self.module, layout, self.world_comm)
        return checkpoint.save(directory, layout, self.sharded_optimizer.backend, self.world_comm, self.module,
                               training_state, client_state, source)

    @torch.no_grad()
    def load_checkpoint(self, directory: str | os.PathLike, frozen_must_match: bool = False) -> dict[str, Any] | None:
        """Loads a checkpoint saved at any data-parallel size and stage (with tensor parallelism: the same
        tp size); returns its client_state. `frozen_must_match`: refuse it, changing nothing, unless the frozen
        weights it holds are the model's already (a peft adapter resuming on the base it was trained on)."""
        self.finish_pending_update()
        layout = self.checkpoint_layout()
        manifest, module_state = checkpoint.load(directory, layout, self.sharded_optimizer.backend, self.world_comm,
                                                 self.module, frozen_must_match)
        self.frozen_sources.forget()  # the frozen weights may now be the checkpoint's
        checkpoint.restore_module_state(layout, module_state)
        self.global_steps, self.micro_steps = manifest["global_steps"], manifest["micro_steps"]
        self._skipped_steps = manifest["skipped_steps"]
        self.scaler.load_state_dict(manifest["loss_scaler"])
        # The outcome of a step before the load is let go, not counted: the checkpoint brought the counters, and
        # training goes on from it as from a finite step.
        self.sharded_optimizer.settle()
        self._stop = None
        self.skipped_in_a_row, self._last_step_skipped, self._global_grad_norm = 0, False, None
        self.params.reset()
        self.zero_grad()
        return manifest["client_state"]

    # ---- accounting --------------------------------------------------------------------------
    def _update_state_bytes(self) -> None:
        unmanaged = sum(p.numel() * p.element_size() for p in self.module.parameters()
                        if id(p) not in self.params.managed and id(p) not in self.params.frozen)
        self.ledger.state_bytes = {
            "parameters": self.params.held_bytes() + unmanaged,
            "gradients": self.params.grads.held_bytes(),
            "optimizer_states": self.sharded_optimizer.held_bytes(),
            "buffers": sum(b.numel() * b.element_size() for b in self.module.buffers())
                       + self.params.grads.buffer_bytes(),
        }


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer,
               config: ZeroConfig | dict[str, Any] | str | None = None,
               group: torch.distributed.ProcessGroup | None = None, init_from: Any = None,
               mesh: DeviceMesh | None = None) -> ZeroEngine:
    """Partitions `model` and `optimizer` across the ranks of `group` (default: the whole world), or
    across the "dp" dimension of a ("dp", "tp") `mesh` whose "tp" dimension the model was made
    tensor-parallel over (hf_zero.runtime.tensor_parallel).
    A model built on the meta device is materialised shard by shard from `init_from` (stage 3):
    hf_zero.zero.construct.SeededInit(seed) or PretrainedWeights(folder)."""
    return ZeroEngine(model, optimizer, config, group, init_from, mesh)
