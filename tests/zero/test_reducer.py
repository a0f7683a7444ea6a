"""GradientReducer (hf_zero/zero/reducer.py): buckets are reduced in one order on every rank, whatever order
their gradients arrive in."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.runtime.launch import spawn_gloo

STEPS, WIDTH = 3, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)  # used only by the batches that ask for it

    def forward(self, x: torch.Tensor, expert: bool) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        return x + self.expert(x) if expert else x


class Branchy(nn.Module):
    """Three blocks (stage-3 units); the middle one's expert runs only on one rank's batches. Its flat buffer
    is [linear | expert], so with 2 ranks the expert is rank 1's chunk: used on rank 0 only, its owner must
    learn from rank 0 that it was used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, expert: bool) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, expert and i == 1)
        return self.head(x).pow(2).mean()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def halves(step: int) -> list[torch.Tensor]:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
    return [x[:4], x[4:]]  # rank 0's, rank 1's


def one_process(expert_rank: int) -> dict[str, torch.Tensor]:
    """The reference: both halves in one process, their losses averaged as DDP averages the ranks'."""
    model = Branchy()
    opt = optimizer(model)
    for step in range(STEPS):
        first, second = halves(step)
        ((model(first, expert_rank == 0) + model(second, expert_rank == 1)) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(config: dict, expert_rank: int) -> dict[str, torch.Tensor]:
    model = Branchy()
    engine = hf_zero.initialize(model, optimizer(model), config)
    rank = engine.comm.rank
    for step in range(STEPS):
        engine.backward(engine(halves(step)[rank], expert=rank == expert_rank))
        engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


SMALL = {"reduce_bucket_size": 300, "allgather_bucket_size": 300}  # a bucket per layer or so


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("buckets", ["small", "default"])
@pytest.mark.parametrize("expert_rank", [0, 1])
def test_a_parameter_used_by_one_rank_only_trains_as_in_one_process(stage, buckets, expert_rank):
    config = {"zero_stage": stage, **(SMALL if buckets == "small" else {})}
    expected = one_process(expert_rank)
    for params in spawn_gloo(engine_run, 2, config, expert_rank):
        assert max((params[n] - expected[n]).abs().max().item() for n in expected) < 1e-6


def accumulate_at_every_stage() -> dict:
    """Stages 0-3 on 2 ranks, 2 micro-batches per step, small buckets: many reductions per backward, each in gloo's
    per-rank pieces (a large unit's path; the modules run under `copies` take the small ones' single calls)."""
    from tests.conftest import SMALL_BUCKETS
    from tests.helpers import Scenario, communicators_in_pieces_above, run_scenarios

    with communicators_in_pieces_above(0):
        results = run_scenarios([Scenario(f"s{stage}", config={"zero_stage": stage, "gradient_accumulation_steps": 2,
                                                                 **SMALL_BUCKETS}, steps=STEPS)
                                 for stage in (0, 1, 2, 3)])
    return {name: r["params"] for name, r in results.items()}


def test_reductions_match_one_process_when_they_run_as_late_as_a_gpu_may(copies):
    """Under the simulation a reduction runs only when the compute stream waits on it: a bucket reused, or a
    gradient shard read, before that wait gives a wrong result."""
    from tests.helpers import max_diff, train_single_process

    expected = train_single_process("gpt2", STEPS, 8, micro_batches=2)["params"]
    for result in spawn_gloo(accumulate_at_every_stage, 2):
        for stage in (0, 1, 2, 3):
            assert max_diff(result[f"s{stage}"], expected) < 1e-5, stage


def test_the_steps_phase_is_backward_only_inside_engine_backward_and_a_move_out_of_turn_raises():
    """The reducer's phase (reducer.StepPhase): idle around a backward, backward while gradients arrive, and a
    move its table does not allow raises, naming both phases."""
    from hf_zero.zero.reducer import StepPhase
    from tests.helpers import batch, make_optimizer, tiny_model

    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
    grads = engine.params.grads
    seen = []
    model.transformer.h[0].mlp.c_fc.weight.register_post_accumulate_grad_hook(lambda p: seen.append(grads.phase))
    assert grads.phase is StepPhase.IDLE
    engine.backward(engine(**batch("gpt2", 0, 4)).loss)
    assert seen == [StepPhase.BACKWARD] and grads.phase is StepPhase.IDLE
    with pytest.raises(AssertionError, match="the gradient reducer cannot go from idle to finishing"):
        grads.finish()
