"""The Hugging Face side: the Trainer, its arguments, and models built or loaded for ZeRO.

    trainer.py     ZeroTrainer and ZeroSeq2SeqTrainer: transformers' Trainer with the engine in place of its
                   optimizer, DDP and checkpoint handling
    flags.py       the Trainer's flags for the engine, and their check before any process starts
    arguments.py   ZeroTrainingArguments: transformers' TrainingArguments with those flags
    pretrained.py  from_pretrained for stage 3: each rank reads only its shards
    stock_init.py  transformers' own weight initialisation, run unit by unit under stage 3

May import every layer below it: settings, runtime, ops, zero, optim, checkpoint, engine.
"""
