"""The ZeRO engine: a model and its optimizer wrapped so that forward, backward and step run with the model states
partitioned across the data-parallel ranks.

    zero_engine.py  ZeroEngine (forward, backward, step, whole parameters, checkpoints) and `initialize`
    setup.py        how ZeroEngine is built, step by step: the checks, then the holder, precision, optimizer and
                    activation checkpointing applied in order
    compile.py      torch.compile of each block, the engine's hooks outside the compiled code (the `compile`
                    setting, the Trainer's --torch_compile)

The engine leaves the stages' work to hf_zero/zero/, the optimizer step and where its states live to
hf_zero/optim/, and checkpoints and weight exports to hf_zero/checkpoint/, which it calls with its parts.
May import hf_zero.settings, hf_zero.runtime, hf_zero.ops, hf_zero.zero, hf_zero.optim and hf_zero.checkpoint.
"""
from hf_zero.engine.zero_engine import NonFiniteGradientsError, ZeroEngine, initialize

__all__ = ["NonFiniteGradientsError", "ZeroEngine", "initialize"]
