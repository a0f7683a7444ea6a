"""Sequence-to-sequence fine-tuning on local JSON-lines pairs, written like transformers' run_translation.py.

It imports only transformers and datasets, so it runs on the stock Seq2SeqTrainer as it is; started through
hf-zero it trains with ZeRO, and every --zero_* flag works. Each line of --train_file holds one pair:
{"translation": {"en": "...", "de": "..."}}, the keys named by --source_lang and --target_lang.

    hf-zero run --nproc_per_node 2 examples/run_translation.py --zero_stage 3 --use_cpu \\
        --model_name_or_path ./my-seq2seq-model --source_lang en --target_lang de \\
        --train_file train.json --validation_file valid.json \\
        --do_train --do_eval --predict_with_generate --max_steps 200 --output_dir out/translation

--output_router_logits adds a mixture-of-experts model's router losses (SwitchTransformers' z-loss and
load-balancing loss) to its loss; the model's forward leaves them out unless asked.
Scores are exact matches of the generated text (sacrebleu would need the Hub).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "local folder of a pretrained sequence-to-sequence model"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "local tokenizer folder, if not the model's"})
    output_router_logits: bool = field(default=False, metadata={"help": "add a mixture of experts' router losses"})


@dataclass
class DataTrainingArguments:
    source_lang: str = field(metadata={"help": "the key of the source text in each pair"})
    target_lang: str = field(metadata={"help": "the key of the target text in each pair"})
    train_file: str | None = field(default=None, metadata={"help": "JSON lines of {'translation': {...}}"})
    validation_file: str | None = field(default=None, metadata={"help": "JSON lines, for --do_eval"})
    test_file: str | None = field(default=None, metadata={"help": "JSON lines, for --do_predict"})
    source_prefix: str = field(default="", metadata={"help": "put before every source text (T5's task prefix)"})
    max_source_length: int = field(default=128)
    max_target_length: int = field(default=128)
    num_beams: int | None = field(default=None, metadata={"help": "beams for generation in eval and predict"})


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    wanted = {"train": (training_args.do_train, data_args.train_file, "--do_train"),
              "validation": (training_args.do_eval, data_args.validation_file, "--do_eval"),
              "test": (training_args.do_predict, data_args.test_file, "--do_predict")}
    for split, (asked, path, flag) in wanted.items():
        if asked and path is None:
            parser.error(f"{flag} needs --{split}_file")
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    if model.config.decoder_start_token_id is None:
        parser.error(f"{model_args.model_name_or_path}'s config has no decoder_start_token_id")

    raw = load_dataset("json", data_files={split: path for split, (asked, path, _) in wanted.items() if asked})

    def tokenize(batch):
        pairs = batch["translation"]
        features = tokenizer([data_args.source_prefix + p[data_args.source_lang] for p in pairs],
                             max_length=data_args.max_source_length, truncation=True)
        targets = tokenizer(text_target=[p[data_args.target_lang] for p in pairs],
                            max_length=data_args.max_target_length, truncation=True)
        features["labels"] = targets["input_ids"]
        return features

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = {split: ds.map(tokenize, batched=True, remove_columns=ds.column_names) for split, ds in raw.items()}

    pad_labels = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def collate(features):
        batch = pad_labels(features)
        if model_args.output_router_logits:
            batch["output_router_logits"] = True
        return batch

    def decode(rows):
        # The Trainer pads what it gathers from the ranks with -100, which is no token.
        return [text.strip() for text in tokenizer.batch_decode(
            [[t for t in row if t != -100] for row in rows], skip_special_tokens=True)]

    def exact_match(prediction):
        decoded, references = decode(prediction.predictions), decode(prediction.label_ids)
        return {"exact_match": sum(d == r for d, r in zip(decoded, references)) / len(references)}

    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=tokenized.get("train"),
                             eval_dataset=tokenized.get("validation"), processing_class=tokenizer,
                             data_collator=collate,
                             compute_metrics=exact_match if training_args.predict_with_generate else None)
    generation = {"max_length": data_args.max_target_length, "num_beams": data_args.num_beams}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval", **generation)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.do_predict:
        predicted = trainer.predict(tokenized["test"], metric_key_prefix="predict", **generation)
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            with open(os.path.join(training_args.output_dir, "generated_predictions.txt"), "w") as out:
                out.write("\n".join(decode(predicted.predictions)))


if __name__ == "__main__":
    main()
