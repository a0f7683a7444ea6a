"""ZeroEngine: forward, backward and step with the model states partitioned as `zero_stage` says.

The engine is built by the functions of setup.py, in their order. It leaves the stage's work to the stage's
parameter holder (hf_zero/zero/holder.py) and where the optimizer states live to the sharded optimizer and its
update backend (hf_zero/optim/), and never asks which stage or offload mode it runs (`zero_stage` is kept for its
callers and for checkpoints to record, never branched on). Checkpoints and weight exports are the checkpoint
layer's (hf_zero/checkpoint/), called with the engine's parts (`PartitionedModel`).

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

from hf_zero.checkpoint import weights
from hf_zero.checkpoint.export import SAVE_PRETRAINED_MAX_SHARD_SIZE
from hf_zero.checkpoint.frozen_source import FrozenSources
from hf_zero.checkpoint.layout import PartitionedModel, ShardLayout, layout_of
from hf_zero.checkpoint.read import load_partitioned
from hf_zero.checkpoint.write import save_partitioned
from hf_zero.engine.compile import compile_blocks
from hf_zero.engine.setup import (
    apply_activation_checkpointing,
    apply_optimizer,
    apply_partitioning,
    apply_precision,
    check_inputs,
    sync_module_states,
)
from hf_zero.optim.precision import LossScaler
from hf_zero.runtime.comm import Communicator, Ledger
from hf_zero.runtime.launch import destroy_process_group_at_exit
from hf_zero.runtime.trace import spanned
from hf_zero.settings.config import ZeroConfig
from hf_zero.settings.deepspeed_config import engine_config

logger = logging.getLogger("hf_zero")


class NonFiniteGradientsError(RuntimeError):
    """Too many optimizer steps in a row had gradients that were not finite (max_skipped_steps_in_a_row)."""


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
        self.eager_blocks = compile_blocks(model, cfg, self.activation_store) if cfg.compile else {}
        self._update_state_bytes()

    # ---- training ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    @spanned("backward")
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

    @spanned("step")
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
        self._collect_step_outcome()
        self._stop_if_skipping()

    def _stop_if_skipping(self) -> None:
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    def _collect_step_outcome(self) -> None:
        """Takes in the outcome of the last step the device decided, once its norm has reached the host."""
        outcome = self.sharded_optimizer.decided_step()
        if outcome is not None:
            self._count(*outcome)

    @property
    def global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last optimizer step."""
        self._collect_step_outcome()
        return self._global_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (gradients not finite)."""
        self._collect_step_outcome()
        return self._last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (gradients not finite)."""
        self._collect_step_outcome()
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
        refused_by = self.sharded_optimizer.untouched_refused_by
        if unused and refused_by is not None:
            names = sorted(self.params.managed[id(p)].name for p in unused)
            raise ValueError(f"no rank computed a gradient for {', '.join(names[:5])}"
                             f"{f' and {len(names) - 5} more' if len(names) > 5 else ''} in this step; torch's "
                             f"optimizers leave such parameters untouched, which {refused_by}"
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
        with self.params.units_kept_gathered():
            yield

    # ---- whole weights and checkpoints: the checkpoint layer's, given the engine's parts --------------
    def _partitioned(self) -> PartitionedModel:
        return PartitionedModel(self.module, self.params, self.sharded_optimizer.backend, self.comm, self.world_comm,
                                self.tp_comm, self.zero_stage, self.config.dtype)

    @torch.no_grad()
    def gathered_masters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's fp32 master weights, whole, on every rank (with tensor parallelism:
        this rank's local parts). For inspection and tests: it holds the model in fp32. All ranks must call it."""
        self.finish_pending_update()
        return weights.gathered_masters(self._partitioned())

    @torch.no_grad()
    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter whole on every rank, a unit at a time: what a PEFT adapter saves (a few MB),
        never the whole model at once. In mixed precision these are the fp32 masters, as the stock Trainer saves
        its fp32 weights under --bf16; else the parameters themselves. All ranks must call it."""
        self.finish_pending_update()
        return weights.trainable_weights(self._partitioned())

    def save_weights(self, folder: str | os.PathLike, write: bool,
                     max_shard_size: int | str = SAVE_PRETRAINED_MAX_SHARD_SIZE) -> None:
        """The model's weights as save_pretrained writes them (model.safetensors, or shards and an index),
        gathered a part at a time (stage 3: a unit) and written as they arrive, so that no rank holds more
        than its shard and one unit. Every rank calls it; the one with `write` writes.
        In mixed precision the file holds fp32, as the stock Trainer's under --bf16 or --fp16 (its model stays
        fp32 under autocast): the trained parameters are their masters; frozen weights and floating buffers,
        which have none, are written from their compute-dtype values."""
        self.finish_pending_update()
        weights.save_weights(self._partitioned(), folder, write, max_shard_size)

    def checkpoint_layout(self) -> ShardLayout:
        """How this engine partitions its model, for checkpoints (with tensor parallelism all ranks call it)."""
        return layout_of(self._partitioned())

    def save_checkpoint(self, directory: str | os.PathLike, client_state: dict[str, Any] | None = None) -> Path:
        """Every rank writes its own partition (safetensors) and rank 0 a manifest; all ranks must call it.
        `client_state` (JSON: a scheduler's state, a data position) comes back from load_checkpoint. Frozen weights
        are recorded by the pretrained files they came from, or stored where they have none (or with
        checkpoint_frozen_weights "stored")."""
        self.finish_pending_update()
        training_state = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                          "skipped_steps": self.skipped_steps, "loss_scaler": self.scaler.state_dict()}
        sources = self.frozen_sources if self.config.checkpoint_frozen_weights == "by_source" else None
        return save_partitioned(self._partitioned(), directory, training_state, client_state, sources)

    @torch.no_grad()
    def load_checkpoint(self, directory: str | os.PathLike, frozen_must_match: bool = False) -> dict[str, Any] | None:
        """Loads a checkpoint saved at any data-parallel size and stage (with tensor parallelism: the same
        tp size); returns its client_state. `frozen_must_match`: refuse it, changing nothing, unless the frozen
        weights it holds are the model's already (a peft adapter resuming on the base it was trained on)."""
        self.finish_pending_update()
        manifest = load_partitioned(self._partitioned(), directory, self.frozen_sources, frozen_must_match)
        self.global_steps, self.micro_steps = manifest["global_steps"], manifest["micro_steps"]
        self._skipped_steps = manifest["skipped_steps"]
        self.scaler.load_state_dict(manifest["loss_scaler"])
        # The outcome of a step before the load is let go, not counted: the checkpoint brought the counters, and
        # training goes on from it as from a finite step.
        self.sharded_optimizer.decided_step()
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
    A model built on the meta device is materialised from `init_from`, shard by shard at stage 3 and whole on
    every rank at stages 0-2: hf_zero.zero.construct.SeededInit(seed) or PretrainedWeights(folder)."""
    return ZeroEngine(model, optimizer, config, group, init_from, mesh)
