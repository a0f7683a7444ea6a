"""What a simulated rank holds at its step's peak, counted as its tensors are made, resized and freed.

`MemoryCount` is a dispatch mode that sees the storage of every tensor an op makes (fake tensors too: only their
size matters) and keeps, per storage, where it lives and what it is:

- where: the device, unless the device layer's host doors made it (host_empty, host_block, host_memory: offloaded
  states, pinned staging), which `on_host` marks;
- what (KINDS): from the span the engine is in when it is made (a gather's buffers are parameters, a reduction's are
  gradients, the optimizer's step makes optimizer states), a parameter's gradient as autograd accumulates it,
  activations elsewhere in the forward (and in a checkpoint's recomputation), "other" elsewhere (the backward's
  gradients of activations, inputs).

torch's MemTracker (torch.distributed._tools.mem_tracker) counts the same way but sorts by nn.Module parameters and
torch.optim states, which the engine replaces by flat buffers and shards; and it has no host/device split beyond the
tensor's device, which on a CPU plan is the host for both. The peak is exact: the live storages are kept at each
local maximum of each place's total, and sorted by what they turned out to be once the step is over.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

KINDS = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "other")
PLACES = ("device", "host")

# The kind of what is made inside each of the engine's spans (hf_zero.runtime.trace).
KIND_OF_SPAN = {
    "partition_parameters": "parameters", "gather": "parameters", "all_gather_parameters": "parameters",
    "wait_for_gather": "parameters", "keep_secondary": "parameters", "reduce": "gradients", "grad_shards": "gradients",
    "shard_optimizer": "optimizer_states", "optimizer_step": "optimizer_states", "host_step": "optimizer_states",
    "nvme_step": "optimizer_states",
}


class MemoryCount(TorchDispatchMode):
    """Counts the bytes of every storage made inside, by place and kind; `peak()` gives each place's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.number_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> its number
        self.place_of: dict[int, str] = {}
        self.kind_of: dict[int, str] = {}
        self.live: dict[str, dict[int, int]] = {place: {} for place in PLACES}  # number -> bytes, alive now
        self.total = Counter()  # place -> bytes alive now
        self.peak_total = Counter()
        self.at_peak: dict[str, dict[int, int]] = {place: {} for place in PLACES}
        self.rising = dict.fromkeys(PLACES, False)  # a peak not yet kept (kept when the total first falls)
        self.by_kind = {place: Counter() for place in PLACES}  # bytes alive now, by kind
        # Device and host together: one memory where the device is the host (a CPU run).
        self.together = self.peak_together = 0
        self.kinds: list[str] = ["other"]
        self.places: list[str] = ["device"]
        self.forward_depth = 0

    # ---- what is made now
    @contextlib.contextmanager
    def making(self, kind: str | None) -> Iterator[None]:
        """What is made inside is `kind` (None: as outside)."""
        self.kinds.append(kind or self.kinds[-1])
        try:
            yield
        finally:
            self.kinds.pop()

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        self.places.append("host")
        try:
            yield
        finally:
            self.places.pop()

    def span(self, phase: str) -> contextlib.AbstractContextManager:
        """A watcher for hf_zero.runtime.trace.watching_spans."""
        return self.making(KIND_OF_SPAN.get(phase))

    def _kind_now(self) -> str:
        if self.kinds[-1] != "other":
            return self.kinds[-1]
        return "activations" if self.forward_depth else "other"

    # ---- storages
    def track(self, tensor: torch.Tensor, kind: str | None = None) -> None:
        """Counts `tensor`'s storage if it is new, as `kind` (default: what is made now); a known one is re-sorted
        as `kind` if given."""
        storage = tensor.untyped_storage()
        number = self.number_of.get(storage)
        if number is None:
            number = len(self.place_of)
            self.number_of[storage] = number
            self.place_of[number] = place = self.places[-1]
            self.kind_of[number] = kind or self._kind_now()
            weakref.finalize(storage, self._freed, place, number)
            self._set_size(place, number, storage.nbytes())
        elif kind is not None and kind != self.kind_of[number]:
            place = self.place_of[number]
            nbytes = self.live[place].get(number, 0)
            self.by_kind[place][self.kind_of[number]] -= nbytes
            self.by_kind[place][kind] += nbytes
            self.kind_of[number] = kind

    def resized(self, tensor: torch.Tensor, nbytes: int) -> None:
        """`tensor`'s storage now holds `nbytes` (given back by release_storage, or taken again)."""
        storage = tensor.untyped_storage()
        number = self.number_of.get(storage)
        if number is None:
            self.track(tensor)
            number = self.number_of[storage]
        self._set_size(self.place_of[number], number, nbytes)

    def _freed(self, place: str, number: int) -> None:
        self._set_size(place, number, 0)

    def _set_size(self, place: str, number: int, nbytes: int) -> None:
        live = self.live[place]
        change = nbytes - live.get(number, 0)
        if change < 0:  # the total falls, from a peak if it was rising
            self._keep_peak(place)
        if nbytes:
            live[number] = nbytes
        else:
            live.pop(number, None)
        self.total[place] += change
        self.together += change
        self.peak_together = max(self.peak_together, self.together)
        self.by_kind[place][self.kind_of[number]] += change
        if self.total[place] > self.peak_total[place]:
            self.peak_total[place] = self.total[place]
            self.rising[place] = True

    def _keep_peak(self, place: str) -> None:
        """Keeps what is alive now as `place`'s peak, if its total rose to a new peak since it was last kept."""
        if self.rising[place]:
            self.at_peak[place] = dict(self.live[place])
            self.rising[place] = False

    def start_window(self) -> None:
        """The peak is taken from now on."""
        self.peak_together = self.together
        for place in PLACES:
            self.peak_total[place] = self.total[place]
            self.at_peak[place] = dict(self.live[place])
            self.rising[place] = False

    def peak(self, place: str) -> dict[str, int]:
        """The bytes by kind at `place`'s peak, each storage sorted by what it turned out to be."""
        self._keep_peak(place)
        by_kind = dict.fromkeys(KINDS, 0)
        for number, nbytes in self.at_peak[place].items():
            by_kind[self.kind_of[number]] += nbytes
        return by_kind

    # ---- the dispatch mode
    def _on_host_only(self, inputs: list[Any]) -> bool:
        """Whether every input counted so far is the host's: an op on host tensors makes host tensors (Adam's
        states made like its offloaded masters), as it would beside a GPU."""
        places = {self.place_of[n] for t in inputs if isinstance(t, torch.Tensor)
                  and (n := self.number_of.get(t.untyped_storage())) is not None}
        return places == {"host"}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and isinstance(args[0], FakeTensor) and not args[0].fake_mode.in_kernel_invocation:
            # Answered as the fake mode below would (fake_tensor.py), without the two dispatches through it: two
            # thirds of a step's dispatches are this query.
            return args[0].fake_device
        out = func(*args, **(kwargs or {}))
        if func in _NOTHING_MADE:
            return out
        made = [t for t in ([out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0])
                if isinstance(t, torch.Tensor) and _holds_memory(t)]
        if not made:
            return out
        on_host = self.live["host"] and self._on_host_only(tree_flatten((args, kwargs))[0])
        with self.on_host() if on_host else contextlib.nullcontext():
            for t in made:
                self.track(t)
        return out


def _holds_memory(tensor: torch.Tensor) -> bool:
    """Not a meta tensor: those hold shapes the engine keeps without values (NVMe's gradient shard). A fake tensor's
    device is read from it, not asked through the dispatcher (see _DEVICE)."""
    device = tensor.fake_device if isinstance(tensor, FakeTensor) else tensor.device
    return device.type != "meta"


_DEVICE = torch.ops.prim.device.default  # asked on every `tensor.device` of a fake tensor
_NOTHING_MADE = {_DEVICE, torch.ops.aten._local_scalar_dense.default}  # ops that make no tensor
