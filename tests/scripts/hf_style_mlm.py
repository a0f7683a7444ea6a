"""A third-party masked-LM script as hf-zero meets them: HfArgumentParser + TrainingArguments + Trainer from
transformers and nothing from hf_zero, shaped like transformers' run_mlm.py. BertForMaskedLM ties its decoder
to the word embeddings (stage 3 keeps that weight where both reach it). It trains a tiny BERT on random
tokens, 15% of them masked, and writes the Trainer's log history for the test to compare."""
import json
import os
from dataclasses import dataclass

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

VOCAB, MASK, SEQ = 64, 3, 16


@dataclass
class ModelArguments:
    num_hidden_layers: int = 2
    hidden_size: int = 32


def masked_blocks(count, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (count, SEQ), generator=g)
    masked = torch.rand(count, SEQ, generator=g) < 0.15
    return [{"input_ids": row.masked_fill(m, MASK), "labels": row.masked_fill(~m, -100)} for row, m in zip(ids, masked)]


def main():
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=model_args.hidden_size,
                                       num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=2,
                                       intermediate_size=2 * model_args.hidden_size, max_position_embeddings=SEQ,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    trainer = Trainer(model=model, args=training_args, train_dataset=masked_blocks(64, 1),
                      eval_dataset=masked_blocks(16, 2))
    trainer.train()
    trainer.save_metrics("eval", trainer.evaluate())
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
