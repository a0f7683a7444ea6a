"""The cross-rank sequence check: every rank must issue the same collectives in the same order on each group;
`CollectiveSequence` checks that they do, as they go, and stops every rank naming the first collective where they
part (with what it was for: `issued_for`). A collective that fails names itself too (`named`: `CollectiveError`).
"""
from __future__ import annotations

import contextlib
import hashlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.runtime.groups import exchange_group
from hf_zero.runtime.launch import collective_timeout, other_ranks_report
from hf_zero.settings import environment


class CollectiveError(RuntimeError):
    """A collective that did not complete on this rank, named with its group and its number there: the
    backend's own error (gloo: "Timed out waiting 30000ms for recv operation to complete") names neither,
    and the numbers tell a collective that ranks issued in different orders."""


def named(what: Callable[[], str], call: Callable[[], Any], parted: Callable[[], None] | None = None) -> Any:
    """call(); a RuntimeError it raises becomes a CollectiveError naming the collective (`what()`, formatted
    only then: collectives are issued by the hundred per step) and what the other ranks' heartbeats say, or the
    mismatch `parted()` raises (a partner that stopped before a different collective: CollectiveSequence)."""
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


def has_finished(work: Any, on_gloo: bool) -> bool:
    """Whether a collective's `work` has finished, without waiting for it. On gloo (`on_gloo`), whether its future
    is done: gloo's `Work.is_completed()` waits for the work's lock holding the GIL, and under a profiler gloo's
    worker thread ends the work's span holding that lock, in the state of the thread that issued it: saved-tensor
    hooks (stage 3's forward counts the root's saves with them) and torch-function modes are Python objects there,
    which it needs the GIL to copy, so each thread would wait for the other forever. The worker marks the future
    done first (ProcessGroupGloo's finishWorkGloo), under the future's own lock. NCCL's and the fake group's
    futures are done once issued, so their is_completed() answers; so do hf_zero's own handles, and gloo's
    reduce_scatter_single, which has no future (hf_zero issues it on gloo only where tests take NCCL's single
    calls)."""
    if on_gloo and isinstance(work, dist.Work):
        try:
            return work.get_future().done()
        except RuntimeError:  # "Work::getFuture not implemented"
            pass
    return work.is_completed()


# A stage-3 forward gathers from every rank: one that some ranks run alone waits for partners that never come.
FORWARD_ON_SOME_RANKS = (". At ZeRO stage 3 every rank must run each forward: generate() on some ranks only "
                         "(rank 0, say) needs synced_gpus=True and a call on every rank (ZeroSeq2SeqTrainer passes "
                         "it), and evaluation or prediction must run on every rank")


class CollectiveMismatch(CollectiveError):
    """The ranks issued different collectives at the same place in their sequence on one group."""


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


def purpose_now() -> str:
    """" for <what they are for>" of the collectives issued now (`issued_for`), or nothing."""
    return f" for {_purpose[-1]}" if _purpose else ""


# A collective's exchange of hashes: its number, the work, every rank's hash, its description, the description the
# schedule predicted (None: none yet), and what() names it by.
_Exchange = tuple[int, Any, torch.Tensor, str, str | None, Callable[[], str]]


class CollectiveSequence:
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
            self.hashes, self.descriptions = (exchange_group(ranks, timeout) for _ in range(2))
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
        while self.exchanges and has_finished(self.exchanges[0][1], on_gloo=True):
            self._take(self.exchanges.popleft())

    def confirm(self, number: int) -> None:
        """Every rank issued the same collectives up to the `number`-th, or every rank raises naming the first
        that differs."""
        while self.exchanges and self.exchanges[0][0] <= number:
            self._take(self.exchanges.popleft())

    def _take(self, exchange: _Exchange) -> None:
        """Waits for an exchange and compares it; what it raises, every later collective raises (`parted`)."""
        try:
            named(exchange[-1], exchange[1].wait)
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
            named(what, lambda: dist.all_gather_object(said, description, group=self.descriptions))
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
_sequences: dict[tuple[Any, tuple[int, ...]], CollectiveSequence] = {}


def sequence_of(ranks: Sequence[int]) -> CollectiveSequence:
    """The sequence of the group of `ranks` (global ranks), made at the group's first collective, which every
    member issues (making its gloo groups is collective among them)."""
    key = (dist.group.WORLD, tuple(ranks))
    if key not in _sequences:
        _sequences[key] = CollectiveSequence(ranks)
    return _sequences[key]
