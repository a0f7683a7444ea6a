"""The ledger: what this rank sent per optimizer step, what it held in flight, and what model state it holds.

Volumes are counted as the ZeRO paper counts them (section 7): an all-reduce over n elements moves 2n, a
reduce-scatter over an n-element input moves n, an all-gather into an n-element output moves n. With one process
(or no process group) the collectives are local copies and count nothing.

Where the bytes travel is counted twice (`link_bytes`): what this rank sends over its links, intra-node or
inter-node, under the algorithms NCCL runs across nodes (a ring in rank order for all-gather, reduce-scatter
and all-reduce; direct sends for all-to-all), and its node's cross-node volume as the ZeRO++ paper counts it
(a flat collective's whole buffer once per node, an all-to-all's whole input per rank).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_zero.runtime.groups import rank

MODEL_STATE_CATEGORIES = ("parameters", "gradients", "optimizer_states", "buffers")
SPANS = ("intra-node", "inter-node")


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
