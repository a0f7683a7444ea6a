"""Run an unmodified Hugging Face example script with ZeRO: `python -m hf_zero.cli.run SCRIPT.py [args]`.

Several processes: `torchrun --nproc_per_node N -m hf_zero.cli.run SCRIPT.py [args]`, or
`hf-zero run --nproc_per_node N SCRIPT.py [args]`, which starts them through torchrun's agent for you.

The script builds TrainingArguments and Trainer from transformers through HfArgumentParser, as
run_clm.py, run_mlm.py and run_glue.py do. Before it runs, transformers' classes are replaced by
hf_zero's subclasses, so its parser knows the --zero_* flags and its Trainer trains with the engine.

The replacement is made in the modules that define the classes (transformers.training_args,
transformers.trainer, ...), not only on the top-level `transformers` module: the first import of
transformers.processing_utils (`import evaluate` does it) puts a new top-level module object in
sys.modules, which resolves names from those defining modules again.
"""
from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hf_zero.settings.config import ZeroConfigError
from hf_zero.settings.environment import (
    check_environment,
    processes_per_node,
    world_size,
)

if TYPE_CHECKING:
    from hf_zero.cli.rank_main import Ending

# (defining module, class name) -> hf_zero's replacement, as "module:attribute".
REPLACEMENTS = {
    ("transformers.training_args", "TrainingArguments"): "hf_zero.hf.arguments:ZeroTrainingArguments",
    ("transformers.training_args_seq2seq", "Seq2SeqTrainingArguments"):
        "hf_zero.hf.arguments:ZeroSeq2SeqTrainingArguments",
    ("transformers.trainer", "Trainer"): "hf_zero.hf.trainer:ZeroTrainer",
    ("transformers.trainer_seq2seq", "Seq2SeqTrainer"): "hf_zero.hf.trainer:ZeroSeq2SeqTrainer",
}


def patch_transformers() -> None:
    """Makes `from transformers import TrainingArguments, Trainer` (and the Seq2Seq pair) give hf_zero's."""
    # Import the replacements first: they subclass the original classes, and importing them may put a new top-level
    # transformers module in sys.modules (see above), the one that must get them.
    replacements = {key: _load(target) for key, target in REPLACEMENTS.items()}
    import transformers

    for (module_name, name), replacement in replacements.items():
        setattr(importlib.import_module(module_name), name, replacement)
        setattr(transformers, name, replacement)


def _load(target: str) -> type:
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    # Imported here, not with this module: `hf-zero run` reads this module's help and checks the flags' names before
    # it imports torch and transformers.
    from hf_zero.hf.flags import check_script_flags
    from hf_zero.runtime.launch import say_once

    script = Path(argv[0])
    if not script.is_file():
        print(f"hf-zero run: no such script: {script}", file=sys.stderr)
        return 2
    try:
        # Before the script runs: its parser would print its whole usage on every rank.
        check_environment()
        world = world_size()
        check_script_flags(argv[1:], world, processes_per_node(world))
        patch_transformers()
        run_as_main(script, argv[1:])
    except ZeroConfigError as error:  # a bad --zero_* flag: the message says what to change
        say_once(f"{script.name}: {error}")  # every rank has the same error
        return 2
    return 0


def run_as_main(script: Path, args: list[str]) -> None:
    """Runs `script` in this process as `python SCRIPT args` would: its own argv, its folder first on the path."""
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


# What a rank imports before its script: transformers' Trainer stack and hf_zero's (and what `hf-zero run`'s fork
# server imports once for its ranks: hf_zero.cli.node_ranks.start_node_ranks).
RANK_IMPORTS = ("hf_zero.hf.trainer",)


def start_rank(end: Ending | None = None) -> None:
    """What a rank runs (`-m hf_zero.cli.run` under torchrun, or the former `-m hf_zero.run`; forked by `hf-zero
    run`). `end` ends it with its exit code: by default without the interpreter's teardown."""
    from hf_zero.runtime.host_memory import start_up_frozen

    with start_up_frozen():  # what main() imports as well
        for name in RANK_IMPORTS:
            importlib.import_module(name)
        from hf_zero.cli.rank_main import run_rank
    prog = Path(sys.argv[1]).name if len(sys.argv) > 1 else "hf_zero.cli.run"
    run_rank(main, prog, end)


if __name__ == "__main__":
    start_rank()
