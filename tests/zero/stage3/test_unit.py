"""A stage-3 unit's state (hf_zero/zero/stage3/unit.py): named, moved only as its table allows, and what the
parameters view in each state."""
from __future__ import annotations

import math

import pytest
import torch

import hf_zero
from hf_zero.zero.stage3.unit import UnitState
from tests.helpers import batch, make_optimizer, tiny_model


def stage3_engine() -> hf_zero.ZeroEngine:
    model = tiny_model("gpt2")
    return hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3})


def test_a_unit_goes_sharded_gathering_gathered_and_back_with_its_parameters_viewing_each_state():
    engine = stage3_engine()
    unit = next(u for u in engine.params.units if not u.is_root and not u.persistent)
    slices = [s for flat in unit.flats for s in flat.slices]
    params = [s.param for s in slices]
    assert unit.state is UnitState.SHARDED and not unit.gathered
    assert all(p.numel() == 0 for p in params)
    unit.gather()
    assert unit.state is UnitState.GATHERING and unit.gathered
    unit.wait()
    assert unit.state is UnitState.GATHERED and all(s.param.shape == s.shape for s in slices)
    unit.free_early()
    assert unit.state is UnitState.FREED_EARLY and not unit.gathered
    assert all(s.param.shape == s.shape and math.isnan(s.param.reshape(-1)[0].item()) for s in slices)
    unit.free()
    assert unit.state is UnitState.SHARDED and all(p.numel() == 0 for p in params)


def test_a_move_the_table_does_not_allow_raises_naming_the_unit_and_both_states():
    engine = stage3_engine()
    unit = next(u for u in engine.params.units if not u.is_root and not u.persistent)
    with pytest.raises(AssertionError, match=rf"unit {unit.name!r} cannot go from sharded to freed early"):
        unit._move(UnitState.FREED_EARLY)
    unit.gather()
    with pytest.raises(AssertionError, match=rf"unit {unit.name!r} cannot go from gathering to sharded"):
        unit._move(UnitState.SHARDED)
    unit.free()  # waits for the gather first
    assert unit.state is UnitState.SHARDED


def test_every_unit_is_sharded_after_a_step_but_the_persistent_one():
    engine = stage3_engine()
    engine.backward(engine(**batch("gpt2", 0, 4)).loss)
    engine.step()
    assert {u.name: u.state for u in engine.params.units} == {
        u.name: UnitState.GATHERED if u.persistent else UnitState.SHARDED for u in engine.params.units}
    assert all(torch.isfinite(s.param).all() for u in engine.params.units if u.persistent for f in u.flats
               for s in f.slices)
