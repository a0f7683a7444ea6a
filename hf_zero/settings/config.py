"""ZeroConfig: every engine setting in one typed place, validated before any work starts."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

if TYPE_CHECKING:
    import torch


class _TorchDtypes(Mapping):
    """The dtype names settings take -> torch's dtypes. torch is imported at the first lookup of a dtype, not with
    this module: `hf-zero run` checks its flags' names before importing torch (1 s), and these names are all that
    check needs."""

    _NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

    def __getitem__(self, name: str) -> torch.dtype:
        import torch

        return getattr(torch, self._NAMES[name])

    def __contains__(self, name: object) -> bool:
        return name in self._NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(self._NAMES)

    def __len__(self) -> int:
        return len(self._NAMES)


DTYPES = _TorchDtypes()
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
FROZEN_WEIGHTS_IN_CHECKPOINTS = ("by_source", "stored")
# torch.compile's modes (torch._inductor.list_mode_options); the CUDA-graph ones record each tensor's address.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


class ZeroConfigError(ValueError):
    """A setting has a value the engine cannot use; the message names the setting and what is allowed."""


def default_reduce_bucket_size(data_parallel_ranks: int) -> int:
    """At least 1M elements of each bucket per rank (2 MiB in bf16, where NCCL's ring is no longer
    latency-bound), never below the 5M that small worlds had, nor above DeepSpeed's 5e8 (two buckets in
    flight and one filling then hold 3 GiB in bf16)."""
    return min(500_000_000, max(5_000_000, 1_000_000 * data_parallel_ranks))


def setting(default: Any, help: str, deepspeed: str | None = None, choices: tuple | None = None,
            trainer_flag: str | None = None) -> Any:
    """A ZeroConfig field with what every front end says about it: `help` (without the default, which is
    added from the field), the DeepSpeed config key it replaces, the allowed values, and for the settings
    that the Trainer already has a flag for, that flag."""
    return field(default=default, metadata={"help": help, "deepspeed": deepspeed, "choices": choices,
                                            "trainer_flag": trainer_flag})


@dataclass
class ZeroConfig:
    """Settings of the ZeRO engine. Sizes are in elements, as in DeepSpeed's configuration. Each field is
    declared once, here: the Trainer's --zero_* flags (hf_zero/hf/flags.py), `hf-zero train`'s options and
    the README's flag table are made from these declarations."""

    zero_stage: int = setting(2, "0 plain data parallel, 1 partition optimizer states, 2 also gradients, "
                                 "3 also parameters", "zero_optimization.stage", (0, 1, 2, 3))
    dtype: str = setting("fp32", "compute dtype; the fp32 master weights stay on the shard", "bf16.enabled / "
                         "fp16.enabled", tuple(DTYPES), trainer_flag="--bf16/--fp16")
    # C_B: fixed-size gradient buckets, independent of model size (paper section 6.2). Left unset, the size
    # grows with the data-parallel world (`default_reduce_bucket_size`): a fixed 5M would cut each rank's piece
    # of a reduce-scatter to 5M/Nd elements, latency-bound across nodes, and 7B into 1,400 collectives.
    reduce_bucket_size: int | None = setting(None, "stages 0-2: gradient elements reduced per bucket (C_B); unset: "
                                             "max(5e6, 1e6 x data-parallel ranks), at most 5e8, and at most what "
                                             "three buckets (two reducing, one filling) may take of half the memory "
                                             "the rank has left", "zero_optimization.reduce_bucket_size")
    allgather_bucket_size: int | None = setting(None, "stages 1-2: parameter elements all-gathered at once after the "
                                                "step; unset: 5e7 (DeepSpeed's), at most half the memory the rank has "
                                                "left", "zero_optimization.allgather_bucket_size")
    # The compute dtype by default, as DeepSpeed's communication_data_type and FSDP2's reduce_dtype default
    # to, and as the paper's 2Ψ of traffic and 2Ψ/Nd of gradients per rank count it.
    reduce_dtype: str | None = setting(None, "dtype gradients are reduced in and, at stages 2-3, accumulated "
                                       "into this rank's gradient shard: fp32, or the compute dtype (default)",
                                       "communication_data_type", tuple(DTYPES))
    overlap_comm: bool = setting(True, "reduce gradient buckets while backward goes on",
                                 "zero_optimization.overlap_comm")
    # 0: the next unit only, as FSDP2 prefetches by default. Each unit in flight holds its gathered buffer
    # early (on the 311M workload 50M elements, four blocks, cost 90 MiB of peak for no speed here).
    prefetch_bucket_size: int = setting(0, "stage 3: parameter elements of upcoming units gathered ahead of use, "
                                        "beyond the next unit, which always is",
                                        "zero_optimization.stage3_prefetch_bucket_size")
    param_persistence_threshold: int = setting(0, "stage 3: parameters with fewer elements stay whole on every "
                                               "rank (DeepSpeed's default: 1e5)",
                                               "zero_optimization.stage3_param_persistence_threshold")
    # None uses the model's `_no_split_modules` (transformers' block classes) or else the children of its
    # ModuleLists.
    unit_module_classes: list[str] | None = setting(None, "stage 3: class names of the modules gathered and "
                                                    "freed as one unit (default: the model's blocks)")
    # Off by default: backward needs the root at once, so keeping it saves Ψ_root of all-gather per step
    # for no extra peak memory (FSDP2 does the same with its root).
    reshard_root_after_forward: bool = setting(False, "stage 3: free the root unit (embeddings, head) after "
                                               "forward and gather it again for backward, the paper's 3Ψ schedule")
    # Generation runs one forward per token, and an evaluation loop one per batch, on weights that do not change:
    # without this each gathers every unit again (stage 3's predict_with_generate at 2-4x stock's time on tiny
    # models). DeepSpeed's stage3_max_live_parameters is a fixed 1e9 elements, which holds a model that offloads
    # its parameters because it does not fit whole for the length of an evaluation. The name is the first use's.
    generation_max_live_parameters: int | None = setting(
        None, "stage 3: during model.generate() and the Trainer's evaluation and prediction loops, gathered units "
              "stay gathered after use, up to this many parameter elements in all, and are freed when the call or "
              "loop ends (0: free each unit after every forward, as in training). Unset: half the memory the rank "
              "has left (a GPU's free memory after the step's peak; on a CPU the host's available memory per local "
              "rank), and with offload_param no more than a training step holds gathered (the largest unit and "
              "prefetch_bucket_size)")
    # Off by default: what a trim gives back, the next step's activations take again through page faults (the
    # Quick-start job at stage 3: 0.78 -> 1.04 s/step); on where host memory is what limits the model.
    trim_host_heap: bool = setting(False, "stage 3: give the host heap that backward's freed activations leave "
                                          "back to the system at each unit's backward gather (malloc_trim): a "
                                          "lower peak RSS on CPU ranks, at the cost of page faults next step")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step",
                                               "gradient_accumulation_steps",
                                               trainer_flag="--gradient_accumulation_steps")
    gradient_clipping: float = setting(0.0, "global gradient norm clipping, 0 for none", "gradient_clipping",
                                       trainer_flag="--max_grad_norm")
    loss_scale: float = setting(0.0, "fp16: a static loss scale, 0 for dynamic", "fp16.loss_scale")
    initial_scale_power: int = setting(16, "fp16: the dynamic scale starts at 2**this", "fp16.initial_scale_power")
    loss_scale_window: int = setting(1000, "fp16: clean steps before the dynamic scale doubles",
                                     "fp16.loss_scale_window")
    min_loss_scale: float = setting(1.0, "fp16: the dynamic scale's floor", "fp16.min_loss_scale")
    max_skipped_steps_in_a_row: int = setting(10, "optimizer steps skipped in a row (gradients not finite) "
                                              "before training stops with an error; 0 never stops")
    # ZeRO-Offload / ZeRO-Infinity: where this rank's optimizer states and parameter shards live.
    offload_optimizer: str = setting("none", "stages 1-3: where optimizer states live",
                                     "zero_optimization.offload_optimizer.device", OFFLOAD_DEVICES)
    offload_param: str = setting("none", "stage 3: where parameter shards live (nvme needs offload_optimizer "
                                 "nvme)", "zero_optimization.offload_param.device", OFFLOAD_DEVICES)
    nvme_path: str | None = setting(None, "folder for nvme offload", "offload_*.nvme_path")
    nvme_tile_numel: int = setting(2_000_000, "nvme: elements per tile streamed through the pool of 3 host "
                                   "buffer sets (3 x 16 bytes per element at stages 2-3, +4 for parameters on "
                                   "nvme)")
    delayed_param_update: bool = setting(False, "ZeRO-Offload's one-step delayed update: overlap the CPU "
                                         "optimizer step with the next step (needs offload_optimizer)")
    # The paper: the first steps move the most, so they run undelayed.
    delayed_param_update_warmup: int = setting(10, "ordinary steps before the delayed update starts")
    # ZeRO-R: every transformer block checkpointed, its input checkpoint split across the tensor-parallel
    # group (P_a) and/or kept in host memory (P_a+cpu), in one contiguous buffer per step (M_D).
    # ZeRO++ (arXiv 2306.10209), under DeepSpeed's names.
    quantized_weights: bool = setting(False, "ZeRO++ qwZ, stage 3: units are all-gathered as block-quantized int8 "
                                      "with an fp32 scale per block and dequantized into the unit's buffer; the "
                                      "model computes forward and backward with those weights, the fp32 masters "
                                      "and the update stay exact", "zero_optimization.zero_quantized_weights")
    # Small blocks, because int4 gradients round to zero every element under absmax / 14 of their block: in
    # blocks of 2048 qgZ ended 300 steps of gpt2-demo 7.7% above plain stage 3's validation loss, in blocks of
    # 128 within 0.5% (docs/BENCHMARKS.md). The scales then cost 4/128 bytes an element, 3% of int8's bytes.
    quantization_block_size: int = setting(128, "ZeRO++: elements per quantization block (one fp32 scale each); "
                                           "an even number")
    hpz_partition_size: int = setting(1, "ZeRO++ hpZ, stage 3: after a unit's forward each rank keeps 1/N of it "
                                      "(a secondary partition over N consecutive ranks, within a node), so that "
                                      "its gathers until the optimizer step stay inside the node; 1 is off",
                                      "zero_optimization.zero_hpz_partition_size")
    quantized_gradients: bool = setting(False, "ZeRO++ qgZ, stage 3: gradients are reduced by a block-quantized "
                                        "all-to-all inside each node, then another across nodes, summed in fp32 "
                                        "between them, instead of one reduce-scatter (on one node: off, with a "
                                        "warning)",
                                        "zero_optimization.zero_quantized_gradients")
    quantized_gradients_bits: int = setting(4, "ZeRO++ qgZ: bits per gradient value sent", choices=(4, 8))
    # One machine can stand for several nodes (4 ranks as 2 nodes x 2) to count what would cross the network.
    ranks_per_node: int | None = setting(None, "ranks on each node, for the ledger's intra-node and inter-node "
                                         "bytes (default: torchrun's LOCAL_WORLD_SIZE); must divide the world size")
    partition_activations: bool = setting(False, "ZeRO-R P_a: split activation checkpoints across the tensor-"
                                          "parallel group", "activation_checkpointing.partition_activations")
    cpu_checkpointing: bool = setting(False, "ZeRO-R P_a+cpu: keep activation checkpoints in host memory",
                                      "activation_checkpointing.cpu_checkpointing")
    # Regional compilation, as torchtitan and accelerate compile: each block on its own, so that the engine's
    # gather, release and reduce hooks stay outside the compiled code and blocks of one class share one graph.
    compile: bool = setting(False, "compile each repeated block of the model with torch.compile (the stage-3 "
                                   "units, or the blocks stage 3 would cut), the engine's hooks outside the "
                                   "compiled code; a model without blocks is compiled whole",
                            "compile.enabled", trainer_flag="--torch_compile")
    compile_backend: str | None = setting(None, "torch.compile's backend (unset: inductor)", "compile.backend",
                                          trainer_flag="--torch_compile_backend")
    compile_mode: str | None = setting(None, "torch.compile's mode (inductor only): default, reduce-overhead, "
                                       "max-autotune or max-autotune-no-cudagraphs", "compile.kwargs.mode",
                                       COMPILE_MODES, trainer_flag="--torch_compile_mode")
    # A LoRA base is most of the model and never changes: a checkpoint need not hold it when its files say what it is.
    checkpoint_frozen_weights: str = setting("by_source", "checkpoints record frozen weights (a LoRA base) by the "
                                             "pretrained folder's (or Hub id's cached) files they were loaded from "
                                             "(sizes and SHA-256; a resume re-reads them and refuses a changed file), "
                                             "and store them where they have none (built from a config, changed in "
                                             "memory); stored: always store them (DeepSpeed: save_checkpoint's "
                                             "exclude_frozen_parameters)",
                                             choices=FROZEN_WEIGHTS_IN_CHECKPOINTS)

    @classmethod
    def from_any(cls, config: "ZeroConfig | dict[str, Any] | str | Path | None") -> "ZeroConfig":
        """Builds a validated config from a ZeroConfig, a dict, or a JSON file path."""
        if config is None:
            config = cls()
        elif isinstance(config, (str, Path)):
            config = read_settings_file(config, "config file")
        if isinstance(config, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - known)
            if unknown:
                raise ZeroConfigError(f"unknown ZeRO setting(s) {unknown}; known settings: {sorted(known)}")
            config = cls(**config)
        if not isinstance(config, cls):
            raise ZeroConfigError(f"config must be a ZeroConfig, a dict or a JSON path, not {type(config).__name__}")
        config.validate()
        return config

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def bucket_numel(self, data_parallel_ranks: int, memory_cap: int) -> int:
        """reduce_bucket_size, or when unset the size for this many ranks (`default_reduce_bucket_size`), three of
        which fit in `memory_cap` elements (`memory.budget_of_every_rank`)."""
        return self.reduce_bucket_size or max(1, min(default_reduce_bucket_size(data_parallel_ranks), memory_cap // 3))

    def allgather_numel(self, memory_cap: int) -> int:
        """allgather_bucket_size, or when unset DeepSpeed's 5e7 elements, at most `memory_cap`."""
        return self.allgather_bucket_size or max(1, min(50_000_000, memory_cap))

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype or self.dtype]

    def validate(self, name: Callable[[str], str] = str) -> None:
        """Raises ZeroConfigError on the first bad setting. `name(key)` is how a message names a setting:
        the key itself for engine configs, the command-line flag for ZeroTrainingArguments."""
        def fail(key: str, message: str) -> None:
            raise ZeroConfigError(f"{name(key)} {message}")

        self._validate_types(fail)
        if self.zero_stage not in (0, 1, 2, 3):
            fail("zero_stage", f"must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        if self.dtype not in DTYPES:
            fail("dtype", f"must be one of {sorted(DTYPES)}; got {self.dtype!r}")
        if self.reduce_dtype not in (None, "fp32", self.dtype):
            fail("reduce_dtype", f"must be fp32 or the compute dtype, {self.dtype} ({name('dtype')}); got "
                                 f"{self.reduce_dtype!r}")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "gradient_accumulation_steps",
                    "loss_scale_window", "nvme_tile_numel", "ranks_per_node"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                fail(key, f"must be a positive integer; got {value!r}")
        for key in ("prefetch_bucket_size", "param_persistence_threshold", "delayed_param_update_warmup",
                    "max_skipped_steps_in_a_row", "generation_max_live_parameters"):
            value = getattr(self, key)
            if value is not None and value < 0:
                fail(key, f"must be an integer >= 0; got {value!r}")
        for key in ("gradient_clipping", "loss_scale"):
            value = getattr(self, key)
            if value < 0:
                fail(key, f"must be a number >= 0 (0 turns it off); got {value!r}")
        if self.loss_scale > 0 and self.dtype != "fp16":
            fail("loss_scale", f"applies to fp16 only (bf16 and fp32 need no scaling); got "
                               f"{name('loss_scale')}={self.loss_scale} with {name('dtype')}={self.dtype!r}")
        if self.min_loss_scale <= 0:
            fail("min_loss_scale", f"must be > 0; got {self.min_loss_scale!r}")
        if not 0 <= self.initial_scale_power <= 64:
            fail("initial_scale_power", f"must be an integer in 0..64; got {self.initial_scale_power!r}")
        self._validate_offload(name, fail)
        if self.checkpoint_frozen_weights not in FROZEN_WEIGHTS_IN_CHECKPOINTS:
            fail("checkpoint_frozen_weights", f"must be one of {', '.join(FROZEN_WEIGHTS_IN_CHECKPOINTS)}; got "
                                              f"{self.checkpoint_frozen_weights!r}")
        if self.quantization_block_size <= 0 or self.quantization_block_size % 2:
            fail("quantization_block_size", f"must be a positive even integer (int4 packs two values a byte); got "
                                            f"{self.quantization_block_size!r}")
        for key, on, what in (
                ("quantized_weights", self.quantized_weights, "quantizes stage 3's parameter all-gathers (ZeRO++ qwZ)"),
                ("hpz_partition_size", self.hpz_partition_size > 1, "keeps a secondary partition of stage 3's "
                                                                    "parameters (ZeRO++ hpZ)"),
                ("quantized_gradients", self.quantized_gradients, "quantizes stage 3's gradient reduction (ZeRO++ "
                                                                  "qgZ)"),
                ("trim_host_heap", self.trim_host_heap, "gives back the heap stage 3's backward frees between "
                                                        "unit gathers")):
            if on and self.zero_stage != 3:
                fail(key, f"{what}, which stages 0-2 do not have; set {name('zero_stage')} 3 or drop {name(key)}")
        if self.hpz_partition_size < 1:
            fail("hpz_partition_size", f"must be a positive integer (1 is off); got {self.hpz_partition_size!r}")
        if self.quantized_gradients_bits not in (4, 8):
            fail("quantized_gradients_bits", f"must be 4 or 8; got {self.quantized_gradients_bits!r}")
        self._validate_compile(name, fail)
        if self.quantized_weights and self.offload_param != "none":
            fail("quantized_weights", f"with {name('offload_param')} {self.offload_param} is not supported yet; "
                                      f"drop one of them")

    def check_topology(self, world: int, per_node: int, name: Callable[[str], str] = str) -> None:
        """What needs the process layout: ranks fill nodes in order, and a secondary partition (hpZ) lies
        within a node. `per_node` is torchrun's LOCAL_WORLD_SIZE, which `ranks_per_node` overrides."""
        if self.ranks_per_node is not None and world % self.ranks_per_node:
            raise ZeroConfigError(f"{name('ranks_per_node')} must divide the world size {world} (ranks fill nodes "
                                  f"in order); got {self.ranks_per_node}")
        per_node = self.ranks_per_node or per_node
        if per_node % self.hpz_partition_size:
            raise ZeroConfigError(f"{name('hpz_partition_size')} must divide the ranks per node ({per_node}): a "
                                  f"secondary partition lies within one node; got {self.hpz_partition_size}")

    def _validate_types(self, fail: Callable[[str, str], None]) -> None:
        """Each value has its declared type exactly: a bool is no number (True is not 1), a float no integer
        (2.0 is no stage), and every number is finite (an infinite loss scale skips every step, a NaN one
        or a NaN clipping threshold would compare false everywhere and silently turn the feature off)."""
        for setting in described_settings():
            value, kind = getattr(self, setting.name), setting.type
            if value is None and kind.endswith("| None"):
                continue
            kind = kind.removesuffix(" | None")
            if kind.startswith("list[str]"):
                ok, wanted = isinstance(value, (list, tuple)) and all(isinstance(c, str) for c in value), \
                    "a list of module class names"
            elif kind.startswith("str"):
                ok, wanted = isinstance(value, str), "a string"
            elif kind == "bool":
                ok, wanted = type(value) is bool, "true or false"
            elif kind == "int":
                ok, wanted = type(value) is int, "an integer"
            else:
                ok, wanted = type(value) in (int, float) and math.isfinite(value), "a finite number"
            if not ok:
                choices = setting.metadata["choices"]
                fail(setting.name, f"must be {'one of ' + ', '.join(map(str, choices)) if choices else wanted}; "
                                   f"got {value!r}")

    def _validate_offload(self, name: Callable[[str], str], fail: Callable[[str, str], None]) -> None:
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                fail(key, f"must be one of {', '.join(OFFLOAD_DEVICES)}; got {getattr(self, key)!r}")
        conflict = offload_conflict(self.zero_stage, self.offload_optimizer, self.offload_param, name)
        if conflict:
            raise ZeroConfigError(conflict)
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_param)
        if uses_nvme and not self.nvme_path:
            fail("nvme_path", f"is required when {name('offload_optimizer')} or {name('offload_param')} is nvme")
        if self.nvme_path and not uses_nvme:
            fail("nvme_path", f"is set but nothing is offloaded to nvme; set {name('offload_optimizer')} "
                              f"or {name('offload_param')} to nvme, or drop {name('nvme_path')}")
        if self.nvme_path and uses_nvme:
            problem = nvme_path_problem(self.nvme_path)
            if problem:
                fail("nvme_path", problem)
        if self.delayed_param_update and self.offload_optimizer == "none":
            fail("delayed_param_update", f"overlaps the CPU optimizer step; it needs {name('offload_optimizer')} "
                                         f"cpu or nvme")

    def _validate_compile(self, name: Callable[[str], str], fail: Callable[[str, str], None]) -> None:
        """What needs no torch; the backend's name is checked against torch's registry where torch is imported
        (check_compile_backend)."""
        for key in ("compile_backend", "compile_mode"):
            if getattr(self, key) is not None and not self.compile:
                fail(key, f"is set but {name('compile')} is off; turn {name('compile')} on or drop {name(key)}")
        if self.compile_backend is not None and not self.compile_backend.strip():
            fail("compile_backend", "must name a torch.compile backend (inductor, aot_eager, eager, ...); got ''")
        if self.compile_mode is None:
            return
        if self.compile_mode not in COMPILE_MODES:
            fail("compile_mode", f"must be one of {', '.join(COMPILE_MODES)}; got {self.compile_mode!r}")
        if (self.compile_backend or "inductor") != "inductor":
            fail("compile_mode", f"is inductor's; {name('compile_backend')} {self.compile_backend} takes no mode. "
                                 f"Drop {name('compile_mode')} or use the inductor backend")
        if self.compile_mode in CUDA_GRAPH_COMPILE_MODES and self.zero_stage == 3:
            fail("compile_mode", f"{self.compile_mode} records CUDA graphs, which replay each tensor's address, "
                                 f"and stage 3 gathers every unit into new memory each step; use "
                                 f"max-autotune-no-cudagraphs or default")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_compile_backend(config: ZeroConfig, name: Callable[[str], str] = str) -> None:
    """The compile backend is one torch.compile knows (torch._dynamo's registry, its debugging backends included:
    eager, aot_eager); checked before any rank starts (`hf-zero run`, `hf-zero train`, the Trainer's arguments) and
    by the engine. torch is imported here only when compilation is on."""
    if not config.compile:
        return
    import torch._dynamo

    backend = config.compile_backend or "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ZeroConfigError(f"{name('compile_backend')} {backend!r} is not a torch.compile backend torch "
                              f"{torch.__version__} knows; known: {', '.join(sorted(known))}")


def read_settings_file(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object of settings in `path`; a missing, unreadable or malformed file is refused naming it
    (`what` says which option gave it)."""
    file = Path(path)
    if not file.is_file():
        raise ZeroConfigError(f"{what} {path}: no such file")
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ZeroConfigError(f"{what} {path} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ZeroConfigError(f"{what} {path} is not valid JSON: {error}") from None
    if not isinstance(settings, dict):
        raise ZeroConfigError(f"{what} {path} must hold a JSON object of engine settings")
    return settings


def nvme_path_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with an nvme_path, with what to do, or None: the folder must exist and be writable."""
    if not Path(path).is_dir():
        return f"{str(path)!r} does not exist or is not a folder; create it on the NVMe drive (e.g. mkdir -p {path})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{str(path)!r} is not writable by this process; fix its permissions or choose another folder"
    try:  # as root, access() says yes to folders the kernel still refuses (sysfs, some read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=".hf_zero_probe_", dir=path))
    except OSError as error:
        return f"{str(path)!r}: cannot create a folder in it ({error.strerror}); choose another folder"
    return None


def offload_conflict(zero_stage: int, offload_optimizer: str, offload_param: str,
                     name: Callable[[str], str] = str) -> str | None:
    """Why this offload cannot run at this stage, or None: the one rule the engine's settings, the
    Trainer flags and `hf-zero estimate` all apply. `name(key)` spells each setting in the message."""
    if offload_param != "none" and zero_stage != 3:
        return (f"{name('offload_param')} needs {name('zero_stage')} 3 (only stage 3 partitions parameters); "
                f"got {name('offload_param')} {offload_param} with {name('zero_stage')} {zero_stage}")
    if offload_optimizer != "none" and zero_stage == 0:
        return (f"{name('offload_optimizer')} needs {name('zero_stage')} 1, 2 or 3 (each rank offloads its own "
                f"partition); got {name('zero_stage')} 0")
    if offload_param == "nvme" and offload_optimizer != "nvme":
        # The parameters are written in the optimizer's NVMe tile stream, so that a step lands whole or not at all;
        # with the optimizer states in host memory (12 bytes per element) the parameters' 2-4 bytes on disk would save
        # little.
        return (f"{name('offload_param')} nvme needs {name('offload_optimizer')} nvme (the parameters are written in "
                f"the optimizer's NVMe stream); got {name('offload_optimizer')} {offload_optimizer}. Set both to "
                f"nvme, or {name('offload_param')} cpu")
    return None


def plan_conflict(tensor_parallel_size: int, flag: str) -> str | None:
    """Why the settings given beside an `auto` one (`flag`, as the front end spells it) cannot be planned, or None:
    the rule `hf-zero train` and the Trainer both apply. A plan covers data parallelism."""
    if tensor_parallel_size > 1:
        return (f"{flag} auto plans data parallelism; got --tensor_parallel_size {tensor_parallel_size}: give {flag} "
                f"a value, or drop --tensor_parallel_size")
    return None


def offloads_to_check(settings: dict[str, Any], planned: Iterable[str]) -> dict[str, str]:
    """For the offloads left to a plan, the value the other settings are checked at, and the one a plan on a CPU takes
    (there the device's memory is the host's: offloading frees nothing): none, or for the optimizer's where the
    parameters' is given, the same place (parameters on NVMe are written in the optimizer's NVMe stream; a plan
    offloads parameters to CPU memory with the optimizer)."""
    checked = {}
    if "offload_optimizer" in planned:
        checked["offload_optimizer"] = {"nvme": "nvme", "cpu": "cpu"}.get(settings.get("offload_param"), "none")
    if "offload_param" in planned:
        checked["offload_param"] = "none"
    return checked


def nvme_left_to_plan(settings: dict[str, Any], planned: Iterable[str], name: Callable[[str], str] = str
                      ) -> str | None:
    """The NVMe folder an offload left to `auto` may choose: nvme_path, where one is given and no offload given is
    NVMe already. It is checked now and taken out of `settings`, which are then checked without it; it goes back
    only if the plan offloads to NVMe."""
    path = settings.get("nvme_path")
    offloads = ("offload_optimizer", "offload_param")
    if not path or not set(offloads) & set(planned) or "nvme" in (settings.get(key) for key in offloads):
        return None
    problem = nvme_path_problem(path)
    if problem:
        raise ZeroConfigError(f"{name('nvme_path')} {problem}")
    return settings.pop("nvme_path")


def stages_allowed(settings: dict[str, Any], name: Callable[[str], str] = str) -> tuple[int, ...]:
    """The stages the other settings allow, for a plan of --zero_stage auto to choose among: hpZ, qwZ, qgZ and
    offloaded parameters need stage 3, an offloaded optimizer stages 1-3, a CUDA-graph compile mode stages 0-2."""
    allowed = []
    for stage in (0, 1, 2, 3):
        try:
            ZeroConfig(**(settings | {"zero_stage": stage})).validate(name=name)
        except ZeroConfigError:
            continue
        allowed.append(stage)
    return tuple(allowed)


def stage_to_check(allowed: tuple[int, ...]) -> int:
    """The stage the other settings are checked at before a plan chooses among `allowed`: the default stage where
    it is one of them (with none allowed, its error is the one the user sees)."""
    default = ZeroConfig.__dataclass_fields__["zero_stage"].default
    return default if default in allowed or not allowed else allowed[-1]


def to_check_before_a_plan(settings: dict[str, Any], planned: Iterable[str], name: Callable[[str], str] = str
                           ) -> tuple[str | None, tuple[int, ...]]:
    """Puts the settings left to a plan (`planned`) in `settings` at the values the other settings are checked at
    before it runs (the rule `hf-zero train` and the Trainer both apply): an offload at `offloads_to_check`'s, the
    stage at one the others allow, and the NVMe folder an offload may choose taken out (`nvme_left_to_plan`).
    Returns that folder, and the stages the plan may choose among."""
    for key in planned:
        settings.pop(key, None)
    settings |= offloads_to_check(settings, planned)
    nvme_folder = nvme_left_to_plan(settings, planned, name)
    stages = (0, 1, 2, 3)
    if "zero_stage" in planned:
        stages = stages_allowed(settings, name)
        settings["zero_stage"] = stage_to_check(stages)
    return nvme_folder, stages


def engine_settings_for_a_plan(settings: dict[str, Any]) -> dict[str, Any]:
    """The engine's settings a plan is given beside its own (`hf-zero plan --engine_settings`): those not
    SET_BY_THE_PLAN, where they are not the defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    return {key: value for key, value in settings.items() if key not in SET_BY_THE_PLAN and value != defaults[key]}


# What `auto` means for a PLANNED setting, in the flags' help and the README's table.
PLANNED_HELP = "the fastest setting that fits this machine, planned from the model and its longest batch"


def described_settings() -> list[dataclasses.Field]:
    """Every ZeroConfig field, in declaration order, with its metadata (help, deepspeed, choices, trainer_flag)."""
    return list(dataclasses.fields(ZeroConfig))


def help_of(setting: dataclasses.Field, default: Any = dataclasses.MISSING) -> str:
    """The help text of a setting with its default (or `default`, where a front end changes it) and the
    DeepSpeed key it replaces."""
    default = setting.default if default is dataclasses.MISSING else default
    shown = "" if default is None else f" (default {_show(default)})"
    key = f" [{setting.metadata['deepspeed']}]" if setting.metadata["deepspeed"] else ""
    return f"{setting.metadata['help']}{shown}{key}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= 1_000_000 and value % 1_000_000 == 0:
        return f"{value:.0e}".replace("e+0", "e")
    return str(value)


def add_arguments(parser: Any, names: list[str], defaults: dict[str, Any] | None = None,
                  planned: Iterable[str] = ()) -> None:
    """Adds `--NAME` options for these engine settings to an argparse parser, with their declared help,
    choices and defaults (`defaults` overrides some, for a front end whose workload needs other values). Those
    `planned` also take `auto`: the front end plans them for its machine (hf_zero.plan)."""
    by_name = {s.name: s for s in described_settings()}
    for name in names:
        s = by_name[name]
        default = (defaults or {}).get(name, s.default)
        if s.type == "bool":
            parser.add_argument(f"--{name}", action="store_true", default=default, help=help_of(s, default))
            continue
        kind = {"int": int, "float": float}.get(s.type.removesuffix(" | None"), str)
        choices = list(s.metadata["choices"]) if s.metadata["choices"] else None
        help_text = help_of(s, default)
        if name in planned:
            kind = _or_auto(kind)
            choices = None if choices is None else [*choices, AUTO]
            help_text += "; auto: the fastest setting that fits this machine, planned before the processes start"
        parser.add_argument(f"--{name}", type=kind, default=default, choices=choices, help=help_text)


AUTO = "auto"
# The settings `auto` leaves to a plan of the job on its machine (hf_zero.plan): `hf-zero train` plans them before
# its processes start, ZeroTrainer once it has the model and its data.
PLANNED = ("zero_stage", "offload_optimizer", "offload_param")
# The engine's settings a plan's simulated rank sets itself (from its job and the setting it tries), and so not among
# the other settings a plan is given (`hf-zero plan --engine_settings`); the compile settings neither: a plan runs
# the model eager.
SET_BY_THE_PLAN = ("zero_stage", "dtype", "offload_optimizer", "offload_param", "hpz_partition_size", "ranks_per_node",
                   "nvme_path", "compile", "compile_backend", "compile_mode")


def _or_auto(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(value: str) -> Any:
        return value if value == AUTO else kind(value)
    convert.__name__ = kind.__name__
    return convert


def did_you_mean(unknown: str, known: Iterable[str]) -> str:
    """"; did you mean --x?" for the known flag nearest a misspelt one, or "" when none is near."""
    near = difflib.get_close_matches(unknown, list(known), n=1, cutoff=0.8)
    return f"; did you mean {near[0]}?" if near else ""


def trainer_flag(name: str) -> str:
    """The Trainer flag that sets engine setting `name`: the Trainer's own where it has one, else --zero_*."""
    owned = ZeroConfig.__dataclass_fields__[name].metadata["trainer_flag"]
    return owned or (f"--{name}" if name.startswith("zero_") else f"--zero_{name}")


METAVARS = {"int": " N", "int | None": " N", "float": " N", "bool": "", "list[str] | None": " NAME [NAME ...]",
            "str | None": " DIR"}


def flag_rows() -> list[str]:
    """The README flag table's rows for the engine settings, from the declarations above."""
    rows = []
    for s in described_settings():
        owned = s.metadata["trainer_flag"]
        planned = [AUTO] if s.name in PLANNED else []
        value = " {" + ",".join(map(str, [*s.metadata["choices"], *planned])) + "}" if s.metadata["choices"] \
            else METAVARS[s.type]
        default = "the Trainer's" if owned else "" if s.default is None else _show(s.default)
        key = f"`{s.metadata['deepspeed']}`" if s.metadata["deepspeed"] else ""
        said = s.metadata["help"] + (f"; `auto`: {PLANNED_HELP} ([docs/plan.md](docs/plan.md))" if planned else "")
        rows.append(f"| `{owned or trainer_flag(s.name) + value}` | {default} | {key} | {said} |")
    return rows


def check_tp_within_a_node(tensor_parallel_size: int, processes_per_node: int, across_nodes: bool) -> None:
    """Refuses a tp group larger than a node's processes unless `across_nodes`: consecutive ranks form a group,
    so a larger one spans nodes, and its all-reduces in every layer cross the network."""
    if tensor_parallel_size > processes_per_node and not across_nodes:
        raise ZeroConfigError(
            f"--tensor_parallel_size {tensor_parallel_size} is larger than the {processes_per_node} processes per "
            f"node: a tensor-parallel group would span nodes and its all-reduces in every layer would cross the "
            f"network. Use at most {processes_per_node}, or pass --tensor_parallel_across_nodes if that is meant")
