"""Delayed parameter update (ZeRO-Offload 5.2): each gradient is computed one update late, after warm-up."""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

import hf_zero
import model_zoo
from hf_zero.cli.train_lm import batches, load_text
from hf_zero.ops import CPUAdam
from hf_zero.optim.delayed import DelayedUpdate
from hf_zero.zero.construct import build_seeded
from tests.helpers import batch, named_copy, tiny_model

# Immediate, and under each mode of the simulation of a GPU (tests/conftest.py: copies).
pytestmark = pytest.mark.usefixtures("copies")

WARMUP, STEPS = 2, 7


def decaying_lr(step: int) -> float:
    """A learning rate that changes at every step, as the Trainer's schedules do (a factor of LambdaLR)."""
    return 1.0 / (1 + step)


def engine_run(config: dict, steps: int = STEPS, scheduled: bool = False) -> dict[str, torch.Tensor]:
    """`scheduled`: a LambdaLR of decaying_lr steps after every engine.step(), as the Trainer's does."""
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = hf_zero.initialize(model, optimizer, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decaying_lr) if scheduled else None
    for step in range(steps):
        engine.backward(engine(**batch("gpt2", step, 4)).loss)
        engine.step()
        if scheduler is not None:
            scheduler.step()
    with engine.gathered_parameters():  # waits for the last update and hands it to the model
        return named_copy(model)


def hand_computed_delayed_run(steps: int = STEPS, scheduled: bool = False) -> dict[str, torch.Tensor]:
    """One process, no engine: the device copy of the weights lags the masters by one update after warm-up.
    Each step's gradients are applied with the learning rate of the step that computed them."""
    model = tiny_model("gpt2")
    masters = [p.detach().clone() for p in model.parameters()]
    optimizer = CPUAdam(masters, lr=1e-2)  # the kernel the engine's host update runs, so equality is exact
    pending: tuple[list[torch.Tensor], float] | None = None
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(**batch("gpt2", step, 4)).loss.backward()
        grads = ([p.grad.clone() for p in model.parameters()], 1e-2 * (decaying_lr(step) if scheduled else 1.0))
        if step < WARMUP:
            to_apply = [grads]
        else:  # apply the previous step's gradients now; this step's wait for the next one
            to_apply = [pending] if pending is not None else []
            pending = grads
        for g, lr in to_apply + ([pending] if step == steps - 1 else []):  # the engine's last wait applies it
            for master, grad in zip(masters, g):
                master.grad = grad
            optimizer.param_groups[0]["lr"] = lr
            optimizer.step()
        with torch.no_grad():
            for p, master in zip(model.parameters(), masters):
                p.copy_(master)
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


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("update_starts", ["at once", "after the next step's backward"])
def test_a_delayed_update_steps_with_the_learning_rate_of_its_own_step(stage, update_starts, monkeypatch):
    """The scheduler sets the next step's learning rate while the update of this one runs in the background: the
    update must use the rate as it was when engine.step() was called, however late its thread reads it (here at
    once, or only when the next step waits for it), so that two runs of the same script are equal bitwise."""
    if update_starts != "at once":  # the background update runs only when the next step waits for it
        def launch(self, update):
            self.pending = Future()
            self.pending.run = update

        def wait(self):
            pending, self.pending = self.pending, None
            if pending is not None:
                pending.run()
            return pending is not None

        monkeypatch.setattr(DelayedUpdate, "launch", launch)
        monkeypatch.setattr(DelayedUpdate, "wait", wait)
    config = {"zero_stage": stage, "offload_optimizer": "cpu", "delayed_param_update": True,
              "delayed_param_update_warmup": WARMUP}
    ours, reference = engine_run(config, scheduled=True), hand_computed_delayed_run(scheduled=True)
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


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
