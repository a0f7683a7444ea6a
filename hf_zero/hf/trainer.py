"""ZeroTrainer: transformers' Trainer with the ZeRO engine in place of DDP.

The Trainer's own code keeps running (data, loss scaling for accumulation, schedulers, logging,
callbacks, evaluation); the engine takes over at these points, in the order a step meets them:

  create_optimizer      the Trainer builds its optimizer as usual (--optim, decay groups); the engine
                        then partitions the model and re-targets that optimizer at this rank's shard
  _wrap_model           training runs through the engine, never DDP; evaluation calls the model,
                        whose stage-3 hooks gather each unit on use
  accelerator.backward  becomes the engine's backward, told whether the accumulation window closes
  _clip_grad_norm       the engine's global norm (one all-reduce over the shards), left on the device until the
                        Trainer logs it; clipping to
                        --max_grad_norm happens inside the engine's step
  optimizer.step        the engine's step; lr schedulers act on the user optimizer's param groups
  parameter count       the Trainer's "Number of trainable parameters" counts stage-3 parameters whole, though
                        they are empty between uses (transformers reads DeepSpeed's ds_numel only)
  save_model            a normal transformers folder; at stage 3 gathered and written one unit at a time;
                        with tensor parallelism the whole tensors are gathered and the main process writes them
  checkpoints           each rank's optimizer shard and fp32 masters go to <checkpoint>/zero_checkpoint,
                        which resume_from_checkpoint and load_best_model_at_end load (any world size)

With --tensor_parallel_size N, __init__ builds the ("dp", "tp") mesh and makes the model's blocks
tensor-parallel before the optimizer exists, and the data loaders give every rank of a tp group the
same batches (accelerate's own rule for a mesh with a "tp" dimension). Evaluation and the count of
tokens seen keep one copy of each sample per tp group; resuming skips model.safetensors (whole
tensors) and takes every weight from the engine checkpoint.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import recursively_apply
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Seq2SeqTrainer, Trainer
from transformers import trainer as transformers_trainer
from transformers.trainer import (
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    _is_peft_model,
    logger,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_zero.checkpoint import (
    TRAINER_SUBFOLDER,
    CheckpointError,
    newest_complete,
    numbered_folders,
    read_json_object,
)
from hf_zero.engine import ZeroEngine, initialize
from hf_zero.hf import auto, pretrained
from hf_zero.hf.arguments import ZeroArgumentsMixin
from hf_zero.plan.planner import check_against_plan
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.groups import device_mesh
from hf_zero.runtime.memory import measured_peak, restart_peak, start_measuring
from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh
from hf_zero.settings.config import trainer_flag
from hf_zero.settings.environment import restarts_so_far
from hf_zero.zero.partition import local, wrap_like


def _counting_partitioned_params(count: Callable[..., int]) -> Callable[..., int]:
    """transformers' get_model_param_count (the Trainer logs "Number of trainable parameters" with it) counts
    `p.numel()`, and a stage-3 parameter is empty between uses: DeepSpeed's carry `ds_numel`, which it reads only
    under DeepSpeed. Each stage-3 parameter carries its whole size (Stage3Params), and what numel() misses is
    added."""

    @functools.wraps(count)
    def with_partitioned(model: nn.Module, trainable_only: bool = False) -> int:
        missing = sum(p.hf_zero_numel - p.numel() for p in model.parameters()
                      if hasattr(p, "hf_zero_numel") and (p.requires_grad or not trainable_only))
        return count(model, trainable_only) + missing

    return with_partitioned


transformers_trainer.get_model_param_count = _counting_partitioned_params(transformers_trainer.get_model_param_count)


class PlanCheck:
    """--zero_stage auto's check of a run against its plan (hf_zero.hf.auto): the second optimizer step's measured
    peak; and each batch longer than any the plan was made for (an iterable dataset's sample after those the plan
    read), said before its step runs, with that step's own peak checked after it."""

    def __init__(self, planned: auto.PlannedFor, device: torch.device, baseline: int, rank: int) -> None:
        self.planned, self.device, self.baseline, self.rank = planned, device, baseline, rank
        self.longest = planned.length
        self.longer_batch_step: int | None = None  # the step whose batch was longer than any before

    def start(self) -> None:
        """Training begins: a plan made in the Trainer's constructor (a model built partitioned) is not checked against
        what ran between then and now (an evaluation first)."""
        restart_peak(self.device)

    def before_step(self, inputs: dict[str, Any], step: int) -> None:
        """Sees each micro-batch of optimizer step `step` (counted from 1) before it runs."""
        tensor = inputs.get(self.planned.input_name)
        if self.longest is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 \
                or tensor.shape[1] <= self.longest:
            return
        self.longest = tensor.shape[1]
        if self.longer_batch_step != step:
            self.longer_batch_step = step
            restart_peak(self.device)  # this step's own peak, not an earlier one's (or an evaluation's)
        logger.warning(f"rank {self.rank}: step {step}'s batch has {self.planned.input_name} of length "
                       f"{tensor.shape[1]}, longer than the {self.planned.length} the plan was made for "
                       f"({self.planned.batch_of}); the step's peak is checked against the plan's after it")

    def after_step(self, step: int) -> None:
        """After optimizer step `step`: its peak against the plan's, at the second step and where its batch was
        longer than any before."""
        if step != 2 and step != self.longer_batch_step:
            return
        check_against_plan(self.planned.peak, measured_peak(self.device, self.baseline), self.rank, logger,
                           by_rss=self.device.type == "cpu", said_by_this_rank=step == self.longer_batch_step)


class ZeroOptimizer(AcceleratedOptimizer):
    """What the Trainer holds as its optimizer. param_groups are the user optimizer's (so schedulers
    set the learning rates the engine's shards are stepped with); step() and zero_grad() go to the engine."""

    # accelerate must not wrap it a second time (with its own GradScaler for fp16).
    _is_accelerate_prepared = True

    def __init__(self, engine: ZeroEngine, plan_check: PlanCheck | None = None) -> None:
        super().__init__(engine.optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self.plan_check = plan_check  # --zero_stage auto

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("ZeRO shards the optimizer step and cannot re-run a closure")
        self.engine.optimizer_step()
        # The Trainer asks at once whether the step was skipped (its lr schedule), which waits for the step's norm
        # anyway: max_skipped_steps_in_a_row stops here, every rank alike, not at the next step (or never, at the
        # last).
        self.engine.check_skipped_steps()
        if self.plan_check is not None:
            self.plan_check.after_step(self.engine.global_steps)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        self.engine.zero_grad()

    @property
    def step_was_skipped(self) -> bool:
        """True after a step whose gradients were not finite (an fp16 overflow, a NaN loss); the Trainer then leaves
        the lr schedule where it is. Where the device decided the step, asking waits for its norm's copy."""
        return self.engine.last_step_skipped


def _loss_reads_num_items(model: nn.Module) -> bool:
    """Whether the model's loss reads the num_items_in_batch the Trainer passes through **kwargs: a model that
    says so (accepts_loss_kwargs), or whose forward hands its kwargs to transformers' loss_function or names
    num_items_in_batch. BERT's and T5's heads (transformers 5.24) compute their own mean and drop it."""
    from transformers.trainer import unwrap_peft_model

    inner = unwrap_peft_model(model)
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    try:
        source = inspect.getsource(type(inner).forward)
    except (OSError, TypeError):  # no source to read: trust the Trainer's own judgement
        return True
    return "loss_function" in source or "num_items_in_batch" in source


def last_complete_checkpoint(output_dir: str, save_only_model: bool = False) -> str:
    """The newest checkpoint-N the Trainer finished writing. transformers takes the highest N, which after a
    crash in the middle of a save is a folder that cannot be resumed while the one before it can. The
    trainer state is written last; without --save_only_model the engine checkpoint must be complete too."""
    complete, interrupted = _checkpoint_folders(output_dir, save_only_model)
    for folder in interrupted:
        logger.warning(f"{folder} is incomplete (a save was interrupted); resuming from an earlier checkpoint")
    if complete is None:
        raise ValueError(f"no complete checkpoint in {output_dir} to resume from")
    return str(complete)


def _checkpoint_folders(output_dir: str, save_only_model: bool) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint-N folder in `output_dir` (None: none), and the newer ones a save left
    incomplete."""
    interrupted = []
    for folder in reversed(numbered_folders(output_dir, PREFIX_CHECKPOINT_DIR)):
        if (folder / TRAINER_STATE_NAME).is_file() and (
                save_only_model or newest_complete(folder / TRAINER_SUBFOLDER) is not None):
            return folder, interrupted
        interrupted.append(folder)
    return None, interrupted


def checkpoint_to_restart_from(output_dir: str, save_only_model: bool, removes: bool) -> str | None:
    """After torchrun started the ranks again (--max_restarts): the newest complete checkpoint in `output_dir`, as
    torchtitan loads its newest at start (None: none was finished, the run starts over). The checkpoint folders after
    it, which a rank died writing, are removed where `removes` (one process): the run writes them again, and a save
    into a folder of another save's files is refused."""
    complete, interrupted = _checkpoint_folders(output_dir, save_only_model)
    if removes:
        for folder in interrupted:
            logger.warning(f"restart {restarts_so_far()}: removing {folder}, which a save left incomplete when a rank "
                           f"died")
            with contextlib.suppress(FileNotFoundError):  # under save_on_each_node another node's may have gone first
                shutil.rmtree(folder)
        logger.warning(f"restart {restarts_so_far()} (torchrun --max-restarts): "
                       + (f"resuming from {complete}, the newest complete checkpoint in {output_dir}"
                          if complete is not None else
                          f"no complete checkpoint in {output_dir}; training from the start"))
    return None if complete is None else str(complete)


# What an adapter's weights mean, in peft's configs: a resume whose adapter differs in any of these would load weights
# of other shapes (a traceback per rank from peft), or silently scale or place them otherwise (lora_alpha).
ADAPTER_IDENTITY = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "exclude_modules",
                    "bias", "fan_in_fan_out", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
                    "modules_to_save", "num_virtual_tokens", "token_dim", "num_transformer_submodules")


def check_adapter_matches(model: nn.Module, checkpoint_folder: Path) -> None:
    """Refuses, before anything loads, to resume a peft model whose adapter is not the one the checkpoint's
    adapter_config.json describes, naming the setting that differs."""
    if not _is_peft_model(model):
        return
    saved_path = next((p for p in (checkpoint_folder / "adapter_config.json",
                                   checkpoint_folder / TRAINER_SUBFOLDER / "adapter_config.json") if p.is_file()), None)
    if saved_path is None:
        return
    saved = read_json_object(saved_path)
    current = model.peft_config[model.active_adapter].to_dict()

    def comparable(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        return sorted(value) if isinstance(value, (set, list, tuple)) else value

    for key in ADAPTER_IDENTITY:
        if key in saved and key in current and comparable(saved[key]) != comparable(current[key]):
            raise CheckpointError(f"{saved_path} was saved with {key} {comparable(saved[key])!r}, and this model's "
                                  f"adapter has {key} {comparable(current[key])!r}: build the adapter as it was "
                                  f"trained, or start a new run instead of resuming")


class ZeroTrainerMixin:
    """The overrides shared by ZeroTrainer and ZeroSeq2SeqTrainer."""

    engine: ZeroEngine | None = None
    built_partitioned = False  # the engine filled the model's stage-3 shards itself (hf_zero.hf.pretrained)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, ZeroArgumentsMixin):
            raise TypeError(f"{type(self).__name__} needs its arguments as training_args.ZeroTrainingArguments "
                            f"(or ZeroSeq2SeqTrainingArguments), not {type(self.args).__name__}")
        if self.args.n_gpu > 1:
            raise ValueError(f"this process sees {self.args.n_gpu} GPUs; ZeRO runs one process per device: "
                             f"hf-zero run --nproc_per_node {self.args.n_gpu} SCRIPT.py ..., or torchrun")
        if self.args.zero_planned:
            auto.check_model(self.model, trainer_flag(self.args.zero_planned[0]))
        self.mesh = None
        if self.args.tensor_parallel_size > 1:
            self.mesh = init_mesh(self.args.tensor_parallel_size, self.args.tensor_parallel_across_nodes)
            apply_tensor_parallel(self.model, self.mesh["tp"])
            # accelerate feeds ranks of one tp group the same batches when its mesh has a "tp" dimension
            # and counts data-parallel ranks under "dp_replicate"; this is the same layout named so.
            data_mesh = device_mesh(self.mesh.device_type, tuple(self.mesh.shape), ("dp_replicate", "tp"))
            self.accelerator._prepare_device_mesh = lambda: data_mesh
            # accelerate gathers from every process: evaluation and the token count keep one copy per
            # tp group. (compute_loss's num_items_in_batch scaling expects every copy; it stays as it is.)
            gather_for_metrics = self.accelerator.gather_for_metrics
            self.accelerator.gather_for_metrics = self._once_per_tp_group(gather_for_metrics)
            self.gather_function = self.accelerator.gather_for_metrics  # the Trainer took the original
        self.loss_ignores_num_items = self.model_accepts_loss_kwargs and not _loss_reads_num_items(self.model)
        if self.loss_ignores_num_items and self.args.should_log:
            logger.warning(f"{type(self.model).__name__}'s forward takes **kwargs but its loss does not read "
                           f"num_items_in_batch: hf_zero weighs each rank's mean loss by its share of the global "
                           f"batch's items, so that loss and gradients are one process's on the global batch. The "
                           f"stock Trainer multiplies that mean loss by the number of processes instead (transformers "
                           f"5.24), and with gradient accumulation sums the micro-batches' losses")
        if pretrained.init_source(self.model) is not None:
            # Built partitioned (hf_zero.hf.pretrained): the model has no values until the engine reads this rank's
            # shards, so the engine starts now, and evaluation or generation before training work too.
            self.create_optimizer()

    @property
    def plan_check(self) -> PlanCheck | None:
        """--zero_stage auto's check of the run against its plan, once the engine has started (else None)."""
        return getattr(self.optimizer, "plan_check", None)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # evaluate() and predict() run every batch's forward (and generate()) on weights that do not change: at stage
        # 3 each forward would gather every unit again.
        with self.engine.units_kept_gathered() if self.engine is not None else contextlib.nullcontext():
            return super().evaluation_loop(*args, **kwargs)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if pretrained.init_source(model) is None:  # a partitioned model is placed by the engine, shard by shard
            super()._move_model_to_device(model, device)

    def _once_per_tp_group(self, gathering: Callable[..., Any]) -> Callable[..., Any]:
        """`gathering` with accelerate's gather keeping one copy per tp group: the ranks of a tp group
        saw the same batch, so predictions, metrics and token counts would hold each sample tp times.
        Inside gather_for_metrics this happens before the last batch's padding is dropped."""
        tp, world = self.mesh["tp"].size(), self.mesh.size()

        def tp_rank_0_parts(gathered: torch.Tensor) -> torch.Tensor:  # tp groups are consecutive ranks
            rest = gathered.shape[1:]
            return gathered.reshape(world, -1, *rest)[::tp].reshape(-1, *rest)

        def gather_once(*args: Any, **kwargs: Any) -> Any:
            gather_every_copy = self.accelerator.gather
            self.accelerator.gather = lambda data: recursively_apply(tp_rank_0_parts, gather_every_copy(data))
            try:
                return gathering(*args, **kwargs)
            finally:
                self.accelerator.gather = gather_every_copy

        return gather_once

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir, self.args.save_only_model)
        elif resume_from_checkpoint is None and restarts_so_far() > 0:  # unless the script named a checkpoint
            resume_from_checkpoint = checkpoint_to_restart_from(self.args.output_dir, self.args.save_only_model,
                                                                removes=self.args.should_save)
        if self.plan_check is not None:
            self.plan_check.start()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # --torch_compile is the engine's (it compiles each block, hf_zero/engine/compile.py): accelerate must not
        # compile the whole model around it, as it would for an evaluation before the engine exists.
        from accelerate.utils import TorchDynamoPlugin

        return {**super()._build_accelerator_args(**kwargs), "dynamo_plugin": TorchDynamoPlugin(backend="no")}

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # training_step ends in accelerator.backward(loss). Routing that one call to the engine keeps
        # the Trainer's own loss scaling (num_items_in_batch, a short last window) exactly as it is.
        self.accelerator.backward = self._engine_backward

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.engine.backward(loss, last_micro_batch=self.accelerator.sync_gradients)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is None or self.optimizer is None:
            deepspeed = self.args.zero_deepspeed
            if deepspeed is not None:
                self.args.zero_engine_config = deepspeed.sized_for(self.args.zero_engine_config, self.model)
                if deepspeed.optimizer is not None and self.optimizer is None:
                    self.optimizer = deepspeed.optimizer.build(self.model)
            optimizer = super().create_optimizer(model)
            plan_check = self._plan_auto_settings() if self.args.zero_planned else None
            source = pretrained.init_source(self.model)
            self.engine = initialize(self.model, optimizer, self.args.zero_engine_config, mesh=self.mesh,
                                     init_from=source)
            # Built on meta, the model was filled by the engine: in shards at stage 3, whole at stages 0-2 (the
            # stage --zero_stage auto chose), which then holds it as a model built whole.
            filled = pretrained.forget(self.model)
            self.built_partitioned = filled and self.engine.zero_stage == 3
            pretrained.end(self.args)
            if filled:
                built = "partitioned" if self.built_partitioned else f"whole (stage {self.engine.zero_stage})"
                logger.info(f"rank {self.engine.comm.rank} built the model {built}: {pretrained.describe(source)}")
            self.optimizer = ZeroOptimizer(self.engine, plan_check)
            # The engine has placed the model and owns its parameters' storage; accelerate's
            # prepare_model (run by evaluate) would otherwise call model.to(device), which copies
            # parameters out of the engine's buffers when the device is spelled differently (cpu:0).
            self.model._is_accelerate_prepared = True
        return self.optimizer

    def _plan_auto_settings(self) -> PlanCheck | None:
        """Puts the plan's choice for the `auto` settings in the engine's configuration; returns the check of the run
        against the plan, its peaks measured from now (above what this process held apart from the model, which the
        plan counts), or None where memory cannot be measured."""
        self.args.zero_engine_config, planned = auto.planned_config(self)
        device = compute_device()
        try:
            baseline = start_measuring(device) - auto.model_bytes(self.model, device)
        except (OSError, RuntimeError) as error:  # no /proc to measure a CPU rank's memory by (not Linux)
            logger.warning(f"the step's memory cannot be measured here, so it is not checked against the plan: {error}")
            return None
        return PlanCheck(planned, device, baseline, self.args.process_index)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        if self.plan_check is not None:
            self.plan_check.before_step(inputs, self.state.global_step + 1)
        return super().training_step(model, inputs, num_items_in_batch)

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> torch.optim.lr_scheduler.LRScheduler:
        deepspeed = self.args.zero_deepspeed
        if self.lr_scheduler is None and deepspeed is not None and deepspeed.scheduler is not None:
            self.lr_scheduler = deepspeed.scheduler.build(optimizer or self.optimizer, num_training_steps,
                                                          self.args.get_warmup_steps(num_training_steps))
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """At every logging step (--logging_steps; the logs that carry the training "loss") the logs also get what
        this rank holds and sent over its links in the last step, as zero/held_bytes/* and zero/sent_bytes/* scalars
        that --report_to's integrations record beside the loss; with --log_level info the same figures are said in
        a line (--log_level_replica info for the other ranks). Evaluation and the end of training describe no
        step, and log none of it."""
        training_step = "loss" in logs and self.engine is not None and self.engine.global_steps > 0
        if training_step:
            logs.update(self.engine.ledger.scalars())
        super().log(logs, start_time)
        if training_step:
            logger.info(self.engine.ledger.report(self.engine.comm.rank))

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if training:
            # Where stock has accelerate prepare the model for training. The engine placed it (create_optimizer marked
            # it prepared, so accelerate only records it): an evaluation after training then measures no preparation
            # and logs no eval_model_preparation_time, as under stock, which logs it for an evaluation before training.
            self.accelerator.prepare_model(self.model)
            return self.engine
        return self.model

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        # The engine's forward is the model's; handing the model itself to the Trainer lets it
        # recognise the model class (label smoothing treats causal LMs differently).
        model = self.model if model is self.engine else model
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if (num_items_in_batch is None or not self.loss_ignores_num_items or self.label_smoother is not None
                or self.compute_loss_func is not None or "labels" not in inputs):
            return result
        # The model's loss is the mean over this micro-batch's items, where the Trainer expects their sum over
        # the items of the whole batch (all ranks, the accumulation window): weigh it by this micro-batch's share,
        # counted as the Trainer counts num_items_in_batch.
        labels = inputs.get("shift_labels", inputs["labels"][..., 1:] if self._loss_shifts_labels else inputs["labels"])
        share = labels.ne(-100).sum() / num_items_in_batch
        return (result[0] * share, result[1]) if return_outputs else result * share

    # The norm stays on the device: the Trainer reads it (.item()) only when it logs, so a step does not wait for it.
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.engine.grad_norm_on_device()

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        return self.engine.grad_norm_on_device() if grad_norm is None else grad_norm

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Every rank writes its own shard of the optimizer state (and fp32 masters) beside the
        # consolidated weights save_model wrote; rank 0 alone would hold only its 1/Nd.
        self.engine.save_checkpoint(os.path.join(output_dir, TRAINER_SUBFOLDER))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        check_adapter_matches(self.model, Path(resume_from_checkpoint))
        # The engine checkpoint loaded next holds every weight. With tensor parallelism the model's parameters
        # are DTensors, which the whole tensors of model.safetensors cannot be copied into; a model built
        # partitioned holds its shards in the engine already.
        if self.built_partitioned and self.args.save_only_model:
            raise ValueError(f"{resume_from_checkpoint} holds whole weights only (--save_only_model), and this model "
                             f"was built partitioned: resume with --zero_init_partitioned false, or save "
                             f"checkpoints without --save_only_model (the engine checkpoint holds every shard)")
        if self.mesh is None and not self.built_partitioned:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        if self.mesh is None:
            return super()._track_num_input_tokens(inputs)
        return self._once_per_tp_group(super()._track_num_input_tokens)(inputs)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        # A peft adapter resumes on the base the script built, as under stock, which must be the one it was trained on.
        self.engine.load_checkpoint(os.path.join(checkpoint, TRAINER_SUBFOLDER),
                                    frozen_must_match=_is_peft_model(self.model))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        logger.info(f"Loading the best model from {self.state.best_model_checkpoint} (score: {self.state.best_metric})")
        self.engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint, TRAINER_SUBFOLDER))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Writes a transformers folder (config, safetensors, tokenizer) that from_pretrained loads.
        At stage 3 the ranks gather one unit at a time and the main process writes it as it arrives,
        so no rank holds more than its shard and one unit."""
        if self.engine is not None:
            self.engine.finish_pending_update()  # delayed_param_update: the model gets the last update first
        if self.mesh is not None:
            return self._save_tensor_parallel_model(output_dir, _internal_call)
        if self.engine is None or (self.engine.params.holds_whole_params and self.engine.dtype == torch.float32):
            return super().save_model(output_dir, _internal_call)  # every rank holds the whole weights as trained
        # Stage 3 gathers a unit at a time; mixed precision writes the fp32 masters, as stock writes its fp32 model.
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if _is_peft_model(self.model):
            # A PEFT model saves its adapter, as under stock: peft picks it from the trainable weights (an empty
            # state dict, as for the whole model below, would write an adapter of no tensors).
            adapter = self.engine.trainable_weights()
            # A prompt-learning adapter (prompt tuning, p-tuning) is what peft's prompt encoder computes, so the
            # encoder is gathered while peft saves.
            prompt_encoder = list(getattr(self.model, "prompt_encoder", nn.ModuleDict()).parameters())
            with self.engine.gathered_parameters(only=prompt_encoder) if prompt_encoder else contextlib.nullcontext():
                if self.args.should_save:
                    self._save(output_dir, state_dict=adapter)
        else:
            if self.args.should_save:
                # Config, generation config, tokenizer, training arguments; the weights follow. The empty
                # state dict is what the Trainer passes for DeepSpeed's ZeRO-3 too.
                self._save(output_dir, state_dict={})
            self.engine.save_weights(output_dir, write=self.args.should_save)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


    def _save_tensor_parallel_model(self, output_dir: str | None, _internal_call: bool) -> None:
        """Every rank joins in gathering each DTensor whole; the main process writes the state dict. In mixed
        precision it is what the stock Trainer's fp32 model under --bf16 holds: the trained parameters from their
        fp32 masters, the rest in fp32."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        masters = self.engine.gathered_masters() if self.engine.dtype != torch.float32 else None
        managed = self.engine.params.managed

        def whole(tensor: torch.Tensor) -> torch.Tensor:
            if masters is not None and id(tensor) in managed:  # this rank's part of the master, as the DTensor's
                tensor = wrap_like(tensor, masters[managed[id(tensor)].name].to(local(tensor).device))
            elif masters is not None and tensor.is_floating_point():
                tensor = tensor.float()
            tensor = tensor.detach()
            return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

        with self.engine.gathered_parameters():
            state_dict = {name: whole(tensor) for name, tensor in self.model.state_dict(keep_vars=True).items()}
            # Written inside: at stage 3 the replicated tensors are views of gathered units, freed on exit.
            if self.args.should_save:
                self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """transformers.Trainer trained by the ZeRO engine; build it with training_args.ZeroTrainingArguments."""


class ZeroSeq2SeqTrainer(ZeroTrainerMixin, Seq2SeqTrainer):
    """transformers.Seq2SeqTrainer trained by the ZeRO engine; use ZeroSeq2SeqTrainingArguments."""

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **gen_kwargs: Any) -> Any:
        # At stage 3 a forward may gather parameters from every rank, so a rank whose sequences are finished must
        # keep stepping until all are (generate's synced_gpus, an all-reduce per token), unless generate() keeps
        # every unit gathered after its first use: then only the first forward gathers, on every rank alike.
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", {}))
        # The holder knows; before the engine exists, the configured stage says whether forwards will gather.
        gen_kwargs.setdefault("synced_gpus", self.args.world_size > 1 and (
            self.args.zero_engine_config.zero_stage == 3 if self.engine is None
            else not self.engine.params.keeps_every_unit()))
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
