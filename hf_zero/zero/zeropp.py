"""ZeRO++ (arXiv 2306.10209) beside stage 3: the node groups hpZ and qgZ talk within, and qgZ's reduction.

Ranks fill nodes in order, `ranks_per_node` to a node, as torchrun places them. qwZ lives in stage3.Unit's
gather; hpZ's secondary partition in stage3.Unit too, over `consecutive_ranks(comm, hpz_partition_size)`.

qgZ replaces a bucket's reduce-scatter by the paper's hierarchical all-to-all (its section 3.3). A bucket
of W = nodes x per_node chunks, c elements each, must end with chunk r summed over all ranks on rank r =
node * per_node + local. Inside the node, rank `local` collects from its peers every chunk whose local
index is its own ([node', local] for every node': the paper's slice reordering), each peer's part quantized
on its way; it dequantizes and sums them in fp32, quantizes the node's sums, and across nodes the ranks of
its local index exchange those, so that rank r sums chunk r over the nodes. Each value is quantized twice
whatever the world size, and only 1/per_node of the bucket crosses the network.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from hf_zero.ops.quantize import dequantize, quantize, senders_parts
from hf_zero.runtime.comm import Communicator, _Done, _Pieces


def consecutive_ranks(comm: Communicator, size: int) -> Communicator:
    """This rank's group of `size` consecutive ranks of `comm` (within a node when `size` divides the ranks
    per node)."""
    return comm.subgroup([list(range(start, start + size)) for start in range(0, comm.world_size, size)])


def same_local_rank(comm: Communicator, per_node: int) -> Communicator:
    """The ranks of `comm` that have this rank's place within their node: one on every node."""
    return comm.subgroup([list(range(local, comm.world_size, per_node)) for local in range(per_node)])


class _FinishedAtWait(_Pieces):
    """A reduction whose second exchange is issued by `wait`: it counts as complete only once waited on, so
    that every rank issues that exchange at the same point of its program (the reducer retires reductions
    that look complete early, at a moment that differs between ranks, and a rank blocked in the exchange
    there could be waiting for one that is itself waiting for it in another collective)."""

    def is_completed(self) -> bool:
        return self.done


class QuantizedReduceScatter:
    """qgZ: `(output, input)` as Communicator.reduce_scatter_ sums them (this rank's chunk of every rank's
    `input`, summed, into `output`), by two block-quantized all-to-alls: inside the node, then across."""

    def __init__(self, comm: Communicator, bits: int, block: int) -> None:
        self.per_node = comm.ranks_per_node
        self.nodes = comm.world_size // self.per_node
        self.node = consecutive_ranks(comm, self.per_node)
        self.across = same_local_rank(comm, self.per_node)
        self.bits, self.block = bits, block

    def __call__(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        """Starts the exchange inside the node; waiting on the result finishes the reduction into `output`."""
        c = output.numel()
        # [destination local rank, node, c]: the parts of every chunk with each local index, side by side.
        by_local_rank = input.view(self.nodes, self.per_node, c).transpose(0, 1).reshape(self.per_node, -1)
        work, node_sums = self._exchange(self.node, by_local_rank)

        def finish() -> None:
            across_work, chunk_sum = self._exchange(self.across, node_sums().view(self.nodes, c))
            across_work.wait()
            output.copy_(chunk_sum())

        return _FinishedAtWait([work], finish, async_op=True)

    def _exchange(self, comm: Communicator, parts: torch.Tensor) -> tuple[Any, Callable[[], torch.Tensor]]:
        """Sends row i of `parts` to rank i of `comm`, block-quantized. Returns the exchange's work and what
        sums, in fp32, the parts this rank received, once it is done. A group of one sends nothing and
        quantizes nothing."""
        if comm.world_size == 1:
            return _Done(), lambda: parts[0].float()
        packed = [quantize(part, self.bits, self.block) for part in parts]
        values = torch.cat([p.values for p in packed])
        scales = torch.cat([p.scales for p in packed])
        got_values, got_scales = torch.empty_like(values), torch.empty_like(scales)
        works = [comm.all_to_all_(got_values, values, async_op=True),
                 comm.all_to_all_(got_scales, scales, async_op=True)]

        def summed() -> torch.Tensor:
            total = torch.zeros(parts.shape[1], dtype=torch.float32, device=parts.device)
            for part in senders_parts(got_values, got_scales, comm.world_size, self.bits, self.block, parts.shape[1]):
                total += dequantize(part)
            return total

        return _Pieces(works, lambda: None, async_op=True), summed
