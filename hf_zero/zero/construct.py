"""Construction from `init_from` of a model built on meta: at stage 3 each rank materialises only its own shard.

    with torch.device("meta"):
        model = model_zoo.build("gpt2-large")              # no memory: shapes only
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3},
                                init_from=SeededInit(seed=0))         # or PretrainedWeights("folder")

The engine cuts the model into its stage-3 units, then, one unit at a time, gives the unit's flat
buffer memory, asks `init_from` to fill it, keeps this rank's chunk and frees the rest. Peak memory is
this rank's shard plus one unit, never the model.

- `SeededInit` runs the model's own `_init_weights` (transformers' initialisation, with its
  distributions and GPT-2's scaled residual projections) module by module in the order transformers
  applies it (children first), each module drawing from a generator seeded by (seed, module name). So
  the values do not depend on how the model is cut or on the world size, and `build_seeded` on a
  whole model in one process gives the same.
- `PretrainedWeights` reads from a folder `save_pretrained` wrote: for each unit only the slices of the
  safetensors files this rank owns (`get_slice` reads without loading the file), whole tensors only for
  the small persistent parameters and what the engine does not partition (buffers, frozen tp parts).

At stages 0-2 every rank holds the whole model, so `init_from` fills it whole (`fill_whole`): one parameter at a
time, each a unit that every rank reads whole, as stage 3's persistent one. That is how `--zero_stage auto` starts from
a model built partitioned whichever stage its plan chooses.

Another `init_from` has their two methods: `fill_rest(model)`, and `fill(model, units, open_unit, close_unit, rank)`,
which opens, fills and closes every unit once. A unit it never closes has no values: the engine refuses it by name
(`refuse_unfilled`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.runtime.device import HOST, compute_device, host_memory_empty, in_host_memory, to_device
from hf_zero.runtime.dtypes import TORCH_DTYPES
from hf_zero.runtime.tensor_parallel import local_ranges
from hf_zero.zero.partition import (
    FlatParamBuffer,
    copy_cut_into,
    is_tp_replicated,
    local,
    partitioned_frozen,
    set_data,
    wrap_like,
)


class FilledUnit(Protocol):
    """What `fill` reads of a unit it is given: stage 3's `Unit`, or a `WholeParameter` at stages 0-2."""
    name: str
    flats: list[FlatParamBuffer]  # one per param group; `open_unit` gives a buffer laid out as each
    persistent: bool  # read whole on every rank; else each rank reads its owned range of the flat buffers

    @property
    def title(self) -> str: ...


def _init_module(seed: int, name: str, module: nn.Module, owner: nn.Module) -> None:
    """owner._init_weights(module) drawing from a generator seeded by (seed, module name); the global
    RNG is left as it was."""
    seed_of_module = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    init_module_from(torch.Generator().manual_seed(seed_of_module).get_state(), module, owner)


def init_module_from(rng_state: torch.Tensor, module: nn.Module, owner: nn.Module) -> None:
    """owner._init_weights(module) drawing from the global CPU generator set to `rng_state`, which is then put
    back as it was."""
    with torch.random.fork_rng(devices=[]), _dtensors_whole(module):
        torch.set_rng_state(rng_state)
        owner._init_weights(module)


@contextlib.contextmanager
def _dtensors_whole(module: nn.Module) -> Iterator[None]:
    """While a module's init runs, the DTensor parameters it may write (its own and its children's)
    stand as whole plain tensors holding their current values; each rank then keeps its part, cut as
    apply_tensor_parallel cuts. A DTensor's own random ops would draw differently from the whole model's
    init (and from one tp size to another); one module's whole weight at a time is small beside the model."""
    split = [(owner, name, p) for owner in (module, *module.children())
             for name, p in owner._parameters.items() if isinstance(p, DTensor)]
    for owner, name, p in split:
        owner._parameters[name] = nn.Parameter(_gather_on_host(p, name), p.requires_grad)
    try:
        yield
        for owner, name, p in split:
            copy_cut_into(p, owner._parameters[name].detach())
    finally:
        for owner, name, p in split:
            owner._parameters[name] = p


def _gather_on_host(param: DTensor, name: str) -> torch.Tensor:
    """The whole of a DTensor whose parts are staged in host memory: gathered on the compute device, where the
    mesh's collectives run (NCCL takes no host tensors), and brought back to the host."""
    part, copy = to_device(local(param).detach(), compute_device(), f"{name}'s part")
    copy.wait()
    return in_host_memory(wrap_like(param, part).full_tensor())


def _init_order(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, module, the PreTrainedModel whose _init_weights applies) in transformers' smart_apply order:
    children before their parent, each sub-model initialised by its own class."""
    order = []

    def visit(name: str, module: nn.Module, owner: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            visit(full, child, child if hasattr(child, "_init_weights") else owner)
        order.append((name, module, owner))

    visit("", model, model)
    return order


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, names: Iterable[str] | None = None) -> None:
    """Initialises the modules called `names` (default: all) with the model's own _init_weights,
    each from its own seeded generator."""
    wanted = None if names is None else set(names)
    for name, module, owner in _init_order(model):
        if wanted is None or name in wanted:
            _init_module(seed, name, module, owner)


def build_seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`build()` run on the meta device, then given memory on the CPU and initialised by `init_weights`:
    the values an engine built with `init_from=SeededInit(seed)` holds, shard by shard."""
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives tied parameters separate tensors; tie them again before writing
    init_weights(model, seed)
    return model


class SeededInit:
    """Fills the units with the model's own initialisation, reproducibly per module (see module doc)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def fill_rest(self, model: nn.Module) -> None:
        """Buffers and the frozen parameters left whole get host memory now; their modules' init fills them in
        `fill`."""
        _materialize_rest(model)

    def init_module(self, name: str, module: nn.Module, owner: nn.Module) -> None:
        _init_module(self.seed, name, module, owner)

    def fill(self, model: nn.Module, units: list[FilledUnit], open_unit: Callable, close_unit: Callable,
             rank: int) -> None:
        """Runs the init of every module once, in transformers' order. A unit gets memory before the first
        module that writes it and gives up its chunk after the last one, so units are filled one at a
        time (blocks are contiguous in that order) and a tied weight sees its writers in their order."""
        order = _init_order(model)
        unit_of = {id(s.param): unit for unit in units for flat in unit.flats for s in flat.slices}
        # What a module's init may write: its own parameters and its children's (GPT-2's attention
        # rescales its child c_proj's weight).
        writes = []
        for _, module, _ in order:
            params = [*module.parameters(recurse=False),
                      *(p for child in module.children() for p in child.parameters(recurse=False))]
            writes.append({id(unit_of[id(p)]): unit_of[id(p)] for p in params if id(p) in unit_of})
        last = {key: i for i, written in enumerate(writes) for key in written}
        opened: set[int] = set()
        for i, (name, module, owner) in enumerate(order):
            for key, unit in writes[i].items():
                if key not in opened:
                    opened.add(key)
                    open_unit(unit)
            self.init_module(name, module, owner)
            for key, unit in writes[i].items():
                if last[key] == i:
                    close_unit(unit)
        for unit in units:  # parameters no module initialises keep zeros, as to_empty + init would not
            if id(unit) not in opened:
                open_unit(unit)
                close_unit(unit)


class PretrainedWeights:
    """Fills each unit from a save_pretrained folder (or its safetensors `files`), reading only the slices this
    rank owns. Tensors that already hold values (what transformers initialised because the checkpoint lacks
    them, under hf_zero.hf.pretrained) are taken as they are."""

    def __init__(self, folder: str | os.PathLike | None = None, files: Iterable[str | os.PathLike] = ()) -> None:
        if folder is not None:
            folder = Path(folder)
            index = folder / "model.safetensors.index.json"
            if index.is_file():
                files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
            elif (folder / "model.safetensors").is_file():
                files = [folder / "model.safetensors"]
            else:
                raise FileNotFoundError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")
        # Each tensor's file, shape and dtype, from the files' headers, read once.
        self.file_of: dict[str, Path] = {}
        self.header_of: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    header = f.get_slice(key)
                    self.file_of[key] = Path(file)
                    self.header_of[key] = (tuple(header.get_shape()), TORCH_DTYPES[header.get_dtype()])
        self.where = folder if folder is not None else Path(next(iter(self.file_of.values()), ".")).parent
        self.bytes_read = 0
        # transformers' renamings and conversions of this load (`follow`): the checkpoint key of a renamed tensor;
        # for a converted one, its conversion (the first tensor it makes, the converter, the checkpoint keys and
        # their patterns) and shape; the tensors the last conversion run made.
        self.renamed: dict[str, str] = {}
        self.conversion_of: dict[str, tuple[str, Any, list[tuple[str, str]]]] = {}
        self.converted_shape: dict[str, tuple[int, ...]] = {}
        self.made: dict[str, torch.Tensor] = {}
        # Values given by name, taken as they are: those peft gave the adapters around a base built partitioned.
        self.given: dict[str, torch.Tensor] = {}

    def follow(self, model: nn.Module, weight_mapping: list[Any] | None) -> None:
        """Takes in transformers' renamings and conversions of this load (`LoadStateDictConfig.weight_mapping`,
        applied to the checkpoint's keys as `convert_and_load_state_dict_in_model` applies them), so that a model
        whose checkpoint transformers converts while loading (legacy names, experts stored one by one and merged
        into one tensor, fused projections split) is read too. A converted tensor is made whole from its checkpoint
        tensors when its unit is filled, one conversion at a time; each conversion is run once first on meta
        stand-ins, to learn the tensors it makes and their shapes."""
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        renamings = [t for t in weight_mapping or [] if isinstance(t, WeightRenaming)]
        converters = [t for t in weight_mapping or [] if isinstance(t, WeightConverter)]
        if not renamings and not converters:
            return
        converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
        expected, prefix = model.state_dict(), model.base_model_prefix
        sources: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
        for key in sorted(self.file_of, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if target not in expected and key in expected:  # as transformers: stored under the model's own name
                target, pattern = rename_source_key(key, [], [], prefix, expected)
            if target not in expected:
                continue
            if pattern is None:
                self.renamed[target] = key
            else:
                sources.setdefault(target, (converter_of[pattern], []))[1].append((key, pattern))
        def stand_in(key: str) -> torch.Tensor:
            return torch.empty(self.header_of[key][0], dtype=self.header_of[key][1], device="meta")

        for first, (converter, keys) in sources.items():
            try:
                made = self._convert(model, first, converter, keys, stand_in)
            except Exception as e:
                raise ValueError(f"transformers converts {first} while loading, and hf_zero could not learn what the "
                                 f"conversion makes ({type(e).__name__}: {e}): pass --zero_init_partitioned false to "
                                 f"load the model whole on every rank first") from e
            for name, tensor in made.items():
                self.conversion_of[name] = (first, converter, keys)
                self.converted_shape[name] = tuple(tensor.shape)

    @staticmethod
    def _convert(model: nn.Module, first: str, converter: Any, keys: list[tuple[str, str]],
                 load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runs one of transformers' conversions on the checkpoint tensors `load` gives: the tensors it makes, by
        name."""
        conversion = copy.deepcopy(converter)  # as transformers: each conversion collects its tensors in its own copy
        for key, pattern in keys:
            conversion.add_tensor(first, key, pattern, functools.partial(load, key))
        made = conversion.convert(first, model=model, config=getattr(model, "config", None))
        return {name: tensor[0] if isinstance(tensor, list) else tensor for name, tensor in made.items()}

    def _converted(self, model: nn.Module, name: str) -> torch.Tensor:
        """A tensor transformers converts while loading, whole: its conversion is run when the first tensor it makes
        is read, and what it made is kept until another conversion runs (one layer's experts, say)."""
        if name not in self.made:
            first, converter, keys = self.conversion_of[name]

            def load(key: str) -> torch.Tensor:
                with safe_open(str(self.file_of[key]), framework="pt") as f:
                    tensor = f.get_tensor(key)
                self.bytes_read += tensor.numel() * tensor.element_size()
                return tensor

            self.made = {}
            self.made = self._convert(model, first, converter, keys, load)
        return self.made[name]

    def key_of(self, model: nn.Module, name: str) -> str:
        """The checkpoint's name for a model tensor, allowing for the base-model prefix either way, for
        transformers' renamings (`follow`) and for a peft wrapper's names (`_name_in_base`)."""
        model, name = _name_in_base(model, name)
        if name in self.renamed:
            return self.renamed[name]
        if name in self.file_of:
            return name
        prefix = getattr(model, "base_model_prefix", "") + "."
        # A tied weight is saved once, under the name it is tied to (what a trained copy of it, peft's
        # modules_to_save of a tied head, starts from).
        tied_to = (getattr(model, "all_tied_weights_keys", None) or {}).get(name)
        for key in (name.removeprefix(prefix), prefix + name, tied_to):
            if key in self.file_of:
                return key
        raise KeyError(f"{name} is not in {self.where}; the folder holds weights of another model")

    def total_bytes(self) -> int:
        """Bytes of tensor data in the checkpoint's files."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.header_of.values())

    def shape_of(self, model: nn.Module, name: str) -> tuple[int, ...]:
        model, name = _name_in_base(model, name)
        if name in self.converted_shape:
            return self.converted_shape[name]
        return self.header_of[self.key_of(model, name)][0]

    def _read(self, model: nn.Module, name: str, param: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of this rank's part of `param` (called `name`) flattened, reading only the rows that
        hold them (of a tensor-parallel split, only this tp rank's columns or rows of them). A tensor transformers
        converts while loading is made whole first (`_converted`)."""
        model, name = _name_in_base(model, name)
        if name in self.conversion_of:
            whole = self._converted(model, name)
            if not is_tp_replicated(param):
                dim, ranges = local_ranges(param)
                whole = torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim)
            out.copy_(whole.reshape(-1)[lo:hi])
            return
        key = self.key_of(model, name)
        with safe_open(str(self.file_of[key]), framework="pt") as f:
            tensor = f.get_slice(key)
            shape = list(tensor.get_shape())
            split = None if is_tp_replicated(param) else local_ranges(param)
            if split is not None:
                shape[split[0]] = sum(b - a for a, b in split[1])
            row = math.prod(shape[1:])  # 1 for a vector: then rows are elements
            first, last = lo // row, -(-hi // row)  # rows [first, last) cover [lo, hi)
            if not shape:  # a 0-dim tensor has no rows
                rows = f.get_tensor(key).reshape(1)
            else:
                rows = tensor[first:last] if split is None else _rows_of_part(tensor, *split, first, last)
        self.bytes_read += rows.numel() * rows.element_size()
        out.copy_(rows.reshape(-1)[lo - first * row:hi - first * row])

    def fill_rest(self, model: nn.Module) -> None:
        """Buffers and the frozen parameters left whole, still on meta, are read whole; those the folder does not
        hold (position ids) are set by their modules' init."""
        on_meta = {name for name, tensor in _rest(model) if tensor.is_meta}
        _materialize_rest(model)
        missing_owners = set()
        for name, tensor in _rest(model):
            if name not in on_meta:
                continue
            try:
                self._read(model, name, tensor, 0, local(tensor).numel(), local(tensor).view(-1))
            except KeyError:
                missing_owners.add(name.rpartition(".")[0])
        init_weights(model, 0, missing_owners)

    def fill(self, model: nn.Module, units: list[FilledUnit], open_unit: Callable, close_unit: Callable,
             rank: int) -> None:
        """Unit by unit, reads the elements this rank owns (all of them for the persistent unit, which
        every rank holds whole) into the unit's buffers."""
        for unit in units:
            # Parameters left on meta have no elements now; the others were initialised by transformers.
            held = {id(s.param): local(s.param).detach().reshape(-1) for flat in unit.flats for s in flat.slices
                    if local(s.param).numel()}
            for flat, buffer in zip(unit.flats, open_unit(unit)):
                lo, hi = (0, flat.padded_numel) if unit.persistent else flat.buckets[0].owned_range(rank)
                for piece in flat.pieces_between(lo, hi):
                    start = piece.slice.offset + piece.param_lo
                    out = buffer[start:start + piece.param_hi - piece.param_lo]
                    if id(piece.slice.param) in held:
                        out.copy_(held[id(piece.slice.param)][piece.param_lo:piece.param_hi])
                    elif piece.slice.name in self.given:
                        out.copy_(self.given[piece.slice.name].reshape(-1)[piece.param_lo:piece.param_hi])
                    else:
                        self._read(model, piece.slice.name, piece.slice.param, piece.param_lo, piece.param_hi, out)
            close_unit(unit)


# What peft puts between a base model's module and its tensors: a tuner layer's wrapped layer, and a modules_to_save
# wrapper's original and its trained copy for an adapter.
_PEFT_WRAPPING = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


class WholeParameter:
    """What `fill` reads of a unit, for one parameter every rank holds whole (stages 0-2): a persistent unit, which
    `fill` reads whole on every rank."""

    persistent = True

    def __init__(self, name: str, param: nn.Parameter) -> None:
        self.name, self.dtype = name, param.dtype  # what it is built in; staged in fp32 meanwhile
        # Its layout only: `fill` writes the buffer `open_unit` gives.
        self.flats = [FlatParamBuffer([(name, param)], 1, torch.float32, device=torch.device("meta"))]

    @property
    def title(self) -> str:
        return f"parameter {self.name!r}"


def staged_on_host(flat: FlatParamBuffer) -> torch.Tensor:
    """An fp32 host buffer the flat buffer's parameters view while `init_from` fills them (init and checkpoints
    are fp32; filling a bf16 buffer directly would lose the masters' precision). In host memory, so that a
    seeded init draws from the CPU generator: the same values as a build on CPU, and the accelerator's
    generator left as it was."""
    buffer = host_memory_empty(flat.padded_numel, zeroed=True)
    for s in flat.slices:
        set_data(s.param, flat.view_of(s, buffer))
    return buffer


def leave_meta(params: Iterable[nn.Parameter], device: torch.device) -> None:
    """Turns each meta parameter into an empty one on `device`, keeping the Parameter object (the optimizer and
    tied modules hold it): `.data =` cannot change a tensor's device type, nor the device a DTensor reports (it is
    fixed when the wrapper is made), so a DTensor becomes a new one of empty parts."""
    for param in params:
        if param.is_meta:
            empty = wrap_like(param, torch.empty(0, dtype=param.dtype, device=device))
            torch.utils.swap_tensors(param, nn.Parameter(empty, param.requires_grad))


@torch.no_grad()
def fill_whole(model: nn.Module, init_from: Any, device: torch.device, rank: int) -> None:
    """The parameters stage 3 would put in units (those not of `_rest`, which `init_from.fill_rest` filled) get their
    values whole on `device` from `init_from`, one at a time: staged in fp32 on the host as stage 3 stages a unit (a
    seeded init then draws from the CPU generator), then in the parameter's own dtype on `device`, as a build of the
    whole model holds it. Those that already hold values (what transformers initialised) are taken by `fill`, as at
    stage 3."""
    units = [WholeParameter(name, p) for name, p in model.named_parameters()
             if p.requires_grad or partitioned_frozen(p)]
    leave_meta((s.param for unit in units for s in unit.flats[0].slices), device)
    staging: dict[int, torch.Tensor] = {}
    closed: set[int] = set()

    def open_unit(unit: WholeParameter) -> list[torch.Tensor]:
        staging[id(unit)] = staged_on_host(unit.flats[0])
        return [staging[id(unit)]]

    def close_unit(unit: WholeParameter) -> None:
        flat = unit.flats[0]
        staged = flat.view_of(flat.slices[0], staging.pop(id(unit))).to(unit.dtype)
        values, copy = to_device(staged, device, f"the values of {unit.title}")
        copy.wait()
        set_data(flat.slices[0].param, values)
        closed.add(id(unit))

    init_from.fill(model, units, open_unit, close_unit, rank)
    refuse_unfilled(init_from, units, closed)


def refuse_unfilled(init_from: Any, units: list[FilledUnit], closed: set[int]) -> None:
    """A unit `init_from.fill` never closed has no values: refused, not trained from whatever its memory holds."""
    missed = [unit.title for unit in units if id(unit) not in closed]
    if missed:
        raise RuntimeError(f"{type(init_from).__name__}.fill gave values to {len(units) - len(missed)} of the "
                           f"model's {len(units)} units, not to {', '.join(missed[:3])}"
                           f"{f' and {len(missed) - 3} more' if len(missed) > 3 else ''}: fill must open and "
                           f"close every unit it is given")


def _name_in_base(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """A peft model's tensor named as in its base model as transformers built it (what the checkpoint and
    `follow` know): the wrapper's prefix and peft's wrapping modules dropped. Anything else as it is."""
    if not callable(getattr(model, "get_base_model", None)):  # peft's wrapper (its base holds peft_config too)
        return model, name
    base = model.get_base_model()
    # The base is the wrapper's base_model (prompt learning) or that tuner's model (LoRA and the other tuners).
    prefix = "base_model." if model.base_model is base else "base_model.model."
    return base, _PEFT_WRAPPING.sub("", "." + name.removeprefix(prefix))[1:]


def _rows_of_part(tensor: Any, dim: int, ranges: list[tuple[int, int]], first: int, last: int) -> torch.Tensor:
    """Rows [first, last) of a tp rank's part of a safetensors tensor, the part being the whole tensor's `ranges`
    along `dim` laid end to end (`tensor_parallel.local_ranges`)."""
    if dim > 0:
        rows = (slice(first, last),) + (slice(None),) * (dim - 1)
        return torch.cat([tensor[rows + (slice(a, b),)] for a, b in ranges], dim)
    pieces, at = [], 0
    for a, b in ranges:  # the part's rows [at, at + b - a) are the tensor's rows [a, b)
        lo, hi = max(first, at), min(last, at + b - a)
        if lo < hi:
            pieces.append(tensor[a + lo - at:a + hi - at])
        at += b - a
    return torch.cat(pieces)


def _rest(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers and the frozen parameters stage 3 does not partition: what the engine leaves whole on every rank."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad and not partitioned_frozen(p)]
    return frozen + list(model.named_buffers())


def _materialize_rest(model: nn.Module) -> None:
    """In host memory, as the units are staged (`staged_on_host`): a seeded init of a frozen weight then
    draws from the CPU generator on any machine. `place_rest` moves them to the device once filled."""
    _replace_rest(model, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=HOST) if t.is_meta else None)


def place_rest(model: nn.Module, device: torch.device) -> None:
    """Buffers and frozen parameters of a model built from `init_from`, filled on the host, go to `device`."""
    if device != HOST:
        _replace_rest(model, lambda t: t.to(device) if t.device != device else None)


@torch.no_grad()
def _replace_rest(model: nn.Module, new_value: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Each tensor of `_rest` (the frozen parameters stage 3 leaves whole, the buffers) takes `new_value(tensor)`,
    where that is not None."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad or partitioned_frozen(p):
                continue
            if (value := new_value(local(p).detach())) is not None:
                _swap_frozen(p, value)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and (value := new_value(b)) is not None:
                module._buffers[name] = value


def _swap_frozen(param: nn.Parameter, values: torch.Tensor) -> None:
    """`param` takes `values` (its local part, for a DTensor), keeping its Parameter object (tied modules hold
    it); `.data =` cannot move a tensor from meta (or between device types)."""
    torch.utils.swap_tensors(param, nn.Parameter(wrap_like(param, values), requires_grad=False))
