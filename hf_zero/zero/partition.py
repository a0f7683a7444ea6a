"""Flat buffers and shards.

The parameters of one optimizer param group are laid end to end in one 1-D tensor, the
`FlatParamBuffer`. That buffer is cut into buckets of a fixed size (C_B, paper section 6.2), each a
multiple of the number of shards, and every bucket is split into equal chunks: rank r owns chunk r
of every bucket. So a bucket's gradient is reduced with one reduce-scatter whose output is exactly
the chunk this rank owns, and a bucket's parameters are rebuilt with one all-gather whose input is
that chunk, both in place. Ownership is still a flat 1/Nd of every parameter group (paper section
5.1), only interleaved per bucket so that communication can start before the backward pass ends.

With tensor parallelism a parameter is a DTensor; the buffers hold its local part (`local`), and
binding makes the buffer's view the DTensor's local part (`set_data`), and gradient views are wrapped
into DTensors of the parameter's mesh and placements (`wrap_like`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from hf_zero.runtime.device import allocate_storage, release_storage


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself for anything else)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_tp_replicated(param: torch.Tensor) -> bool:
    """Whether every tp rank holds the whole tensor (norms, embeddings, row-wise biases; anything without TP)."""
    return not isinstance(param, DTensor) or all(isinstance(p, Replicate) for p in param.placements)


def partitioned_frozen(param: torch.Tensor) -> bool:
    """Whether stage 3 partitions a parameter that does not require grad (a LoRA or prompt-tuning base) beside the
    trained ones: a floating weight, not a tensor-parallel DTensor (a frozen tp part stays whole on its tp rank and
    is saved whole with the module state, hf_zero/checkpoint/)."""
    return not param.requires_grad and param.is_floating_point() and not isinstance(param, DTensor)


def set_data(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """`param.data = tensor`; for a DTensor, `tensor` becomes its local part (`.data =` on a DTensor
    replaces the wrapper's own storage, which no computation reads). A DTensor's dtype is fixed when the
    wrapper is made, so one bound to a buffer of another dtype (the compute dtype's, under --bf16) becomes a new
    wrapper of that dtype, the Parameter object kept, as `.data =` changes a plain parameter's dtype: an fp32
    wrapper over bf16 parts made the checkpointed recomputation, which compares dtypes, fail."""
    if isinstance(param, DTensor) and param.dtype != tensor.dtype:
        torch.utils.swap_tensors(param, nn.Parameter(wrap_like(param, tensor), param.requires_grad))
    elif isinstance(param, DTensor):
        param._local_tensor = tensor
    else:
        param.data = tensor


def wrap_like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the local part of a DTensor shaped and placed as `param`, when `param` is one."""
    if not isinstance(param, DTensor):
        return tensor
    return DTensor.from_local(tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


@torch.no_grad()
def copy_cut_into(param: torch.Tensor, whole: torch.Tensor) -> None:
    """`param`'s local part takes its cut of `whole`, the tensor `param` stands for: cut as `distribute_tensor`
    cut it when the model was made parallel, locally, without communication."""
    if not is_tp_replicated(param):
        whole = distribute_tensor(whole.to(local(param).device), param.device_mesh, param.placements,
                                  src_data_rank=None).to_local()
    local(param).copy_(whole)


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The local part of `param.grad`, in the parameter's placements (a replicated bias of a row-wise
    layer can receive a pending-sum gradient: it is all-reduced over the tp group first)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(placements=param.placements)
    return local(grad)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ParamSlice:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class Bucket:
    """A fixed-size range [start, end) of a flat buffer, split into `num_shards` equal chunks."""

    index: int
    start: int
    end: int
    num_shards: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def chunk_numel(self) -> int:
        return self.numel // self.num_shards

    def owned_range(self, shard: int) -> tuple[int, int]:
        lo = self.start + shard * self.chunk_numel
        return lo, lo + self.chunk_numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls into a range of the flat buffer (a bucket, an owned chunk)."""

    slice: ParamSlice
    param_lo: int  # first element of the piece within the parameter
    param_hi: int
    range_lo: int  # where the piece starts within the range


class FlatParamBuffer:
    """The parameters of one param group laid end to end, padded, and cut into buckets.

    `bucket_numel=None` makes the whole buffer one bucket (stage 3 units).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], num_shards: int, dtype: torch.dtype,
                 bucket_numel: int | None = None, device: torch.device | None = None) -> None:
        assert named_params, "a FlatParamBuffer needs at least one parameter"
        self.num_shards = num_shards
        self.slices: list[ParamSlice] = []
        offset = 0
        for name, param in named_params:
            part = local(param)
            self.slices.append(ParamSlice(name, param, offset, part.numel(), part.shape))
            offset += part.numel()
        self.numel = offset
        self.padded_numel = round_up(offset, num_shards)
        step = self.padded_numel if bucket_numel is None else round_up(bucket_numel, num_shards)
        self.buckets = [
            Bucket(i, start, min(start + step, self.padded_numel), num_shards)
            for i, start in enumerate(range(0, self.padded_numel, step))
        ]
        self.pieces: list[list[Piece]] = [self.pieces_between(b.start, b.end) for b in self.buckets]
        # Uninitialised: pack_and_bind (or a gather) writes every element, padding included. Stage 3 releases it
        # at once, and zeros would have touched a whole unit's pages for nothing.
        self.data = torch.empty(self.padded_numel, dtype=dtype, device=device or named_params[0][1].device)
        # Each parameter's view of `data`, made once: releasing and allocating resize `data`'s storage in place,
        # so a view stays valid, and stage 3 binds the parameters again at every gather (two ops fewer each).
        self._views: dict[int, torch.Tensor] = {}

    def pieces_between(self, lo: int, hi: int) -> list[Piece]:
        """The parameter pieces inside flat elements [lo, hi) (padding belongs to no piece)."""
        pieces = []
        for s in self.slices:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                pieces.append(Piece(s, a - s.offset, b - s.offset, a - lo))
        return pieces

    def read_params(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fills `out` with flat elements [lo, hi) read from the parameters' current tensors (padding is 0)."""
        out.zero_()
        for piece in self.pieces_between(lo, hi):
            n = piece.param_hi - piece.param_lo
            out[piece.range_lo:piece.range_lo + n].copy_(
                local(piece.slice.param.detach()).reshape(-1)[piece.param_lo:piece.param_hi])

    def view_of(self, s: ParamSlice, flat: torch.Tensor | None = None) -> torch.Tensor:
        """The parameter's shape viewed inside `flat` (default: the parameter buffer, whose views are kept)."""
        if flat is not None:
            return flat[s.offset:s.offset + s.numel].view(s.shape)
        view = self._views.get(id(s))
        if view is None:
            view = self._views[id(s)] = self.data[s.offset:s.offset + s.numel].view(s.shape)
        return view

    def allocate_storage(self) -> None:
        allocate_storage(self.data)

    def release_storage(self, what: str = "the release of a flat buffer") -> None:
        release_storage(self.data, what)

    @torch.no_grad()
    def pack_and_bind(self) -> None:
        """Copies the parameters into the buffer and makes each parameter a view of it (M_D: one allocation).
        Each is copied into the view it is then bound to (`view_of` keeps it): three ops a parameter, which a GPU's
        launch queue and a simulated 175B set-up both pay."""
        self.data[self.numel:].zero_()  # the padding
        for s in self.slices:
            self.view_of(s).copy_(local(s.param))
        self.bind()

    def bind(self) -> None:
        """Makes each parameter a view of the buffer as it is."""
        for s in self.slices:
            set_data(s.param, self.view_of(s))

    def moved_params(self) -> list[str]:
        """Parameters no longer viewing this buffer: something (model.to(), param.data = ...) replaced their
        storage after the engine bound them, so the optimizer would update memory the model does not use."""
        base = self.data.data_ptr()
        return [s.name for s in self.slices
                if local(s.param).data_ptr() != base + s.offset * self.data.element_size()]

    def owned_chunk(self, bucket: Bucket, shard: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        lo, hi = bucket.owned_range(shard)
        return (self.data if flat is None else flat)[lo:hi]


def model_order(model: nn.Module) -> dict[nn.Parameter, int]:
    """Each parameter's place in the order the model registers them (a tied one counts once, first)."""
    return {p: i for i, p in enumerate(model.parameters())}
