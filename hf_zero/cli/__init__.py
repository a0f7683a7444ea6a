"""The hf-zero command: `hf-zero run`, `train`, `consolidate`, `estimate`, `build-ops`.

    commands.py   the subcommands and their flags, checked before any process starts
    run.py        `hf-zero run`: a user's script, on each rank, with the engine's flags
    train_lm.py   `hf-zero train`: a causal language model from the model zoo on a text file
    node_ranks.py this node's ranks, forked by torchrun's agent from one process that imported them once
    rank_main.py  what each launched rank runs around its main
    estimate.py   `hf-zero estimate`: per-rank model-state memory from the paper's formulas

The top layer: may import every other.
"""
from hf_zero.cli.commands import main

__all__ = ["main"]
