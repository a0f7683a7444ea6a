"""ZeroTrainingArguments: transformers' TrainingArguments plus the ZeRO engine's settings as --zero_* flags.

The flags are made from hf_zero.ZeroConfig's declarations (hf_zero/hf/flags.py); this package is the
import path scripts use, and depends on hf_zero, never the other way round."""
from hf_zero.hf.arguments import (
    ZeroArgumentsMixin,
    ZeroSeq2SeqTrainingArguments,
    ZeroTrainingArguments,
)
from hf_zero.hf.flags import zero_config_from_flags

__all__ = ["ZeroArgumentsMixin", "ZeroSeq2SeqTrainingArguments", "ZeroTrainingArguments", "zero_config_from_flags"]
