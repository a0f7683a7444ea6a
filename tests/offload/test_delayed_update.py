"""Delayed parameter update (ZeRO-Offload 5.2): each gradient is computed one update late, after warm-up."""
from __future__ import annotations

import pytest
import torch

import hf_zero
import model_zoo
from hf_zero.construct import build_seeded
from hf_zero.ops import CPUAdam
from hf_zero.train_lm import batches, load_text
from tests.helpers import batch, named_copy, tiny_model

# Immediate, and under each mode of the simulation of a GPU (tests/conftest.py: copies).
pytestmark = pytest.mark.usefixtures("copies")

WARMUP, STEPS = 2, 7


def engine_run(config: dict, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(steps):
        engine.backward(engine(**batch("gpt2", step, 4)).loss)
        engine.step()
    with engine.gathered_parameters():  # waits for the last update and hands it to the model
        return named_copy(model)


def hand_computed_delayed_run(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, no engine: the device copy of the weights lags the masters by one update after warm-up."""
    model = tiny_model("gpt2")
    masters = [p.detach().clone() for p in model.parameters()]
    optimizer = CPUAdam(masters, lr=1e-2)  # the kernel the engine's host update runs, so equality is exact
    pending: list[torch.Tensor] | None = None
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(**batch("gpt2", step, 4)).loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if step < WARMUP:
            to_apply = [grads]
        else:  # apply the previous step's gradients now; this step's wait for the next one
            to_apply = [pending] if pending is not None else []
            pending = grads
        for g in to_apply:
            for master, grad in zip(masters, g):
                master.grad = grad
            optimizer.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
    for master, grad in zip(masters, pending):  # what the engine's finish_pending_update applies at the end
        master.grad = grad
    optimizer.step()
    return {n: m.clone() for (n, _), m in zip(model.named_parameters(), masters)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_delayed_update_equals_the_hand_computed_one_step_delay(stage):
    config = {"zero_stage": stage, "offload_optimizer": "cpu", "delayed_param_update": True,
              "delayed_param_update_warmup": WARMUP}
    ours, reference = engine_run(config), hand_computed_delayed_run()
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name
    # And it is a different schedule from the undelayed one (the test could not pass by ignoring the flag).
    undelayed = engine_run({k: v for k, v in config.items() if not k.startswith("delayed")})
    assert any(not torch.equal(undelayed[n], reference[n]) for n in reference)


def train_tiny_lm(delayed: bool, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = build_seeded(lambda: model_zoo.build("gpt2-tiny"), 0)
    config = {"zero_stage": 2, "offload_optimizer": "cpu", "delayed_param_update": delayed,
              "delayed_param_update_warmup": 40}
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    data = torch.frombuffer(bytearray(load_text(None)), dtype=torch.uint8).long()
    losses = []
    for _, ids in zip(range(steps), batches(data, 8, 64, seed=0)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_delayed_update_converges_within_5_percent_of_the_normal_schedule(copies):
    """Byte-level GPT-2 (gpt2-tiny) on Python's docs, 40 warm-up steps. Measured: 3.1% above the normal
    schedule's mean loss over steps 580-600 (2.2% with 10 warm-up steps; 7-9% at steps 100-200, where the
    loss falls fastest and a one-step lag costs most)."""
    if copies != "immediate":
        pytest.skip("a convergence measurement: the copies' ordering is checked by the one-step-delay test above")
    steps = 600
    normal, delayed = train_tiny_lm(False, steps), train_tiny_lm(True, steps)
    tail = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    print(f"loss {normal[0]:.3f} -> normal {tail(normal):.3f}, delayed {tail(delayed):.3f}")
    assert tail(normal) < 0.6 * normal[0]  # it learned something: the comparison means something
    assert abs(tail(delayed) - tail(normal)) <= 0.05 * tail(normal)
