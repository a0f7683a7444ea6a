"""Which modules stage 3 gathers as units, what each parameter's unit is, and the models it refuses."""
from __future__ import annotations

import logging
from typing import Callable

from torch import nn

from hf_zero.runtime.groups import log_on_rank0

IN_MODULE_LISTS = "the children of its ModuleLists"  # what chose the blocks, when it was that


def find_unit_modules(model: nn.Module, class_names: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The modules stage 3 gathers as units (`repeated_blocks`). Says once which it chose (rank 0's log). A
    model's own _no_split_modules that match nothing fall back to the ModuleList children, with a warning, or are
    refused when there are none: one unit holding the whole model would keep every rank holding all of it, the
    memory stage 3 exists to save. A model with neither is one unit, with a warning."""
    units, chosen_by = repeated_blocks(model, class_names)
    declared = list(getattr(model, "_no_split_modules", None) or [])
    if declared and not units:
        raise ValueError(f"stage 3 cannot cut {type(model).__name__} into blocks: its _no_split_modules {declared} "
                         f"match none of its modules and it holds no ModuleList. Name its block classes with "
                         f"unit_module_classes (--zero_unit_module_classes); its module classes are "
                         f"{_module_classes(model)}")
    if declared and chosen_by == IN_MODULE_LISTS:
        log_on_rank0(logging.WARNING, "%s's _no_split_modules %s match none of its modules: stage 3 gathers the "
                     "children of its ModuleLists one at a time instead; name the block classes with "
                     "unit_module_classes (--zero_unit_module_classes) to choose", type(model).__name__, declared)
    if not units:
        log_on_rank0(logging.WARNING, "%s has no blocks stage 3 can gather one at a time (no _no_split_modules, no "
                     "ModuleList): it is one unit, and every rank holds all of it while it computes. Name its block "
                     "classes with unit_module_classes (--zero_unit_module_classes) to cut it", type(model).__name__)
    else:
        _say_units(model, units, chosen_by)
    return units


def repeated_blocks(model: nn.Module, class_names: list[str] | None) -> tuple[list[tuple[str, nn.Module]], str]:
    """The model's outermost repeated blocks, and what chose them: the classes `class_names` names (the user's word
    wins; refused when it matches nothing), else the model's `_no_split_modules` (transformers' block classes),
    else the children of its ModuleLists. None found: an empty list. Stage 3 gathers these as units, and
    --torch_compile compiles each."""
    if class_names:
        blocks = _outermost(model, lambda m: type(m).__name__ in class_names)
        if not blocks:
            raise ValueError(f"unit_module_classes {class_names} match no module of the model; its module "
                             f"classes are {_module_classes(model)}")
        return blocks, f"unit_module_classes {class_names}"
    declared = list(getattr(model, "_no_split_modules", None) or [])
    if declared and (blocks := _outermost(model, lambda m: type(m).__name__ in declared)):
        return blocks, "its _no_split_modules"
    in_lists = {id(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}
    return _outermost(model, lambda m: id(m) in in_lists), IN_MODULE_LISTS


def _module_classes(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def refuse_layer_drop(model: nn.Module) -> None:
    """LayerDrop (BART's, Whisper's, wav2vec2's `*layerdrop` settings) skips whole layers at random, drawn on
    each rank: a layer one rank runs and another skips is a unit all-gathered on one rank only, whose collective
    would pair with another one (a hang, or wrong weights). Refused before any work, naming the setting."""
    config = getattr(model, "config", None)
    dropping = {name: value for name, value in vars(config).items()
                if name.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0} if config else {}
    if dropping:
        settings = ", ".join(f"{name}={value}" for name, value in sorted(dropping.items()))
        raise ValueError(f"ZeRO stage 3 cannot train {type(model).__name__} with LayerDrop ({settings}): each rank "
                         f"draws the layers it skips, and a layer gathered on some ranks only would leave the others "
                         f"waiting. Set {' and '.join(f'config.{name} = 0' for name in sorted(dropping))} before "
                         f"training, or use zero_stage 2 (--zero_stage 2), which trains with it")


def _outermost(model: nn.Module, wanted: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is not model and wanted(module) and not any(name.startswith(u + ".") for u, _ in units):
            units.append((name, module))
    return units


def _say_units(model: nn.Module, units: list[tuple[str, nn.Module]], chosen_by: str) -> None:
    classes = sorted({type(m).__name__ for _, m in units})
    log_on_rank0(logging.INFO, "stage 3 cuts %s into %d units of %s (chosen by %s) and a root unit of the rest",
                 type(model).__name__, len(units), ", ".join(classes), chosen_by)


def units_using_each_param(model: nn.Module, unit_names: list[str]) -> dict[int, set[str]]:
    """For each parameter, the units holding a module that holds it: a tied weight (BERT's decoder and word
    embeddings) or one module shared by two blocks has several. '' is the root: a module in no unit."""
    users: dict[int, set[str]] = {}
    units = set(unit_names)

    def visit(module: nn.Module, name: str, unit: str) -> None:  # every path to a module, shared ones too
        unit = name if name in units else unit
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(unit)
        for child_name, child in module._modules.items():
            if child is not None:
                visit(child, f"{name}.{child_name}" if name else child_name, unit)

    visit(model, "", "")
    return users
