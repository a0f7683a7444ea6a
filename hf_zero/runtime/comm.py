"""The one door for collectives (`Communicator`): every collective the engine issues goes through it, so that the
ledger sees it (hf_zero/runtime/ledger.py: volumes as the ZeRO paper counts them, and where the bytes travel) and
the ranks' sequences are compared as they go (hf_zero/runtime/sequence_check.py). The device layer orders each
collective with the streams (`collective_issued`); a timeline that runs asynchronous work late or early (the
simulated GPU) runs an asynchronous collective at its wait, or finished when issued.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.runtime import groups
from hf_zero.runtime.device import (
    HOST,
    NO_WORK,
    Event,
    collective_issued,
    compute_device,
    quiet,
    record_event,
    timeline,
)
from hf_zero.runtime.groups import rank, world_size
from hf_zero.runtime.launch import note_collective, start_heartbeat
from hf_zero.runtime.ledger import SPANS, Ledger, link_bytes
from hf_zero.runtime.sequence_check import (
    CollectiveError,
    CollectiveMismatch,
    has_finished,
    issued_for,
    named,
    purpose_now,
    sequence_of,
)
from hf_zero.settings.environment import processes_per_node

# Imported from here by the modules that issue collectives, besides the Communicator itself.
__all__ = ["SPANS", "CollectiveError", "CollectiveMismatch", "Communicator", "Ledger", "issued_for", "link_bytes",
           "rank", "world_size"]

# How often the ranks meet while rank 0 works alone (Communicator.from_rank_0): well inside the shortest collective
# timeout (TIMEOUT_BOUNDS in hf_zero/settings/environment.py), a rank's scheduling delay besides.
WAIT_POLL_SECONDS = 0.25

# gloo collectives of at most this many bytes are one call (Communicator.pieces_above_bytes): on a 2-core CPU one
# call took 0.87-0.98x the host CPU of the per-rank pieces from 256 bytes to 256 KiB on 2 ranks and 0.81-0.83x on 4,
# but 1.02x at 1 MiB on 2 (benchmarks/bench_gloo_pieces.py); and its temporary stays small beside a stage-3 unit.
GLOO_WHOLE_BYTES = 256 * 1024


class _Done:
    """Work handle of a collective that finished immediately (one process)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Named:
    """A collective's work handle whose wait() names the collective if it fails (and the mismatch, `parted`, if
    a partner stopped before a different one). As NCCL's, its wait() makes the stream the caller queues on wait
    for the collective's end (`done`), not the host."""

    def __init__(self, work: Any, what: Callable[[], str], parted: Callable[[], None], done: Event,
                 on_gloo: bool) -> None:
        self.work, self.what, self.parted, self.done, self.on_gloo = work, what, parted, done, on_gloo

    def wait(self) -> bool:
        with quiet():
            finished = named(self.what, self.work.wait, self.parted)
        self.done.wait()
        return finished

    def is_completed(self) -> bool:
        return has_finished(self.work, self.on_gloo)


class _Pieces:
    """One collective made of several calls (gloo's per-rank pieces: Communicator.pieces_above_bytes; gloo's one
    all-gather per tensor of a small gather of several; NCCL's grouped calls), or of the one all-reduce a small
    reduce-scatter is on gloo: waits on all of them, then runs `finish`. Without async_op it has already waited.
    `on_gloo`: the works are gloo's (see Communicator.on_gloo)."""

    def __init__(self, works: list, finish: Callable[[], Any], async_op: bool, on_gloo: bool = False) -> None:
        self.works, self.finish, self.done, self.on_gloo = works, finish, False, on_gloo
        if not async_op:
            self.wait()

    def wait(self) -> bool:
        if not self.done:
            for work in self.works:
                work.wait()
            self.finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or all(has_finished(work, self.on_gloo) for work in self.works)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


class _Recorded:
    """The handle of a one-rank collective, done on the stream it was issued from: as NCCL's, its wait() makes the
    waiting stream wait for it (a gather issued on the copy stream is read on the compute stream)."""

    def __init__(self, done: Event) -> None:
        self.done = done

    def wait(self) -> bool:
        self.done.wait()
        return True

    def is_completed(self) -> bool:
        return self.done.query()


def _copy_locally(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> _Recorded:
    """With one rank, reduce-scatter, all-gather and all-to-all all leave each output equal to its input."""
    for output, input in zip(outputs, inputs):
        if not _same_memory(output, input):
            output.copy_(input)
    return _Recorded(record_event(outputs[0].device) if outputs else NO_WORK)


class Communicator:
    """torch.distributed collectives over one process group, each recorded in a Ledger, with where its bytes
    travel (`link_bytes`) for `ranks_per_node` (default: torchrun's LOCAL_WORLD_SIZE)."""

    def __init__(self, ledger: Ledger, group: dist.ProcessGroup | None = None,
                 ranks_per_node: int | None = None) -> None:
        self.ledger = ledger
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.ranks_per_node = ranks_per_node or processes_per_node(world_size())
        self.global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if dist.is_initialized() \
            else [0]
        self.group_name = f"the group of ranks {self.global_ranks}"
        # Where tensors must be for this group's collectives: NCCL reduces on the GPU, gloo on the host.
        backend = dist.get_backend(group) if dist.is_initialized() else None
        self.device = compute_device() if backend == "nccl" else HOST
        # gloo's all_gather_single and reduce_scatter_single copy the whole output (input) into a temporary of
        # its size first: 48 MiB for a 48 MiB stage-3 unit, one per collective in flight. Broadcasting each
        # rank's slice in place and reducing each chunk to its owner in place move the same bytes with none
        # (measured: 0 and 4 MiB), in one gloo collective per rank. A collective of at most this many bytes is
        # one gloo call instead, its temporary that small: on a CPU each gloo call costs its host about as much
        # as the bytes of a small collective. None: always the single calls (NCCL's need no temporary).
        self.pieces_above_bytes = GLOO_WHOLE_BYTES if backend == "gloo" else None
        # gloo's works say they have finished through their futures (has_finished); NCCL's and the fake group's
        # futures are done once issued, so theirs answer through is_completed().
        self.on_gloo = backend == "gloo"
        # torch's fake process group (a plan's simulated world) moves nothing: every rank is taken to have sent
        # what this one sends.
        self.simulated = backend == "fake"
        self.subgroups: dict[tuple[tuple[int, ...], ...], Communicator] = {}
        if self.world_size > 1:
            start_heartbeat()

    def _record(self, op: str, tensor: torch.Tensor) -> None:
        """Counts `tensor` (the collective's buffer, as `link_bytes` takes it) in the ledger."""
        nbytes = tensor.numel() * tensor.element_size()
        sent, paper_cross_node = link_bytes(op, nbytes, self.global_ranks, rank(), self.ranks_per_node)
        volume = 2 * tensor.numel() if op == "all_reduce" else tensor.numel()
        self.ledger.record(op, volume, tensor.element_size(), sent, paper_cross_node)

    def _launch(self, op: str, tensor: torch.Tensor | None, launch: Callable[[], Any], async_op: bool = False,
                reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()) -> Any:
        """Issues one collective through `launch`; its work handle, if any, names it should it fail. An
        asynchronous one (`async_op`) that `reads` and `writes` those tensors runs as late (at its wait) or as early
        (finished when this returns) as a GPU may run it, where the device layer's timeline runs work so (the
        simulated GPU's "late" and "early")."""
        elements = "" if tensor is None else \
            f" ({tensor.numel():,} {str(tensor.dtype).removeprefix('torch.')} elements)"
        purpose = purpose_now()
        number = 1  # until issued: the group's sequence is made at its first collective

        def what() -> str:
            return f"rank {rank()}: {op} #{number} of its group of {self.world_size}{elements}{purpose}"

        with quiet():  # the comparison's own small host tensors, over gloo groups of its own: not device work
            sequence = named(what, lambda: sequence_of(self.global_ranks))
            number, predicted = sequence.issue(f"{op}{elements}{purpose}", what)
            # One the schedule did not predict is compared before it is launched: gloo starts a collective as
            # it is issued, and one that pairs with another of a different size aborts the process in gloo's
            # transport thread; NCCL's would hang or mix two tensors.
            if not predicted:
                sequence.confirm(number)
        note_collective(what)
        done = collective_issued(self.group_name, list(reads), list(writes), what())
        line = timeline()
        if async_op and line.late:  # launched at its wait, as late as a GPU may run it
            with quiet():
                held = line.held_back(launch, list(reads), list(writes), what)
                return _Named(held, what, sequence.raise_if_parted, done, self.on_gloo)
        with quiet():
            work = named(what, launch, sequence.raise_if_parted)
            if async_op and line.early:
                named(what, work.wait, sequence.raise_if_parted)
        if not async_op:
            done.wait()
        return None if work is None else _Named(work, what, sequence.raise_if_parted, done, self.on_gloo)

    def all_reduce_(self, tensor: torch.Tensor, async_op: bool = False):
        if self.world_size == 1:
            return _Done()
        self._record("all_reduce", tensor)
        return self._launch("all_reduce", tensor,
                            lambda: dist.all_reduce(tensor, group=self.group, async_op=async_op),
                            async_op, reads=[tensor], writes=[tensor])

    def reduce_scatter_(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Sums `input` over ranks; this rank receives its 1/world_size part in `output` (may alias input)."""
        if self.world_size == 1:
            return _copy_locally([output], [input])
        self._record("reduce_scatter", input)
        if self.pieces_above_bytes is None:
            self.ledger.count("reduce-scatter launches")
            return self._launch("reduce_scatter", input, lambda: dist.reduce_scatter_single(
                output, input, group=self.group, async_op=async_op), async_op, reads=[input], writes=[output])
        in_pieces = self._in_pieces([input])
        n = output.numel()
        mine = input[self.rank * n:(self.rank + 1) * n]

        def launch() -> _Pieces:
            # Large, one in-place reduce of each chunk to its owner; small, one all-reduce in place (gloo's
            # reduce_scatter_single has no future to poll: has_finished). Either leaves the other chunks of `input`
            # spent.
            works = [dist.reduce(input[r * n:(r + 1) * n], group_dst=r, group=self.group, async_op=True)
                     for r in range(self.world_size)] if in_pieces else \
                [dist.all_reduce(input, group=self.group, async_op=True)]
            self.ledger.count("reduce-scatter launches", len(works))
            return _Pieces(works, lambda: None if _same_memory(output, mine) else output.copy_(mine), async_op,
                           self.on_gloo)

        return self._launch("reduce_scatter", input, launch, async_op, reads=[input], writes=[output])

    def all_gather_(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenates every rank's `input` into `output` (input may be this rank's slice of output)."""
        return self.all_gather_coalesced_([output], [input], async_op)

    def all_gather_coalesced_(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool = False):
        """`all_gather_` of each pair, issued as one launch where the backend can group them: one NCCL group
        for a unit's flat buffers or for the post-step buckets, instead of a launch and its latency each.
        On gloo, outputs of more than `pieces_above_bytes` in all are gathered in place, one broadcast per rank
        and pair (no temporary beats one launch there); smaller ones are one all-gather call per pair."""
        if self.world_size == 1:
            return _copy_locally(outputs, inputs)
        for output in outputs:
            self._record("all_gather", output)
        op = "all_gather" if len(outputs) == 1 else f"all_gather of {len(outputs)} tensors"
        if not self._in_pieces(outputs):
            if len(outputs) == 1:
                self.ledger.count("all-gather launches")
                return self._launch(op, outputs[0], lambda: dist.all_gather_single(
                    outputs[0], inputs[0], group=self.group, async_op=async_op), async_op, inputs, outputs)

            # Never gloo's own grouped all-gather (torch's coalescing manager on gloo): tensors of two dtypes came
            # back wrong from it, and the suite's only two aborts ("free(): invalid pointer") were in stage-3 runs
            # that used it, one inside it (docs/testing.md). The fake group has no grouped all-gather: it counts
            # NCCL's launch.
            one_call_each = self.pieces_above_bytes is not None  # gloo, in its own call shapes
            self.ledger.count("all-gather launches", len(outputs) if one_call_each else 1)

            def launch_grouped() -> _Pieces:
                if one_call_each or self.simulated:
                    return _Pieces([dist.all_gather_single(output, input, group=self.group, async_op=True)
                                    for output, input in zip(outputs, inputs)], lambda: None, async_op, self.on_gloo)
                with dist._coalescing_manager(self.group, async_ops=async_op) as grouped:
                    for output, input in zip(outputs, inputs):
                        dist.all_gather_single(output, input, group=self.group)
                return _Pieces(grouped.works, lambda: None, async_op, self.on_gloo)

            return self._launch(op, outputs[0], launch_grouped, async_op, inputs, outputs)

        def launch_pieces() -> _Pieces:
            for output, input in zip(outputs, inputs):
                mine = output[self.rank * input.numel():(self.rank + 1) * input.numel()]
                if not _same_memory(mine, input):
                    mine.copy_(input)
            works = [dist.broadcast(output[r * input.numel():(r + 1) * input.numel()], group_src=r,
                                    group=self.group, async_op=True)
                     for output, input in zip(outputs, inputs) for r in range(self.world_size)]
            self.ledger.count("all-gather launches", len(works))
            return _Pieces(works, lambda: None, async_op, self.on_gloo)

        return self._launch(op, outputs[0], launch_pieces, async_op, inputs, outputs)

    def _in_pieces(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a collective over `tensors` (its outputs, or a reduce-scatter's input) goes in per-rank pieces:
        on gloo, when they are large."""
        return (self.pieces_above_bytes is not None
                and sum(t.numel() * t.element_size() for t in tensors) > self.pieces_above_bytes)

    def all_to_all_(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Rank r receives the r-th of every rank's equal parts of `input`, in rank order, in `output`."""
        if self.world_size == 1:
            return _copy_locally([output], [input])
        self._record("all_to_all", input)
        return self._launch("all_to_all", input,
                            lambda: dist.all_to_all_single(output, input, group=self.group, async_op=async_op),
                            async_op, reads=[input], writes=[output])

    def subgroup(self, ranks_of_each: list[list[int]]) -> "Communicator":
        """A Communicator over the subgroup, among `ranks_of_each` (ranks of this group, covering it once),
        that holds this rank. Every rank must call it with the same list: creating groups is collective. The
        same list again gets the same Communicator (hpZ over a whole node and qgZ's node group are one group)."""
        if self.world_size == 1:
            return self
        key = tuple(tuple(ranks) for ranks in ranks_of_each)
        if key not in self.subgroups:
            mine = groups.subgroup(self.group, ranks_of_each)
            self.subgroups[key] = Communicator(self.ledger, mine, self.ranks_per_node)
        return self.subgroups[key]

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Used once at start-up to make every rank begin from rank 0's weights, as DDP does."""
        if self.world_size > 1:
            self._launch("broadcast", tensor, lambda: dist.broadcast(
                tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group),
                reads=[tensor], writes=[tensor])

    def any_rank_(self, flags: torch.Tensor) -> None:
        """Sets each flag (uint8) to 1 where any rank has it set. A control message (which parameters got a
        gradient somewhere), not recorded: the ledger counts model-state traffic."""
        if self.world_size > 1:
            self._launch("all_reduce (max)", flags,
                         lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group),
                         reads=[flags], writes=[flags])

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small, picklable): control messages such as "this rank's save failed".
        Not recorded: the ledger counts model-state traffic, the quantity the paper accounts for."""
        if self.world_size == 1:
            return [obj]
        if self.simulated:
            self._launch("all_gather_object", None, lambda: None)
            return [obj] * self.world_size
        gathered: list[Any] = [None] * self.world_size
        self._launch("all_gather_object", None, lambda: dist.all_gather_object(gathered, obj, group=self.group))
        return gathered

    def from_rank_0(self, action: Callable[[], Any], what: str, error: type[Exception] = RuntimeError,
                    limit: float | None = None) -> Any:
        """Runs `action` (which issues no collectives) on rank 0 alone and returns its result on every rank; where it
        failed, or ran past `limit` seconds, every rank raises `error` with its message. The collective timeout bounds
        a wait, not the work: rank 0 runs `action` in a thread while every rank meets it in a one-byte all-reduce each
        WAIT_POLL_SECONDS, so that no rank waits in one collective for the whole of it, and a rank 0 that stops
        answering is still found within one timeout. (A C extension that holds the GIL longer than the timeout would
        still stop rank 0's meetings.) An action past its limit is not stopped, only no longer waited for: the
        process is to end on the error. With one rank, or in a simulated world, this rank runs it, without a limit."""
        if self.world_size == 1 or self.simulated:
            return self.agree(action, what, error)[0]
        outcome: dict[str, Any] = {}
        finished = threading.Event()

        def run() -> None:
            try:
                outcome["result"] = action()
            except Exception as e:  # raised on every rank below
                outcome["raised"] = e
            finally:
                finished.set()

        if self.rank == 0:
            threading.Thread(target=run, name=what, daemon=True).start()
            ends = None if limit is None else time.monotonic() + limit
        done = torch.zeros(1, dtype=torch.uint8, device=self.device)
        with issued_for(f"waiting for rank 0, {what}"):
            while not done.item():
                stop = self.rank == 0 and (finished.wait(WAIT_POLL_SECONDS) or
                                           (ends is not None and time.monotonic() > ends))
                done.fill_(stop)
                self.any_rank_(done)

        def rank_0s_outcome() -> Any:
            if not finished.is_set():
                raise TimeoutError(f"took longer than {limit:g} s")
            if "result" in outcome:
                return outcome["result"]
            raise outcome.get("raised", RuntimeError("ended without a result"))  # a SystemExit in the thread

        return self.agree(lambda: rank_0s_outcome() if self.rank == 0 else None, what, error)[0]

    def agree(self, action: Callable[[], Any], what: str, error: type[Exception] = RuntimeError) -> list[Any]:
        """Runs `action` on every rank and returns every rank's result. If it failed on any rank, every rank
        raises `error` with the first failing rank's message, so that no rank goes on into a collective the
        others never join."""
        try:
            result, failure = action(), None
        except Exception as e:  # reported to every rank below, then raised
            result, failure = None, f"{type(e).__name__}: {e}"
        outcomes = self.all_gather_object((result, failure))
        failed = [(rank, text) for rank, (_, text) in enumerate(outcomes) if text is not None]
        if failed:
            raise error(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
        return [res for res, _ in outcomes]
