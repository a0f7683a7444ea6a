"""The one place that maps a ZeRO stage to its parameter holder (holder.py)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_zero.runtime.comm import Communicator
from hf_zero.settings.config import ZeroConfig
from hf_zero.zero.construct import fill_whole
from hf_zero.zero.flat_params import FlatParams
from hf_zero.zero.holder import ParamHolder
from hf_zero.zero.partition import model_order
from hf_zero.zero.stage3 import Stage3Params


def param_holder(model: nn.Module, groups: list[list[tuple[str, nn.Parameter]]], config: ZeroConfig,
                 comm: Communicator, init_from: Any = None, device: torch.device | None = None) -> ParamHolder:
    """Stages 0-2 keep whole parameters in flat buffers (FlatParams); stage 3 partitions them into units
    gathered on use (Stage3Params). A model built on meta is filled from `init_from` on `device`: shard by shard at
    stage 3, whole on every rank at stages 0-2 (construct.fill_whole)."""
    if config.zero_stage == 3:
        return Stage3Params(model, groups, config.torch_dtype, comm, config, init_from, device)
    if init_from is not None:
        fill_whole(model, init_from, device, comm.rank)
    return FlatParams(groups, config.zero_stage, config.torch_dtype, comm, config, model_order(model))
