"""The classes as they were first published under this path (pickled training_args.bin files name it)."""
from hf_zero.hf.arguments import (
                               ZeroArgumentsMixin,
                               ZeroSeq2SeqTrainingArguments,
                               ZeroTrainingArguments,
)
from hf_zero.hf.flags import zero_config_from_flags

__all__ = ["ZeroArgumentsMixin", "ZeroSeq2SeqTrainingArguments", "ZeroTrainingArguments", "zero_config_from_flags"]
