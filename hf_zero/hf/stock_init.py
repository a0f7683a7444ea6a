"""transformers' own initialisation of a model built on meta, bitwise, filled one stage-3 unit at a time.

A plain `from_config` draws from the global generator twice per module: when the module is constructed (torch's
default init) and when transformers initialises it (`_init_weights`, in each sub-model's `post_init`), the two
interleaved as sub-models are built. DeepSpeed's `zero.Init` gets the same values by building each module whole
and partitioning it at once; here the model is built on meta instead, and two things make the values the same:

- `_DrawsOnMeta`: every random operation on a meta tensor is also run on a scratch CPU tensor of that shape and
  dtype, which is thrown away. The global generator therefore advances exactly as in a plain build, and is left
  where a plain `from_config` leaves it (what the script draws next, dropout included, is as under stock).
- `record_stock_init`: transformers' initialisation runs on the meta model too (it skips itself on meta; this
  makes it run), and before each module's `_init_weights` the generator's state is recorded. When the engine
  fills a unit, each of its modules' `_init_weights` runs again from its recorded state, on real memory
  (`StockInit`, the same unit-by-unit fill as `SeededInit`). A tied weight takes its values from the module
  that keeps it: the other module's init, which stock runs on a tensor the tying then drops, writes a scratch
  tensor here.

What this cannot reproduce is refused while the model is built, naming the tensors: values left by a module's
constructor that transformers' init never overwrites.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from hf_zero.zero.construct import SeededInit, init_module_from


def _is_meta(value: Any) -> bool:
    return ((isinstance(value, torch.Tensor) and value.is_meta)
            or (isinstance(value, torch.device) and value.type == "meta"))


class _DrawsOnMeta(TorchDispatchMode):
    """Runs each random operation on meta tensors once more on CPU scratch tensors (see the module doc), and notes
    which storages were drawn into outside transformers' init and which were written inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.in_init = 0
        self.drawn_outside_init: set[int] = set()
        self.written_in_init: set[int] = set()
        self._storages: dict[int, Any] = {}  # held, so that a freed storage's address is not taken by another
        # One buffer all the scratch tensors are cut from: a fresh tensor per draw left the freed ones scattered
        # over the heap between the states kept (1 GB still held after building a 200M-parameter GPT-2).
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _on_cpu(self, value: Any) -> Any:
        """A meta tensor's CPU stand-in (its shape, strides and dtype, in the scratch buffer), a meta device's CPU."""
        if isinstance(value, torch.Tensor) and value.is_meta:
            extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))
            nbytes = extent * value.element_size() if value.numel() else 0
            if nbytes > self._scratch.numel():
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            return self._scratch[:nbytes].view(value.dtype).as_strided(value.shape, value.stride())
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        return value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        if random and any(_is_meta(value) for value in (*args, *kwargs.values())):
            func(*tree_map(self._on_cpu, args), **tree_map(self._on_cpu, kwargs))
        written = [value for value, declared in zip(args, func._schema.arguments)
                   if declared.alias_info is not None and declared.alias_info.is_write]
        if random and not written:  # a random factory: what it made is what it drew into
            written = [value for value in (result if isinstance(result, (tuple, list)) else [result])]
        for tensor in written:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                storage = tensor.untyped_storage()
                self._storages[storage._cdata] = storage
                if self.in_init:
                    self.written_in_init.add(storage._cdata)
                elif random:
                    self.drawn_outside_init.add(storage._cdata)
        return result


class StockInit(SeededInit):
    """Fills the units with transformers' initialisation as a plain build of the whole model draws it (see the
    module doc); made by `record_stock_init`."""

    def __init__(self, states: dict[str, tuple[torch.Tensor, nn.Module]], tied_away: set[tuple[str, str]]) -> None:
        super().__init__()
        self.states = states  # module name -> (the generator's state before its init, the model that ran it)
        self.tied_away = tied_away  # (module name, parameter name): the parameters tying replaced after init

    def init_module(self, name: str, module: nn.Module, owner: nn.Module) -> None:
        if name in self.states:  # transformers ran no init for the others
            state, recorded_owner = self.states[name]
            with self._tied_away_on_scratch(name, module):
                init_module_from(state, module, recorded_owner)

    @contextlib.contextmanager
    def _tied_away_on_scratch(self, name: str, module: nn.Module) -> Iterator[None]:
        """What a module's init writes (its parameters and its children's) into a parameter tying later replaced
        goes to a scratch tensor, as it went to the replaced one under stock."""
        swapped = []
        for holder_name, holder in ((name, module), *((f"{name}.{n}" if name else n, c)
                                                      for n, c in module.named_children())):
            for param_name, param in holder._parameters.items():
                if (holder_name, param_name) in self.tied_away:
                    swapped.append((holder, param_name, param))
                    holder._parameters[param_name] = nn.Parameter(torch.empty_like(param, device="cpu"))
        try:
            yield
        finally:
            for holder, param_name, param in swapped:
                holder._parameters[param_name] = param


def record_stock_init(build: Callable[[], nn.Module]) -> tuple[nn.Module, StockInit]:
    """`build()` (a from_config call) run on meta, with its draws replayed and transformers' init recorded: the
    model without values and the `StockInit` that gives it the values a plain `build()` gives."""
    from transformers import PreTrainedModel

    initialize_weights = PreTrainedModel.__dict__["_initialize_weights"]
    init_weights = PreTrainedModel.__dict__["init_weights"]
    draws = _DrawsOnMeta()
    calls: list[tuple[nn.Module, torch.Tensor, nn.Module, list[tuple[nn.Module, str, nn.Parameter]]]] = []

    def recording_initialize_weights(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        if not getattr(module, "_is_hf_initialized", False):
            writes = [(holder, name, param) for holder in (module, *module.children())
                      for name, param in holder._parameters.items() if param is not None]
            calls.append((module, torch.get_rng_state(), self, writes))
        draws.in_init += 1
        try:
            initialize_weights(self, module, is_custom_code)
        finally:
            draws.in_init -= 1

    def init_weights_on_meta(self: Any) -> None:
        self.initialize_weights()  # which transformers' init_weights skips on meta
        init_weights(self)  # ties the weights

    PreTrainedModel._initialize_weights = recording_initialize_weights
    PreTrainedModel.init_weights = init_weights_on_meta
    try:
        with torch.device("meta"), draws:
            model = build()
    finally:
        PreTrainedModel._initialize_weights = initialize_weights
        PreTrainedModel.init_weights = init_weights
    _refuse_constructor_values(model, draws)
    names = {id(module): name for name, module in model.named_modules()}
    states: dict[str, tuple[torch.Tensor, nn.Module]] = {}
    tied_away: set[tuple[str, str]] = set()
    previous_state = None
    for module, state, owner, writes in calls:
        if id(module) not in names:
            continue
        if previous_state is not None and torch.equal(state, previous_state):
            state = previous_state  # modules that draw nothing share one state
        states[names[id(module)]] = state, owner
        previous_state = state
        for holder, param_name, param in writes:
            if holder._parameters.get(param_name) is not param and id(holder) in names:
                tied_away.add((names[id(holder)], param_name))
    return model, StockInit(states, tied_away)


def _refuse_constructor_values(model: nn.Module, draws: _DrawsOnMeta) -> None:
    kept = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
            if tensor.untyped_storage()._cdata in draws.drawn_outside_init
            and tensor.untyped_storage()._cdata not in draws.written_in_init]
    if kept:
        raise ValueError(
            f"{type(model).__name__} is built partitioned (--zero_init_partitioned) with transformers' initialisation "
            f"replayed module by module, and {', '.join(kept[:5])}{' ...' if len(kept) > 5 else ''} keep the values "
            f"their module's constructor drew (its _init_weights does not set them), which are not replayed. Pass "
            f"--zero_init_partitioned false to build the model whole on every rank first")
