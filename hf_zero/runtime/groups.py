"""The process groups, built in one place: every group and mesh beside the default one (which
hf_zero/runtime/launch.py starts) comes from here. Making a group is collective among the ranks that form it (all
of them, for `subgroup` and `device_mesh`): every rank calls these in the same order with the same arguments.

    subgroup         the subgroup holding this rank, among a partition of a group's ranks (hpZ, qgZ)
    exchange_group   a gloo group of its own for the cross-rank sequence check's exchanges
    device_mesh      a DeviceMesh over the whole world (tensor parallelism's ("dp", "tp"))
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_on_rank0(level: int, message: str, *args: Any) -> None:
    """Logs once for the whole job, in rank 0's log: for what every rank decides alike."""
    if rank() == 0:
        logging.getLogger("hf_zero").log(level, message, *args)


def subgroup(group: dist.ProcessGroup | None, ranks_of_each: list[list[int]]) -> dist.ProcessGroup:
    """The subgroup, among `ranks_of_each` (ranks of `group`, None: the world, covering it once), that holds this
    rank. Every rank of the world calls it with the same list."""
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    mine, _ = dist.new_subgroups_by_enumeration([[to_global(r) for r in ranks] for ranks in ranks_of_each])
    return mine


def exchange_group(ranks: Sequence[int], timeout: timedelta | None) -> dist.ProcessGroup:
    """A gloo group over (global) `ranks` for small host-side exchanges beside a group's own collectives; made by
    its members only, `timeout` (None: gloo's default) bounding each exchange."""
    return dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                          **({} if timeout is None else {"timeout": timeout}))


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over the whole world, of `shape` in rank order, its dimensions `names`."""
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
