"""Stage 3 (hf_zero/zero/stage3.py) under activation checkpointing that wraps a whole unit's __call__: the
recomputation in backward runs the unit's forward hooks again."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import hf_zero
from hf_zero.launch import spawn_gloo

STEPS, WIDTH = 3, 32


class Checkpointed(nn.Module):
    """Four blocks (stage-3 units), each run through torch.utils.checkpoint by the model itself."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.mode == "none" else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x).pow(2).mean()


def batch(step: int) -> torch.Tensor:
    """Requires grad, so that reentrant checkpointing (which needs an input that does) trains every block."""
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()


def run(mode: str) -> dict:
    model = Checkpointed(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not torch.distributed.is_initialized():  # the reference: one process, whole batch
        for step in range(STEPS):
            model(batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "param_persistence_threshold": 0})
    rank = engine.comm.rank
    with set_checkpoint_early_stop(False):  # recompute the whole block, as FSDP2 documents the hazard with
        for step in range(STEPS):
            engine.backward(engine(batch(step).detach()[rank * 4:(rank + 1) * 4].requires_grad_()))
            engine.step()
    gathered = engine.ledger.last_step_elements.get("all_gather", 0)
    with engine.gathered_parameters():
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "all_gather": gathered}


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_stage3_units_recomputed_by_checkpointing_train_as_one_process_with_two_gathers_each(mode):
    expected = run(mode)
    first_block = "blocks.0.0.weight"  # trained: the recomputation's gradients reach the first block
    assert (expected[first_block] - Checkpointed(mode).state_dict()[first_block]).abs().max() > 1e-4
    plain = spawn_gloo(run, 2, "none")[0]
    for result in spawn_gloo(run, 2, mode):
        assert max((result["params"][n] - expected[n]).abs().max().item() for n in expected) < 1e-6
        assert result["all_gather"] == plain["all_gather"]  # once for forward, once for backward, per unit
