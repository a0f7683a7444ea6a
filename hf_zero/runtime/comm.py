"""Collectives and the ledger that counts them.

Every collective the engine issues goes through this file so that the ledger sees it. Volumes are
counted as the ZeRO paper counts them (section 7): an all-reduce over n elements moves 2n, a
reduce-scatter over an n-element input moves n, an all-gather into an n-element output moves n.
With one process (or no process group) the collectives are local copies and count nothing.

Where the bytes travel is counted twice (`link_bytes`): what this rank sends over its links, intra-node or
inter-node, under the algorithms NCCL runs across nodes (a ring in rank order for all-gather, reduce-scatter
and all-reduce; direct sends for all-to-all), and its node's cross-node volume as the ZeRO++ paper counts it
(a flat collective's whole buffer once per node, an all-to-all's whole input per rank).

Every rank must issue the same collectives in the same order; `_Sequence` checks that they do, as they go, and
stops every rank naming the first collective where they part (with what it was for: `issued_for`).
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.runtime.device import (
    HOST,
    NO_WORK,
    Event,
    collective_issued,
    compute_device,
    quiet,
    record_event,
)
from hf_zero.runtime.launch import (
    collective_timeout,
    note_collective,
    other_ranks_report,
    start_heartbeat,
)
from hf_zero.settings import environment
from hf_zero.settings.environment import processes_per_node
from hf_zero.testing.simulated_gpu import (
    PendingCopyError,
    overlaps,
    poison,
    same_bytes,
    simulation,
)

MODEL_STATE_CATEGORIES = ("parameters", "gradients", "optimizer_states", "buffers")
SPANS = ("intra-node", "inter-node")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Done:
    """Work handle of a collective that finished immediately (one process)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CollectiveError(RuntimeError):
    """A collective that did not complete on this rank, named with its group and its number there: the
    backend's own error (gloo: "Timed out waiting 30000ms for recv operation to complete") names neither,
    and the numbers tell a collective that ranks issued in different orders."""


def _named(what: Callable[[], str], call: Callable[[], Any], parted: Callable[[], None] | None = None) -> Any:
    """call(); a RuntimeError it raises becomes a CollectiveError naming the collective (`what()`, formatted
    only then: collectives are issued by the hundred per step) and what the other ranks' heartbeats say, or the
    mismatch `parted()` raises (a partner that stopped before a different collective: _Sequence)."""
    try:
        return call()
    except CollectiveError:
        raise
    except RuntimeError as e:
        if parted is not None:
            parted()
        described = what()
        raise CollectiveError(f"{described} did not complete: {e}{other_ranks_report()}"
                              f"{FORWARD_ON_SOME_RANKS if 'forward gather of' in described else ''}") from e


# A stage-3 forward gathers from every rank: one that some ranks run alone waits for partners that never come.
FORWARD_ON_SOME_RANKS = (". At ZeRO stage 3 every rank must run each forward: generate() on some ranks only "
                         "(rank 0, say) needs synced_gpus=True and a call on every rank (ZeroSeq2SeqTrainer passes "
                         "it), and evaluation or prediction must run on every rank")


class CollectiveMismatch(CollectiveError):
    """The ranks issued different collectives at the same place in their sequence on one group."""


class _Named:
    """A collective's work handle whose wait() names the collective if it fails (and the mismatch, `parted`, if
    a partner stopped before a different one). As NCCL's, its wait() makes the stream the caller queues on wait
    for the collective's end (`done`), not the host."""

    def __init__(self, work: Any, what: Callable[[], str], parted: Callable[[], None], done: Event) -> None:
        self.work, self.what, self.parted, self.done = work, what, parted, done

    def wait(self) -> bool:
        with quiet():
            finished = _named(self.what, self.work.wait, self.parted)
        self.done.wait()
        return finished

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _Pieces:
    """One collective made of one per rank (Communicator.per_rank_pieces): waits on all of them, then runs
    `finish`. Without async_op it has already waited."""

    def __init__(self, works: list, finish: Callable[[], Any], async_op: bool) -> None:
        self.works, self.finish, self.done = works, finish, False
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
        return self.done or all(work.is_completed() for work in self.works)


# What the engine's collectives are for, while it says so (`issued_for`): part of what the ranks compare.
_purpose: list[str] = []


@contextlib.contextmanager
def issued_for(text: str) -> Iterator[None]:
    """The collectives issued inside are for `text` ("the forward gather of unit 'h.3'"): the ranks compare it
    with the operation and size, and a mismatch names it."""
    _purpose.append(text)
    try:
        yield
    finally:
        _purpose.pop()


# A collective's exchange of hashes: its number, the work, every rank's hash, its description, the description the
# schedule predicted (None: none yet), and what() names it by.
_Exchange = tuple[int, Any, torch.Tensor, str, str | None, Callable[[], str]]


class _Sequence:
    """The collectives the ranks of one group issue, compared as they go. With each collective every rank sends
    a hash of its description (operation, size, dtype and what it is for; 8 bytes) to the others over a gloo
    group of their own, in the background. A collective that pairs with a different one on another rank (a
    stage-3 unit that some ranks' forwards skip, at any step) would otherwise wait until the collective timeout,
    abort the process (gloo, sizes that differ), or mix two tensors without an error (equal sizes).

    No rank launches a collective that can pair with a different one. Each collective is either the one the
    schedule predicts (`predicted`: what followed the previous collective the last time it was issued) or
    launched only once every rank's hash for it has arrived and agrees (`confirm`, one round trip). The
    prediction is a function of the collectives issued so far, which agree on every rank by induction, so it is
    the same on every rank: where two ranks each issue the predicted collective they issue the same one, and a
    rank that issues another waits for the hashes, finds the predicted one's among them and stops, naming it,
    before its own can pair with it. A training loop repeats its schedule, so after its first step it pays no
    round trip at all; a new phase (the first step, evaluation, generation) pays one per collective until its
    schedule has been seen. When the hashes differ every rank raises, naming each rank's collective: from the
    prediction for a rank that issued it (that rank may already wait in it), else sent over a second gloo group
    when every rank is comparing. On gloo, a rank left waiting in a collective its partner stopped before names
    the mismatch too when its wait fails (`raise_if_parted`): its partner's hash had arrived (an NCCL wait does
    not fail; the rank that stopped names it). Hashes that arrive for predicted collectives are compared as they
    land, so a rank also stops at its next collective. Once the ranks have parted, or an exchange failed, every
    later collective of the group raises the same error: the hashes would no longer pair with their collectives.
    torch's TORCH_DISTRIBUTED_DEBUG=DETAIL compares operation and shapes before every collective, synchronously,
    and not what each one is for. Collectives are issued when the program issues them, never later: torch issues its
    own on the same groups (DTensor's tensor-parallel all-reduces), and a collective held back would meet them
    in another order on each rank. One sequence per group of ranks, shared by its Communicators: their
    collectives interleave on the group, and so are numbered together. HF_ZERO_CHECK_COLLECTIVES=0 turns the
    comparison off (`checking`)."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.world_size, self.issued = len(ranks), 0
        self.me = list(ranks).index(dist.get_rank())
        self.checking = environment.check_collectives()
        if self.checking:
            timeout = collective_timeout()
            groups = [dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                                     **({} if timeout is None else {"timeout": timeout})) for _ in range(2)]
            self.hashes, self.descriptions = groups
        # What followed each description the last time it was issued, and the one issued last: the prediction.
        self.successor: dict[str, str] = {}
        self.described: dict[int, str] = {}  # each hash this rank sent, by its description: a mismatch names them
        self.previous: str | None = None
        self.parted: CollectiveError | None = None  # the error every later collective raises again
        self.exchanges: deque[_Exchange] = deque()  # not yet compared

    def issue(self, description: str, what: Callable[[], str]) -> tuple[int, bool]:
        """Numbers the next collective and starts sending the hash of its description to the other ranks.
        Returns its number and whether it is the predicted one, which may be launched without waiting."""
        if self.parted is not None:
            raise type(self.parted)(str(self.parted)) from self.parted
        self._compare_arrived()
        self.issued += 1
        expected = self.successor.get(self.previous)
        if self.previous is not None:
            self.successor[self.previous] = description
        self.previous = description
        if self.checking:
            digest = _digest(description)
            self.described[digest] = description
            everyones = torch.empty(self.world_size, dtype=torch.int64)
            work = dist.all_gather_single(everyones, torch.tensor([digest]), group=self.hashes, async_op=True)
            self.exchanges.append((self.issued, work, everyones, description, expected, what))
            if len(self.exchanges) > _MOST_IN_FLIGHT:
                self.confirm(self.exchanges[0][0])
        return self.issued, description == expected

    def _compare_arrived(self) -> None:
        """Compares the exchanges whose hashes have all arrived, in order, without waiting."""
        while self.exchanges and self.exchanges[0][1].is_completed():
            self._take(self.exchanges.popleft())

    def confirm(self, number: int) -> None:
        """Every rank issued the same collectives up to the `number`-th, or every rank raises naming the first
        that differs."""
        while self.exchanges and self.exchanges[0][0] <= number:
            self._take(self.exchanges.popleft())

    def _take(self, exchange: _Exchange) -> None:
        """Waits for an exchange and compares it; what it raises, every later collective raises (`parted`)."""
        try:
            _named(exchange[-1], exchange[1].wait)
            self._compare(exchange)
        except CollectiveError as error:
            self.parted = error
            raise

    def raise_if_parted(self) -> None:
        """Raises the mismatch among the hashes arrived so far, if any: called when a collective failed."""
        try:
            self._compare_arrived()
        except CollectiveMismatch:
            raise
        except CollectiveError:
            pass  # the exchange failed with the collective: no hash arrived to compare

    def _compare(self, exchange: _Exchange) -> None:
        issued, _, everyones, description, expected, what = exchange
        if bool((everyones == everyones[0]).all()):
            return
        followed = [expected if expected is not None and h == _digest(expected) else None for h in everyones.tolist()]
        if any(followed):  # those ranks did not wait, and may already wait in the predicted collective
            said = [description if r == self.me else
                    followed[r] or self.described.get(h, "a collective other than the schedule's")
                    for r, h in enumerate(everyones.tolist())]
        else:  # every rank waits here: each says what it issued
            said = [None] * self.world_size
            _named(what, lambda: dist.all_gather_object(said, description, group=self.descriptions))
        each = "; ".join(f"rank {r}: {text}" for r, text in enumerate(said))
        raise CollectiveMismatch(
            f"the ranks issued different collectives as collective #{issued} of their group of "
            f"{self.world_size} ({each}): each would wait for a partner that never comes, or, with equal "
            f"sizes, mix two tensors. Every rank must issue the same collectives in the same order. At ZeRO "
            f"stage 3 the cause is a unit that some ranks' forwards skip (an expert made a unit of its own, "
            f"a layer some ranks drop): make the units modules every rank runs (name the blocks that hold "
            f"the experts, not the experts, in unit_module_classes: --zero_unit_module_classes), or train "
            f"at zero_stage 2 (--zero_stage 2)"
            f"{FORWARD_ON_SOME_RANKS if 'forward gather of' in each else ''}")


# Exchanges of predicted collectives left to arrive in the background before the oldest is waited on.
_MOST_IN_FLIGHT = 4096


def _digest(description: str) -> int:
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=7).digest(), "little")


# Keyed by the default group too (held, so never mistaken for a later one): a new process group starts anew.
_sequences: dict[tuple[Any, tuple[int, ...]], _Sequence] = {}


def _sequence_of(ranks: Sequence[int]) -> _Sequence:
    """The sequence of the group of `ranks` (global ranks), made at the group's first collective, which every
    member issues (making its gloo groups is collective among them)."""
    key = (dist.group.WORLD, tuple(ranks))
    if key not in _sequences:
        _sequences[key] = _Sequence(ranks)
    return _sequences[key]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


class _Late:
    """Simulation "late" (hf_zero.runtime.device): an asynchronous collective that runs only when waited on, as late as
    NCCL may finish it (NCCL's wait() does not block the host, so a reader that skips it reads whatever the
    buffer held). Until then its outputs hold poison, and its inputs must keep the values they had when it was
    issued; an input that shares memory with an output (an in-place all-gather's own part, an all-reduce) gets
    them back before it runs."""

    def __init__(self, launch: Callable[[], Any], reads: list[torch.Tensor], writes: list[torch.Tensor],
                 what: Callable[[], str]) -> None:
        self.launch, self.what, self.done = launch, what, False
        self.reads = [(t, t.detach().clone()) for t in reads]
        for output in writes:
            poison(output)
        self.poisoned = [(t, t.detach().clone()) for t in writes]

    def wait(self) -> bool:
        if not self.done:
            for tensor, issued in self.reads:
                shared = any(overlaps(tensor, output) for output, _ in self.poisoned)
                if not shared and not same_bytes(tensor, issued):
                    raise PendingCopyError(f"{self.what()}: an input was written while the collective could still "
                                           f"read it: wait on the collective first")
            for output, poisoned in self.poisoned:
                if not same_bytes(output, poisoned):
                    raise PendingCopyError(f"{self.what()}: an output was written while the collective could "
                                           f"still fill it: wait on the collective first")
            for tensor, issued in self.reads:
                tensor.copy_(issued)
            self.launch().wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


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


@dataclass
class Ledger:
    """What this rank sent per optimizer step, what it held in flight, and what model state it holds.

    `comm_elements` / `comm_bytes` accumulate during the current step, as do `events` (counts, such as
    stage 3's unit all-gathers) and `peaks` (the most of something held at once, such as gathered units);
    `close_step` moves them to `last_step_*`. `state_bytes` is refreshed by the engine.
    """

    comm_elements: Counter = field(default_factory=Counter)
    comm_bytes: Counter = field(default_factory=Counter)
    last_step_elements: dict[str, int] = field(default_factory=dict)
    last_step_bytes: dict[str, int] = field(default_factory=dict)
    # What this rank sent over its links, by SPANS, and its part of its node's cross-node volume as the ZeRO++
    # paper counts it (`link_bytes`); the node's volume is the sum over its ranks.
    span_bytes: Counter = field(default_factory=Counter)
    last_step_span_bytes: dict[str, int] = field(default_factory=dict)
    paper_cross_node_bytes: int = 0
    last_step_paper_cross_node_bytes: int = 0
    events: Counter = field(default_factory=Counter)
    last_step_events: dict[str, int] = field(default_factory=dict)
    held: Counter = field(default_factory=Counter)  # now
    peaks: Counter = field(default_factory=Counter)  # this step's most of each
    last_step_peaks: dict[str, int] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)
    # Stage 3: where each weight that several units use lives (its name -> "root unit (used by ...)").
    shared_weights: dict[str, str] = field(default_factory=dict)

    def record(self, op: str, elements: int, element_size: int, sent: dict[str, int], paper_cross_node: int) -> None:
        """A collective of `elements` (the paper's volume) that sent `sent` bytes by span from this rank."""
        self.comm_elements[op] += elements
        self.comm_bytes[op] += elements * element_size
        self.span_bytes.update(sent)
        self.paper_cross_node_bytes += paper_cross_node

    def count(self, event: str, times: int = 1) -> None:
        self.events[event] += times

    def hold(self, what: str, amount: int) -> None:
        """`amount` more of `what` is held now (less when negative); the step's peak follows."""
        self.held[what] += amount
        self.peaks[what] = max(self.peaks[what], self.held[what])

    def close_step(self) -> None:
        self.last_step_elements = dict(self.comm_elements)
        self.last_step_bytes = dict(self.comm_bytes)
        self.last_step_span_bytes = {span: n for span, n in self.span_bytes.items() if n}
        self.span_bytes.clear()
        self.last_step_paper_cross_node_bytes, self.paper_cross_node_bytes = self.paper_cross_node_bytes, 0
        self.last_step_events = dict(self.events)
        self.last_step_peaks = dict(self.peaks)
        self.comm_elements.clear()
        self.comm_bytes.clear()
        self.events.clear()
        self.peaks = Counter(self.held)  # the next step's peak starts from what is held across the step

    def scalars(self) -> dict[str, int]:
        """The model states this rank holds and the bytes it sent over each span of links in the last step, in
        bytes, under keys for a metrics logger (the Trainer's logs, hence tensorboard and the rest of --report_to):
        zero/held_bytes/<category> and zero/sent_bytes/<span>. Every key is present, zero when nothing was sent,
        so that each makes one unbroken curve."""
        held = {f"zero/held_bytes/{k}": self.state_bytes.get(k, 0) for k in MODEL_STATE_CATEGORIES}
        sent = {f"zero/sent_bytes/{span}": self.last_step_span_bytes.get(span, 0) for span in SPANS}
        return held | sent

    def report(self, rank_id: int | None = None) -> str:
        mib = 2**20
        who = f"rank {rank() if rank_id is None else rank_id}"
        held = ", ".join(f"{k} {self.state_bytes.get(k, 0) / mib:.2f} MiB" for k in MODEL_STATE_CATEGORIES)
        sent = ", ".join(
            f"{op} {self.last_step_bytes[op] / mib:.2f} MiB ({self.last_step_elements[op]:,} el)"
            for op in sorted(self.last_step_bytes)
        ) or "nothing"
        if self.last_step_span_bytes:
            sent += " (on its links: " + ", ".join(f"{span} {self.last_step_span_bytes.get(span, 0) / mib:.2f} MiB"
                                                   for span in SPANS)
            if self.last_step_paper_cross_node_bytes:
                sent += (f"; its part of its node's cross-node volume as the ZeRO++ paper counts it "
                         f"{self.last_step_paper_cross_node_bytes / mib:.2f} MiB")
            sent += ")"
        in_flight = "".join(f"; {event} {count:,}" for event, count in sorted(self.last_step_events.items())) + \
            "".join(f"; at most {amount:,} {what}" for what, amount in sorted(self.last_step_peaks.items()))
        shared = "".join(f"; {name} is shared: it lives in the {where}" for name, where in self.shared_weights.items())
        return f"{who} holds {held}; last step sent {sent}{in_flight}{shared}"


def link_bytes(op: str, nbytes: int, ranks: Sequence[int], me: int, ranks_per_node: int
               ) -> tuple[dict[str, int], int]:
    """Where the bytes of one collective go, from rank `me` of the group of (global) `ranks`, ranks placed on
    nodes in order, `ranks_per_node` to a node, as torchrun places them. `nbytes` is the all-gather's output,
    the reduce-scatter's, all-reduce's or all-to-all's input. Returns:

    - what this rank sends over its links, by span. A ring (all-gather, reduce-scatter) of p ranks sends the
      buffer's p - 1 chunks of p from each rank to the next, so the link from this rank to the next in rank
      order carries (p - 1)/p of it: inter-node if the next rank is on another node (the ring crosses each node
      boundary once each way). An all-reduce is a reduce-scatter then an all-gather: twice that. An all-to-all
      sends this rank's 1/p of its input to each other rank directly.
    - this rank's part of its node's cross-node volume as the ZeRO++ paper counts it: a collective whose group
      spans nodes moves its whole buffer (twice for an all-reduce) across each node's boundary, counted on the
      rank whose ring link leaves the node; an all-to-all, each rank's whole input. A node's volume is the sum
      over its ranks.
    """
    p, node = len(ranks), (lambda r: r // ranks_per_node)
    spans_nodes = len({node(r) for r in ranks}) > 1
    if op == "all_to_all":
        part = nbytes // p
        sent = {"intra-node": part * sum(r != me and node(r) == node(me) for r in ranks),
                "inter-node": part * sum(node(r) != node(me) for r in ranks)}
        return sent, nbytes if spans_nodes else 0
    rounds = 2 if op == "all_reduce" else 1
    following = ranks[(ranks.index(me) + 1) % p]
    span = "inter-node" if node(following) != node(me) else "intra-node"
    return {span: rounds * (nbytes - nbytes // p)}, rounds * nbytes if span == "inter-node" else 0


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
        # (measured: 0 and 4 MiB). NCCL's collectives need no temporary and keep their single calls.
        self.per_rank_pieces = backend == "gloo"
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
        asynchronous one (`async_op`) that `reads` and `writes` those tensors runs under hf_zero.runtime.device's
        simulation as late ("late": at its wait) or as early ("early": finished when this returns) as a GPU
        may run it."""
        elements = "" if tensor is None else \
            f" ({tensor.numel():,} {str(tensor.dtype).removeprefix('torch.')} elements)"
        purpose = f" for {_purpose[-1]}" if _purpose else ""
        number = 1  # until issued: the group's sequence is made at its first collective

        def what() -> str:
            return f"rank {rank()}: {op} #{number} of its group of {self.world_size}{elements}{purpose}"

        with quiet():  # the comparison's own small host tensors, over gloo groups of its own: not device work
            sequence = _named(what, lambda: _sequence_of(self.global_ranks))
            number, predicted = sequence.issue(f"{op}{elements}{purpose}", what)
            # One the schedule did not predict is compared before it is launched: gloo starts a collective as
            # it is issued, and one that pairs with another of a different size aborts the process in gloo's
            # transport thread; NCCL's would hang or mix two tensors.
            if not predicted:
                sequence.confirm(number)
        note_collective(what)
        done = collective_issued(self.group_name, list(reads), list(writes), what())
        mode = simulation() if async_op else None
        if mode == "late":  # launched at its wait, as late as a GPU may run it
            with quiet():
                return _Named(_Late(launch, list(reads), list(writes), what), what, sequence.raise_if_parted, done)
        with quiet():
            work = _named(what, launch, sequence.raise_if_parted)
            if mode == "early":
                _named(what, work.wait, sequence.raise_if_parted)
        if not async_op:
            done.wait()
        return None if work is None else _Named(work, what, sequence.raise_if_parted, done)

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
        if not self.per_rank_pieces:
            return self._launch("reduce_scatter", input, lambda: dist.reduce_scatter_single(
                output, input, group=self.group, async_op=async_op), async_op, reads=[input], writes=[output])
        n = output.numel()
        mine = input[self.rank * n:(self.rank + 1) * n]

        def launch() -> _Pieces:
            works = [dist.reduce(input[r * n:(r + 1) * n], group_dst=r, group=self.group, async_op=True)
                     for r in range(self.world_size)]
            return _Pieces(works, lambda: None if _same_memory(output, mine) else output.copy_(mine), async_op)

        return self._launch("reduce_scatter", input, launch, async_op, reads=[input], writes=[output])

    def all_gather_(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Concatenates every rank's `input` into `output` (input may be this rank's slice of output)."""
        return self.all_gather_coalesced_([output], [input], async_op)

    def all_gather_coalesced_(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], async_op: bool = False):
        """`all_gather_` of each pair, issued as one launch where the backend can group them: one NCCL group
        for a unit's flat buffers or for the post-step buckets, instead of a launch and its latency each.
        gloo's in-place pieces are one broadcast per rank and pair (no temporary beats one launch on a CPU)."""
        if self.world_size == 1:
            return _copy_locally(outputs, inputs)
        for output in outputs:
            self._record("all_gather", output)
        op = "all_gather" if len(outputs) == 1 else f"all_gather of {len(outputs)} tensors"
        if not self.per_rank_pieces:
            self.ledger.count("all-gather launches")
            if len(outputs) == 1:
                return self._launch(op, outputs[0], lambda: dist.all_gather_single(
                    outputs[0], inputs[0], group=self.group, async_op=async_op), async_op, inputs, outputs)

            def launch_grouped() -> _Pieces:
                with dist._coalescing_manager(self.group, async_ops=async_op) as grouped:
                    for output, input in zip(outputs, inputs):
                        dist.all_gather_single(output, input, group=self.group)
                return _Pieces(grouped.works, lambda: None, async_op)

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
            return _Pieces(works, lambda: None, async_op)

        return self._launch(op, outputs[0], launch_pieces, async_op, inputs, outputs)

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
            to_global = (lambda r: dist.get_global_rank(self.group, r)) if self.group is not None else (lambda r: r)
            mine, _ = dist.new_subgroups_by_enumeration([[to_global(r) for r in ranks] for ranks in ranks_of_each])
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
        gathered: list[Any] = [None] * self.world_size
        self._launch("all_gather_object", None, lambda: dist.all_gather_object(gathered, obj, group=self.group))
        return gathered

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
