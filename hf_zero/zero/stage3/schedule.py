"""Stage 3's schedule: the hooks that gather each unit just before its forward and its backward and free it
after, prefetching in the order the last pass of the same kind ran the units, and the post-backward where a
unit's reduction launches (Stage3Gradients), a point every rank reaches whatever its forward used.

`Schedule` is a part of Stage3Params (params.py) kept apart for reading; it uses the holder's `units`, `root`,
`grads`, `comm`, `in_backward`, `prefetch_numel`, `trim_host_heap` and `keep_limit()`, and `SharedWeights`
(shared_weights.py)."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves, tree_map

from hf_zero.runtime.host_memory import HeapTrimmer

if TYPE_CHECKING:
    from hf_zero.zero.stage3.gradients import Stage3Gradients
    from hf_zero.zero.stage3.unit import Unit


class ExecutionOrder:
    """The units one pass (a forward, or a backward) visits, against the order of the last pass of its kind."""

    def __init__(self) -> None:
        self.expected: list[Unit] = []
        self.seen: list[Unit] = []
        self.on_track = True  # every unit so far came where `expected` has it

    def begin(self) -> None:
        """A new pass: the one before it (if it visited any unit) is what this one is expected to do."""
        if self.seen:
            self.expected, self.seen = self.seen, []
        self.on_track = True

    def visit(self, unit: Unit) -> Iterator[Unit]:
        """Records `unit` as the next to run (a unit visited twice in a row counts once: a recomputation
        following its backward's gather) and returns the units expected after it: none once the pass has left
        the expected order."""
        if self.seen and self.seen[-1] is unit:
            return iter(())
        position = len(self.seen)
        self.seen.append(unit)
        self.on_track = self.on_track and position < len(self.expected) and self.expected[position] is unit
        return (self.expected[i] for i in range(position + 1, len(self.expected) if self.on_track else 0))


class Schedule:
    """The hooks of Stage3Params (see the module's docstring)."""

    def _install_hooks(self, model: nn.Module) -> None:
        # First of the model's hooks: the root's gather (its unit's pre-forward hook) is the new pass's first visit.
        model.register_forward_pre_hook(lambda m, a: None if self.in_backward else self.forward.begin())
        self.root = next((u for u in self.units if u.is_root), None)
        self.trim_heap = HeapTrimmer() if self.trim_host_heap else None  # see host_memory.py
        self._install_shared_weight_hooks(model)
        for unit in self.units:
            if not unit.persistent:
                unit.module.register_forward_pre_hook(
                    lambda m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs), with_kwargs=True)
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
        # Units prefetched for a forward that then took another path are freed when the model returns.
        model.register_forward_hook(lambda m, a, out: self._free_all_but_root())
        if callable(getattr(model, "generate", None)):
            self._gather_root_around(model, "generate")

    def _gather_root_around(self, model: nn.Module, method: str) -> None:
        """Runs model.<method> with the root unit gathered, as a forward would be, and the units it uses kept
        gathered (`units_kept_gathered`). generate() calls parts of the model directly (an encoder-decoder's
        encoder), outside the root's forward hooks; FSDP2's register_fsdp_forward_method exists for the same
        reason. It runs a forward per token, and would gather every unit again for each."""
        if self.root is None:
            return
        original = getattr(model, method)

        @functools.wraps(original)
        def with_root_gathered(*args, **kwargs):
            with self.units_kept_gathered():
                return original(*args, **kwargs)

        setattr(model, method, with_root_gathered)

    @contextlib.contextmanager
    def units_kept_gathered(self) -> Iterator[None]:
        """Inside, the root stays gathered and every unit a forward uses stays gathered after it, up to
        `keep_limit()` elements (`_keep_gathered`; FSDP2's reshard_after_forward=False, for
        the duration): for generate(), and for the Trainer's evaluation and prediction loops, where the weights do
        not change between forwards. When every unit fits, all are gathered on entry, in one order on every rank:
        no forward inside gathers, whatever each rank's inputs make it use (a branch, an expert first used late),
        so ranks need not step together (ZeroSeq2SeqTrainer leaves synced_gpus off). One inside another: the
        outer one keeps and frees."""
        if self.root is None or self.keep_budget is not None:
            yield
            return
        self._fetch(self.root, backward=False)
        self.keep_budget = self.keep_limit()
        try:
            if sum(u.numel for u in self._keepable()) <= self.keep_budget:
                for unit in self.units:
                    if not unit.persistent and self._keep_gathered(unit):
                        unit.gather("forward")
                for unit in self.units:
                    unit.wait()
            yield
        finally:
            self.keep_budget = None
            self.kept_gathered.clear()
            self._free_all_but_root()
            self.root.free()

    def _keep_gathered(self, unit: Unit) -> bool:
        """Inside units_kept_gathered: whether `unit`, just used by a forward, stays gathered for the next forwards
        (while the budget has room for it; the root, gathered for the whole call, always does)."""
        if self.keep_budget is None or unit.persistent:
            return False
        if unit.is_root or id(unit) in self.kept_gathered:
            return True
        if unit.numel > self.keep_budget:
            return False
        self.keep_budget -= unit.numel
        self.kept_gathered.add(id(unit))
        return True

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # A forward inside backward is activation checkpointing recomputing the unit: its gradients come next,
        # so the units to prefetch are those that follow it in backward.
        self._fetch(unit, backward=self.in_backward)
        if unit.is_root or not torch.is_grad_enabled():
            return None
        # A recomputation inside backward whose forward already marked the unit's post-backward (non-reentrant
        # checkpointing, whose recomputed graph is never run backward) marks nothing; a reentrant one, whose
        # forward ran without autograd, marks it now.
        if self.in_backward and self.grads.post_backwards_to_come(unit):
            return None
        inputs = [t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.requires_grad]
        self.grads.expect_post_backward(unit, marked=bool(inputs))
        if not inputs:
            return None
        marked = iter(_PostBackward.apply(self.grads, unit, *inputs))
        return tree_map(lambda t: next(marked) if torch.is_tensor(t) and t.requires_grad else t, (args, kwargs))

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if self.in_backward:  # recomputed: its backward runs at once, and its reduction frees it (Stage3Gradients)
            return
        tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        backward_follows = torch.is_grad_enabled() and bool(tensors)
        if backward_follows:
            unit.keep_secondary()  # the root too: it stays gathered into this backward, not the next forward's
        if not (unit.is_root and backward_follows and not self.reshard_root_after_forward) and \
                not (not backward_follows and self._keep_gathered(unit)):
            unit.free()
        if backward_follows:
            register_multi_grad_hook(tensors, lambda grads, u=unit: self._fetch(u, backward=True), mode="any")

    def _fetch(self, unit: Unit, backward: bool) -> None:
        """Gathers `unit`, then starts gathering the units that ran after it in the last pass of the same kind,
        so that their all-gathers overlap this unit's compute: always the next one (a 7B block is larger than
        any sensible budget, and without it every all-gather would be exposed), then more up to
        `prefetch_bucket_size` elements in all. Once this pass has left the last one's order (a model whose
        order changes between steps), nothing more is prefetched in it: what was would be gathered for
        nothing, or too early and held. Every rank runs the same order, so every rank prefetches alike."""
        order, purpose = (self.backward, "backward") if backward else (self.forward, "forward")
        if backward and self.in_backward and self.trim_heap is not None:
            self.trim_heap()
        if backward and self.in_backward and unit is not self.root and self.root_frees_early \
                and self.root_saves_waiting <= 0:
            self.root.free_early()  # backward has read back all the forward saved of it
            self.grads.open_buckets()  # the tied head's gradient, kept until the root's weights went
        to_come = order.visit(unit)
        unit.gather(purpose)
        budget = self.prefetch_numel
        for i, next_unit in enumerate(to_come):
            if i > 0 and next_unit.numel > budget:
                break
            budget -= next_unit.numel
            if not next_unit.gathered:
                self.comm.ledger.count("units prefetched")
                next_unit.gather(purpose)
        unit.wait()


class _PostBackward(torch.autograd.Function):
    """Applied to the inputs of a unit's forward that require grad, as they are (FSDP2's
    RegisterPostBackwardFunction): its backward runs once the unit's backward has given them their gradients,
    after the unit's parameters took theirs in (autograd runs a leaf's gradient accumulation before other work
    that is ready, and this node, made first in the unit's forward, after the rest of the unit's). That is the
    unit's post-backward (Stage3Gradients.post_backward), which every rank reaches whatever its forward used."""

    @staticmethod
    def forward(grads: Stage3Gradients, unit: Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.grads, ctx.unit = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.grads.post_backward(ctx.unit)
        return (None, None, *grads)
