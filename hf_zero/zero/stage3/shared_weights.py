"""Weights several modules read, at stage 3: the root unit (embeddings, final norm, head) freed as soon as
backward has read back what the forward saved of it, and a tied weight's uses split, each use's gradient going
into the weight's bucket as it comes (an embedding's as the rows its tokens picked).

`SharedWeights` is a part of Stage3Params (params.py) kept apart for reading; it uses the holder's `root`,
`grads`, `in_backward`, `_fetch` (schedule.py) and the state `_install_hooks` sets up there."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from hf_zero.zero.stage3.gradients import Stage3Gradients


class SharedWeights:
    """The shared-weight hooks of Stage3Params (see the module's docstring)."""

    def _install_shared_weight_hooks(self, model: nn.Module) -> None:
        self.root_saves_waiting = 0  # tensors of the root's buffers the forward saved and backward has not read
        self.tied_read: set[int] = set()  # tied root weights read by this forward (see _split_tied_uses)
        self.read_through: dict[tuple[int, str], nn.Parameter] = {}  # (module, name) reading through a split
        self.reading_rows: dict[int, _EmbeddingRows] = {}  # embedding modules in a forward reading rows
        if self.root is not None and self.root_frees_early:
            self._count_root_saves_in(model)
            self._split_tied_uses(model)

    def _count_root_saves_in(self, model: nn.Module) -> None:
        """The root (embeddings and head: in a language model, a vocabulary-sized tied weight) is used first in
        backward and, in GPT-2 and its kind, not again, yet it would stay gathered until its last gradient
        comes at the very end. So during the model's forward each tensor autograd saves is looked at; those
        that view the root's buffers are counted, and once backward has read all of them back the root is
        freed (free_early), at the next unit's backward gather. Reading one back after that gathers the
        root again first (its storage is refilled in place), so a model that does use it later gets its
        weights."""
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

        def enter(module: nn.Module, args: Any) -> None:
            if not self.in_backward:  # a new forward: the saves of one without a backward went with its graph
                self.root_saves_waiting = 0
                self.tied_read.clear()
                self.grads.rows_to_come.clear()
            context.__enter__()

        model.register_forward_pre_hook(enter)
        model.register_forward_hook(lambda m, a, out: context.__exit__(None, None, None), always_call=True)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if (self.root.gathered and tensor.layout == torch.strided and not isinstance(tensor, DTensor)
                and any(tensor.untyped_storage().data_ptr() == f.data.untyped_storage().data_ptr()
                        for f in self.root.flats)):
            self.root_saves_waiting += 1
            return _RootSaved(tensor)
        return tensor

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _RootSaved):
            return saved
        if not self.root.gathered:  # freed early yet read again
            self._fetch(self.root, backward=True)
        self.root_saves_waiting -= 1
        return saved.tensor

    def _split_tied_uses(self, model: nn.Module) -> None:
        """A root weight that several modules hold (a language model's vocabulary embedding and its head) gets
        a gradient from each. Autograd sums a leaf's gradients before any hook sees them: the head's, the first
        of backward, waits through the whole backward and is then summed out of place with the embedding's,
        three vocabulary-sized tensors at the end. Instead, in a forward that backward follows, the first
        module to read the weight reads the parameter itself and each later one reads it through _TiedUse,
        whose backward hands that use's gradient to the reducer (Stage3Gradients.contribute): kept as it
        came while the root is gathered, moved into the parameter's bucket once the root is freed. Then the
        end of backward holds the bucket and the embedding's gradient, not three. No collective is added:
        the bucket goes out in its turn, which every rank shares. The parameter's own gradient (its .grad,
        and hooks on it) is then only its first use's, so a parameter with a hook registered on it is not
        split.

        When that first use is an embedding lookup (nn.Embedding, the first module of a language model), its
        backward would make one more dense vocabulary-sized gradient, zero outside the rows the batch's
        tokens picked, just to add it into the bucket. It reads the weight through _EmbeddingRows instead,
        whose backward gives only those rows (Stage3Gradients.take_rows), summed by torch's own
        embedding backward in the same order: the bucket gets the same values, and the end of backward
        holds the bucket and min(tokens, vocabulary) rows (a size known before the ids are: `_distinct_rows`)."""
        root_params = {id(s.param) for flat in self.root.flats for s in flat.slices}
        holders: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in root_params:
                    holders.setdefault(id(p), []).append((module, name))
        for slots in holders.values():
            if len(slots) > 1:
                for module, name in slots:
                    module.register_forward_pre_hook(lambda m, a, n=name: self._read_tied(m, n))
                    module.register_forward_hook(lambda m, a, out, n=name: self._end_tied_read(m, n),
                                                 always_call=True)

    def _read_tied(self, module: nn.Module, name: str) -> None:
        param = module._parameters[name]
        # A hook registered on the parameter (a mask on some rows) is to see its whole gradient: not split then.
        if self.in_backward or param._backward_hooks or not (torch.is_grad_enabled() and param.requires_grad):
            return
        if id(param) not in self.tied_read:
            self.tied_read.add(id(param))
            if isinstance(module, nn.Embedding) and name == "weight" and module.max_norm is None \
                    and not module.sparse:
                rows = _EmbeddingRows(param, self.grads)
                rows.__enter__()
                self.grads.rows_to_come.add(param)
                self.reading_rows[id(module)] = rows
            return
        self.read_through[(id(module), name)] = param
        # Not setattr: a module's parameter slot takes only a Parameter. The forward hook puts it back.
        module._parameters[name] = _TiedUse.apply(param, self.grads)

    def _end_tied_read(self, module: nn.Module, name: str) -> None:
        rows = self.reading_rows.pop(id(module), None)
        if rows is not None:
            rows.__exit__(None, None, None)
        param = self.read_through.pop((id(module), name), None)
        if param is not None:
            module._parameters[name] = param


class _TiedUse(torch.autograd.Function):
    """A tied weight as one of its later uses in a forward reads it (Stage3Params._split_tied_uses): the same
    values, and in backward that use's gradient goes into the parameter's bucket instead of being summed with
    the others' first."""

    @staticmethod
    def forward(ctx: Any, param: nn.Parameter, grads: Stage3Gradients) -> torch.Tensor:
        ctx.param, ctx.grads = param, grads
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.grads.contribute(ctx.param, grad)
        return None, None


class _EmbeddingRows(TorchFunctionMode):
    """Entered around the forward of the embedding that reads a split tied weight first
    (Stage3Params._split_tied_uses): its lookup of that weight goes through _EmbeddingLookup."""

    def __init__(self, param: nn.Parameter, grads: Stage3Gradients) -> None:
        super().__init__()
        self.param, self.grads = param, grads

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            call = dict(zip(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                             "sparse"), args)) | kwargs
            if call["weight"] is self.param and call.get("max_norm") is None and not call.get("sparse"):
                padding_idx = call.get("padding_idx")
                if padding_idx is None:
                    padding_idx = -1
                elif padding_idx < 0:
                    padding_idx += self.param.shape[0]
                # The weight goes in as a new leaf: autograd would otherwise hold the parameter's own
                # AccumulateGrad until this backward, the last, when the root is freed (a gradient another use
                # gave it directly would then come only there).
                return _EmbeddingLookup.apply(call["input"], self.param.detach().requires_grad_(), padding_idx,
                                              bool(call.get("scale_grad_by_freq")), self)
        return func(*args, **kwargs)


class _EmbeddingLookup(torch.autograd.Function):
    """torch.embedding whose backward hands the weight's gradient to the reducer as the rows the tokens
    picked (Stage3Gradients.take_rows). The rows are torch's own embedding backward with the tokens
    renumbered over the distinct ones: each row is summed in the same order as in the dense gradient."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool,
                reading: _EmbeddingRows) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.scale_grad_by_freq, ctx.reading = padding_idx, scale_grad_by_freq, reading
        ctx.vocabulary = weight.shape[0]
        return torch.embedding(weight, ids, padding_idx, scale_grad_by_freq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        (ids,) = ctx.saved_tensors
        rows, renumbered = _distinct_rows(ids.reshape(-1), ctx.vocabulary)
        row_grads = torch.ops.aten.embedding_dense_backward(grad, renumbered.view(ids.shape), rows.numel(), -1,
                                                            ctx.scale_grad_by_freq)
        if ctx.padding_idx >= 0:  # the padding row gets nothing (a slot repeating it holds zeros anyway)
            row_grads.masked_fill_((rows == ctx.padding_idx).unsqueeze(-1), 0)
        ctx.reading.grads.take_rows(ctx.reading.param, rows, row_grads)
        return None, None, None, None, None


def _distinct_rows(ids: torch.Tensor, vocabulary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.unique(ids, return_inverse=True)` in a shape known before the values are: rows has min(tokens,
    vocabulary) slots, the distinct ids first in ascending order, each later slot repeating the smallest id, to
    which no token is renumbered (its gradient row is zeros). torch.unique's size depends on the values, so the host
    would wait for the device there, at the end of every backward."""
    sorted_ids, order = ids.sort(stable=True)
    starts_row = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts_row[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = starts_row.cumsum(0) - 1
    rows = sorted_ids[:1].expand(min(ids.numel(), vocabulary)).clone()
    rows[slot] = sorted_ids  # a row's tokens all write its id
    renumbered = torch.empty_like(slot)
    renumbered[order] = slot
    return rows, renumbered


class _RootSaved:
    """A tensor autograd saved that views the root unit's buffers (Stage3Params._pack)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
