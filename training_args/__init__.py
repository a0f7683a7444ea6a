"""ZeroTrainingArguments: transformers' TrainingArguments plus the ZeRO engine's settings as --zero_* flags."""
from training_args.zero_training_args import (
    ZeroArgumentsMixin,
    ZeroSeq2SeqTrainingArguments,
    ZeroTrainingArguments,
    zero_config_from_flags,
)

__all__ = ["ZeroArgumentsMixin", "ZeroSeq2SeqTrainingArguments", "ZeroTrainingArguments", "zero_config_from_flags"]
