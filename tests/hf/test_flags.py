"""The Trainer flags a launcher checks before any process starts, read without importing transformers'
TrainingArguments (hf_zero.hf.flags)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from transformers import TrainingArguments

from hf_zero.hf import flags


def as_declared(fields: list[tuple[str, typing.Any, typing.Any]]) -> dict[str, tuple[typing.Any, typing.Any]]:
    return {name: (hint, declared.default) for name, hint, declared in fields}


def test_the_trainer_flags_read_from_transformers_source_are_its_classes_own():
    """Every flag the check reads, with TrainingArguments' own type and default (the installed transformers)."""
    hints = typing.get_type_hints(TrainingArguments)
    expected = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(TrainingArguments)
                if f.name in flags._TRAINER_FLAGS_READ}
    source = Path(sys.modules[TrainingArguments.__module__].__file__)
    assert as_declared(flags._declared_in_source(source)) == expected
    assert set(expected) == set(flags._TRAINER_FLAGS_READ)


@pytest.mark.parametrize("declared", [
    "    learning_rate: float = field(default=5 * 1e-5)\n",  # a default that is not a literal
    "    learning_rate: float = field(default=5e-5)\n",  # the other flags declared elsewhere (a parent class)
], ids=["an expression", "flags missing"])
def test_a_source_the_reading_cannot_follow_gives_the_classes_fields(monkeypatch, tmp_path, declared):
    """The class is imported for its fields, the same ones."""
    changed = tmp_path / "training_args.py"
    changed.write_text("from dataclasses import dataclass, field\n\n\n@dataclass\nclass TrainingArguments:\n"
                       + declared)
    imported = sys.modules["transformers.training_args"]
    with monkeypatch.context() as patched:
        patched.delitem(sys.modules, "transformers.training_args")
        patched.setattr(flags.importlib.util, "find_spec", lambda name: type("Spec", (), {"origin": str(changed)}))
        patched.setattr(flags.importlib, "import_module", lambda name: imported)
        with_fallback = as_declared(flags.trainer_flag_fields())
    assert with_fallback == as_declared(flags.trainer_flag_fields())
    assert set(with_fallback) == set(flags._TRAINER_FLAGS_READ) and with_fallback["learning_rate"] == (float, 5e-5)


def test_a_launchers_check_of_a_scripts_flags_imports_neither_the_trainers_arguments_nor_peft():
    """What `hf-zero run` calls before it starts any process, in a fresh interpreter: the check still refuses a
    bad flag, naming it, and transformers' TrainingArguments (which imports peft, accelerate and datasets where
    installed: 3-4 s on a 2-core machine) is not imported."""
    checked = subprocess.run([sys.executable, "-c", """
import sys
from hf_zero.hf.flags import check_script_flags
from hf_zero.settings.config import ZeroConfigError
check_script_flags(["--zero_stage", "3", "--bf16", "--learning_rate", "1e-3", "--use_cpu"], 2, 2)
try:
    check_script_flags(["--zero_stage", "3", "--tensor_parallel_size", "3", "--use_cpu"], 2, 2)
except ZeroConfigError as error:
    print("refused:", error)
print(sorted(m for m in ("transformers.training_args", "transformers.trainer", "peft") if m in sys.modules))
"""], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr[-3000:]
    refused, imported = checked.stdout.splitlines()
    assert refused.startswith("refused: --tensor_parallel_size must be a positive integer dividing"), refused
    assert imported == "[]"
