"""Which modules stage 3 gathers as units (hf_zero/zero/stage3/discovery.py), and saying so."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import hf_zero
from tests.helpers import tiny_model


def blocks_of(engine) -> list[str]:
    return [unit.name for unit in engine.params.units if unit.name and not unit.persistent]


def test_the_units_chosen_are_logged_once_with_their_count_classes_and_what_chose_them(caplog):
    model = tiny_model("gpt2")
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    said = [r.getMessage() for r in caplog.records if "stage 3 cuts" in r.getMessage()]
    n = len(model.transformer.h)
    assert said == [f"stage 3 cuts GPT2LMHeadModel into {n} units of GPT2Block (chosen by its _no_split_modules) "
                    f"and a root unit of the rest"]
    assert blocks_of(engine) == [f"transformer.h.{i}" for i in range(n)]


def test_no_split_modules_that_match_nothing_fall_back_to_the_modulelist_children_and_say_so(caplog):
    """Before: one silent unit of the whole model, which every rank then held whole while it computed."""
    model = tiny_model("gpt2")
    model._no_split_modules = ["Gpt2Block"]  # a misspelt class name, as a hand-written model may carry
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    assert blocks_of(engine) == [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
    assert "GPT2LMHeadModel's _no_split_modules ['Gpt2Block'] match none of its modules: stage 3 gathers the " \
           "children of its ModuleLists one at a time instead" in caplog.text
    assert "--zero_unit_module_classes" in caplog.text


class _Declared(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)


def test_a_model_whose_declared_blocks_match_nothing_and_that_has_no_module_list_is_refused_naming_the_setting():
    model = _Declared()
    with pytest.raises(ValueError, match=r"stage 3 cannot cut _Declared into blocks: its _no_split_modules "
                                         r"\['Block'\] match none of its modules and it holds no ModuleList. Name "
                                         r"its block classes with unit_module_classes \(--zero_unit_module_classes\)"):
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})


def test_a_model_without_blocks_is_one_unit_and_a_warning_says_so(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    assert blocks_of(engine) == []
    assert "Sequential has no blocks stage 3 can gather one at a time" in caplog.text
