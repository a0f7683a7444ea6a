"""Settings: what a run asks for, read and checked before any work starts.

    config.py            ZeroConfig, its one validator and the engine's flags (messages name the flag)
    deepspeed_config.py  a DeepSpeed JSON config read into a ZeroConfig
    flag_names.py        which flags belong to the engine, the Trainer or the launcher
    environment.py       the HF_ZERO_* and torchrun variables, read and checked in one place

The bottom layer: imports nothing else of hf_zero, and not torch (the hf-zero command checks flags before
any process starts, without torch's import time).
"""
