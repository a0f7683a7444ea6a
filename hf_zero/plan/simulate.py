"""One rank of a training job, simulated: the engine's own code (initialize, then two steps of forward, backward and
optimizer step) run as one rank of a world of any size, on one CPU, holding no memory.

- The world is torch's fake process group at the target size (`simulated_world`): this process is one rank of it,
  every collective returns at once, and the ledger counts what the rank sends over intra-node and inter-node links.
- Tensors are fake (torch's FakeTensorMode): they have sizes and no memory, so a 175B model fits in a few hundred
  MiB of host memory. A value the engine reads back from the device (the ranks' unused-parameter flags, the gradient
  norm) reads as 1: every parameter used, gradients finite.
- The device layer's timeline is the plan's (hf_zero.plan.timeline): host memory it hands out is the host's, the
  rest the device's, and every collective is recorded with its group.
- Memory is counted as tensors are made and freed (hf_zero.plan.memory), by kind, at the peak of the second step:
  the first creates the optimizer's states, which the second holds through its forward and backward, as every later
  step does.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from hf_zero.plan.memory import KINDS, PLACES, MemoryCount
from hf_zero.plan.models import build_model
from hf_zero.plan.timeline import PlanTimeline
from hf_zero.runtime.device import timeline_in_force
from hf_zero.runtime.memory import BYTES_PER_ELEMENT
from hf_zero.runtime.trace import watching_spans
from hf_zero.runtime.trusted import folder_problem, import_checked
from hf_zero.settings.environment import CHECK_COLLECTIVES_ENV


@dataclass(frozen=True)
class Job:
    """What is trained, on what: `nodes` x `gpus_per_node` ranks."""
    model: str  # a model_zoo name, a folder, or a Hub id in the local cache
    nodes: int = 1
    gpus_per_node: int = 8
    dtype: str = "bf16"
    seq_len: int = 1024
    gpu_memory: int = 80 * 10**9  # bytes per device
    # One sample's tensors as (name, shape without the batch dimension, dtype, values below): what the Trainer's
    # batches hold. Empty: a language model's input_ids and labels of seq_len tokens.
    sample: tuple[tuple[str, tuple[int, ...], str, int], ...] = ()
    adapter: str | None = None  # a folder holding a peft adapter's adapter_config.json, put around the model
    adapter_name: str = "default"  # the name peft gives it (its parameters' names hold it)
    frozen: tuple[str, ...] | None = None  # the parameters that do not train; None: as the class and adapter have it
    optimizer: str = "torch.optim.AdamW"  # its class by its module's name and its own (`optimizer_class`)
    optimizer_folder: str | None = None  # where its module is, if Python would not find it (beside a script)
    optimizer_kwargs: str = '{"lr": 0.0001}'  # its keyword arguments, as a JSON object
    engine_settings: str = "{}"  # the engine's other settings (ZeroConfig's names: bucket sizes, qwZ, ...), as JSON

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Setting:
    """How it is trained: the settings a plan chooses among (the engine's names)."""
    zero_stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    micro_batch: int = 1
    gradient_checkpointing: bool = False
    hpz_partition_size: int = 1

    def engine_config(self, job: Job) -> dict[str, Any]:
        # NVMe files go through the plan's files, which count their bytes and never touch the folder (it must only
        # exist, as the engine checks).
        nvme = {"nvme_path": tempfile.gettempdir()} if "nvme" in (self.offload_optimizer, self.offload_param) else {}
        return {**json.loads(job.engine_settings), "zero_stage": self.zero_stage, "dtype": job.dtype,
                "offload_optimizer": self.offload_optimizer, "offload_param": self.offload_param,
                "hpz_partition_size": self.hpz_partition_size, "ranks_per_node": job.gpus_per_node, **nvme}

    def __str__(self) -> str:
        parts = [f"stage {self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer on {self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"parameters on {self.offload_param}")
        if self.hpz_partition_size > 1:
            parts.append(f"hpZ {self.hpz_partition_size}")
        parts.append(f"micro-batch {self.micro_batch}")
        if self.gradient_checkpointing:
            parts.append("checkpointing")
        return ", ".join(parts)


@dataclass
class RankStep:
    """What one simulated rank held and sent in one training step."""
    rank: int
    device: dict[str, int]  # bytes by kind at the device's peak
    host: dict[str, int]  # bytes by kind at the host's peak
    at_rest: dict[str, dict[str, int]]  # by place, by kind: held after the step (gradients: at the end of backward)
    sent: dict[str, int]  # bytes this rank sent over its intra-node and inter-node links
    paper_volume: dict[str, int]  # elements by collective, as the ZeRO paper counts them (the ledger's)
    node_cross_volume: int  # this rank's part of its node's cross-node bytes, as the ZeRO++ paper counts them
    copied: dict[str, int]  # bytes copied between the device and the host ("to_device", "to_host")
    flops: int  # forward and backward, recomputation included
    params: int  # Ψ: the model's parameters
    collectives: list[tuple[str, str]] = field(default_factory=list)  # (group, what) in the order issued
    # The most each place held from building the model whole to the first step's end (a model built partitioned,
    # as stage 3 can, never holds it whole: hf_zero.zero.construct, the Trainer's --zero_init_partitioned).
    setup_peak: dict[str, int] = field(default_factory=dict)
    # The most device and host held at one moment, in the step and in the set-up: the peaks where the device's memory
    # is the host's (a CPU run); less than the two places' peaks added, which come at different moments.
    together_peak: int = 0
    setup_together_peak: int = 0
    nvme_file_bytes: int = 0  # what the rank's NVMe files take (ZeRO-Infinity)
    nvme_moved: int = 0  # bytes the step read from and wrote to them
    trained_params: int = 0  # the parameters that train (the optimizer steps)
    # What simulating it took of a core: the simulating thread's CPU time, which the machine's other work does not
    # lengthen as it lengthens the wall time.
    seconds: float = 0.0
    param_tensors: int = 0  # the model's parameter tensors, which a simulation's time grows with
    # A step at stages 0-2 of a model too large for the device whole, said from its count without running the engine
    # (`_whole_model_over_the_device`): nothing in it was measured.
    said_without_engine: bool = False
    step_collectives_from: int = 0  # collectives[step_collectives_from:] are the measured step's (`sent`)

    @property
    def device_peak(self) -> int:
        return sum(self.device.values())

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())

    def measured_peak(self, one_memory: bool) -> int:
        """What a run measured from before its model is built should see at most: the step's peak or the set-up's,
        on the device, or (`one_memory`: a CPU run) on device and host together."""
        if one_memory:
            return max(self.together_peak, self.setup_together_peak)
        return max(self.device_peak, self.setup_peak.get("device", 0))

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer states on the device between steps: what the paper's formulas count."""
        held = self.at_rest["device"]
        return held["parameters"] + held["gradients"] + held["optimizer_states"]

    @property
    def transient(self) -> int:
        """Activations and the backward's other temporaries at the device's peak: what grows with the micro-batch
        and what offloading model states cannot move."""
        return self.device["activations"] + self.device["other"]


class _FakeReads(FakeTensorMode):
    """Fake tensors whose values, read back by the host, are 1 (`.item()`, `.tolist()`): every parameter used on
    some rank, a finite gradient norm."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].is_floating_point() else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class _MemoryAndFlopCount(MemoryCount):
    """MemoryCount that also counts the FLOPs of what runs while `counting` (`_FlopsCounted`), as torch's
    FlopCounterMode does (its formulas, `flop_registry`; an op with a composite decomposition counted as its parts)
    without its count by module, whose hooks on each module's outputs keep them alive through backward: activations a
    checkpointed model frees (the set-up's peak of a checkpointed GPT-2 came out 1.6-1.9x its own,
    tests/plan/test_simulate.py). One dispatch mode, not two: torch's counter above this one took 13% of a 175B
    simulation."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.counting or func is torch.ops.prim.device.default:  # as torch's counter: not decomposed
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        if _decomposes(func):
            with self:
                return func.decompose(*args, **kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


@functools.cache
def _decomposes(func: torch._ops.OpOverload) -> bool:
    """Whether `func` has a composite decomposition (what OpOverload.decompose runs)."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    return key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)


class _FlopsCounted:
    """The FLOPs `count` counts of what runs inside, as torch's FlopCounterMode gives them (`get_total_flops`)."""

    def __init__(self, count: _MemoryAndFlopCount) -> None:
        self.count = count

    def __enter__(self) -> None:
        self.count.flops, self.count.counting = 0, True

    def __exit__(self, *exc: object) -> None:
        self.count.counting = False

    def get_total_flops(self) -> int:
        return self.count.flops


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int) -> Iterator[None]:
    """This process is rank `rank` of a fake process group of `world_size`. The cross-rank check of each collective
    is off: it exchanges hashes, which a fake group cannot. Each simulated rank records its whole sequence instead
    (RankStep.collectives), which tests/plan compares across all 16 ranks of 2 x 8."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("hf-zero plan simulates its own world: run it outside a process group")
    before = os.environ.get(CHECK_COLLECTIVES_ENV)
    os.environ[CHECK_COLLECTIVES_ENV] = "0"
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    sys.excepthook = hook  # torch's prefixes each traceback with the rank, once more for every simulated rank
    try:
        yield
    finally:
        dist.destroy_process_group()
        if before is None:
            os.environ.pop(CHECK_COLLECTIVES_ENV)
        else:
            os.environ[CHECK_COLLECTIVES_ENV] = before


@contextlib.contextmanager
def _forwards_counted(count: MemoryCount) -> Iterator[None]:
    """count.forward_depth follows the modules' forwards (a checkpoint's recomputation in backward included)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def entered(module: Any, args: Any) -> None:
        count.forward_depth += 1

    def left(module: Any, args: Any, output: Any) -> None:
        count.forward_depth -= 1

    handles = [register_module_forward_pre_hook(entered), register_module_forward_hook(left, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _gradient_counted(count: MemoryCount) -> Any:
    """A hook sorting a parameter's accumulated gradient as gradients (where the engine left one: stages 0-1)."""
    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            count.track(param.grad, "gradients")
    return hook


def optimizer_class(name: str, folder: str | None = None) -> type[torch.optim.Optimizer]:
    """The optimizer class `name`, its module's name and its own (torch.optim.SGD,
    transformers.optimization.Adafactor, lion_pytorch.Lion), imported where Python finds it, else from `folder` (a
    module beside a script). ValueError where it cannot be, where another account could change the code it would
    run, or where it is not an optimizer class."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute.isidentifier():
        raise ValueError(f"give the class with its module's name, as torch.optim.AdamW; got {name}")
    if folder is not None and folder not in sys.path:
        if problem := folder_problem(Path(folder)):
            raise ValueError(f"{problem}: the plan would import {module_name} from a place another account could "
                             f"change")
        sys.path.append(folder)  # after the installed packages: it adds modules, it replaces none
    found = getattr(import_checked(module_name), attribute, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"{name} is not an optimizer class (a subclass of torch.optim.Optimizer)")
    return found


def probe_optimizer(name: str, kwargs: str, folder: str | None = None) -> torch.optim.Optimizer:
    """Optimizer `name` (from `folder`, as `optimizer_class`) made with `kwargs` (a JSON object) over one parameter of
    one element: what the engine's checks look at is its class and settings. What its constructor raises where it
    cannot be made so."""
    return optimizer_class(name, folder)([torch.nn.Parameter(torch.zeros(1))], **json.loads(kwargs))


def _batch(job: Job, vocab: int, micro_batch: int) -> dict[str, torch.Tensor]:
    """`micro_batch` samples of `job.sample`'s shapes, integers drawn below each one's bound."""
    if not job.sample:
        ids = torch.randint(0, vocab, (micro_batch, job.seq_len))
        return {"input_ids": ids, "labels": ids}
    return {name: torch.randint(0, high, (micro_batch, *shape), dtype=getattr(torch, dtype))
            if not getattr(torch, dtype).is_floating_point else
            torch.randn((micro_batch, *shape), dtype=getattr(torch, dtype))
            for name, shape, dtype, high in job.sample}


def _loss(engine: Any, model: torch.nn.Module, job: Job, micro_batch: int) -> torch.Tensor:
    batch = _batch(job, model.config.get_text_config().vocab_size, micro_batch)
    try:
        out = engine(**batch)
    except TypeError:  # a model without a head takes no labels: train its last hidden state
        batch.pop("labels", None)
        out = engine(**batch)
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out[0].float().pow(2).mean()


def simulate_rank(job: Job, setting: Setting, rank: int, flops: int | None = None) -> RankStep:
    """Rank `rank` of `job` trained with `setting`: its memory at the second step's peak and what it sent then.
    `flops`: the step's, known from another simulation of the same model, micro-batch and checkpointing (the ZeRO
    setting does not change them), so not counted again."""
    count = _MemoryAndFlopCount()
    line = PlanTimeline(count, job.gpu_memory)
    start = time.thread_time()
    with warnings.catch_warnings():
        # The engine compares storages by address in places; a fake tensor's is 0, which only makes it skip copies.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        step = _simulate(job, setting, rank, count, line, flops)
    step.seconds = time.thread_time() - start
    return step


# (model, adapter, frozen, adapter_name) -> (parameters, trained parameters, parameter tensors): a model too large
# for stages 0-2 is built once for its count, not once a stage. Kept for the process's life: a folder whose config or
# adapter changes on disk meanwhile keeps its first count (model_config keeps the configs of the last 8 models read
# so too).
_PARAMETERS_COUNTED: dict[tuple, tuple[int, int, int]] = {}


def _whole_model_over_the_device(job: Job, setting: Setting, rank: int, params: int, trained: int,
                                 tensors: int) -> RankStep | None:
    """At stages 0-2, where every rank would hold the whole model in the compute dtype and that alone exceeds the
    device: the step said without running the engine, whose buckets, cut to the little memory left, would number
    in the millions. None otherwise."""
    whole = params * BYTES_PER_ELEMENT[job.dtype]
    if setting.zero_stage == 3 or whole <= job.gpu_memory:
        return None
    held = dict.fromkeys(KINDS, 0) | {"parameters": whole}
    return RankStep(rank, held, dict.fromkeys(KINDS, 0), {"device": held, "host": dict.fromkeys(KINDS, 0)},
                    {}, {}, 0, {}, 0, params, together_peak=whole, trained_params=trained, param_tensors=tensors,
                    said_without_engine=True)


def _simulate(job: Job, setting: Setting, rank: int, count: _MemoryAndFlopCount, line: PlanTimeline,
              known_flops: int | None) -> RankStep:
    from hf_zero.engine import initialize

    model_key = (job.model, job.adapter, job.frozen, job.adapter_name)
    if model_key in _PARAMETERS_COUNTED:
        over = _whole_model_over_the_device(job, setting, rank, *_PARAMETERS_COUNTED[model_key])
        if over is not None:
            return over
    with simulated_world(job.world_size, rank), _FakeReads(allow_non_fake_inputs=True), count, \
            timeline_in_force(line), watching_spans(count.span), _forwards_counted(count):
        model = build_model(*model_key, initialised=False)
        params = sum(p.numel() for p in model.parameters())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tensors = len(list(model.parameters()))
        _PARAMETERS_COUNTED[model_key] = params, trained, tensors
        over = _whole_model_over_the_device(job, setting, rank, params, trained, tensors)
        if over is not None:
            return over
        for p in model.parameters():
            count.track(p, "parameters")
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_gradient_counted(count))
        for b in model.buffers():
            count.track(b, "buffers")
        model.train()
        if setting.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        # As transformers' Trainer makes it: over the parameters that train.
        optimizer = optimizer_class(job.optimizer, job.optimizer_folder)(
            [p for p in model.parameters() if p.requires_grad], **json.loads(job.optimizer_kwargs))
        engine = initialize(model, optimizer, setting.engine_config(job))
        flops = _FlopsCounted(count) if known_flops is None else contextlib.nullcontext()
        for step in range(2):
            if step == 1:
                # building the model whole, set-up and the first step
                setup_peak, setup_together_peak = dict(count.peak_total), count.peak_together
                count.start_window()
                line.start_window()
            # FLOPs are counted in the first step: the second's are the same, and it runs as fast as it can.
            with flops if step == 0 else contextlib.nullcontext():
                engine.backward(_loss(engine, model, job, setting.micro_batch))
            gradients = {place: count.by_kind[place]["gradients"] for place in PLACES}
            engine.step()
        at_rest = {place: {**count.by_kind[place], "gradients": gradients[place]} for place in PLACES}
        ledger = engine.ledger
        return RankStep(rank, count.peak("device"), count.peak("host"), at_rest, dict(ledger.last_step_span_bytes),
                        dict(ledger.last_step_elements), ledger.last_step_paper_cross_node_bytes, dict(line.copied),
                        flops.get_total_flops() if known_flops is None else known_flops, params,
                        list(line.collectives), setup_peak, count.peak_together, setup_together_peak,
                        line.counted_files.held, line.counted_files.read + line.counted_files.written, trained,
                        step_collectives_from=line.window_collectives_from, param_tensors=tensors)
