"""A third-party training script as hf-zero meets them: HfArgumentParser + TrainingArguments + Trainer from
transformers and nothing from hf_zero, shaped like transformers' run_clm.py. It trains a tiny GPT-2 on
random tokens, evaluates, saves the model, and (with --do_predict) saves the logits the trained model gives
for the evaluation blocks, which the test compares with the saved model reloaded by from_pretrained. With
--model_name_or_path it fine-tunes that checkpoint (AutoModelForCausalLM.from_pretrained), with --config_name
it builds the model from that config (from_config), as run_clm.py does; it then writes the log history."""
import json
import os
from dataclasses import dataclass

import evaluate  # noqa: F401  (first, as in run_clm.py: it swaps sys.modules["transformers"] for a new module)
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    n_layer: int = 2
    n_embd: int = 32
    model_name_or_path: str = None
    config_name: str = None


def blocks(count, seed):
    ids = torch.randint(0, 64, (count, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def main():
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    if model_args.model_name_or_path:
        set_seed(training_args.seed)
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    elif model_args.config_name:
        set_seed(training_args.seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_args.config_name))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_layer=model_args.n_layer, n_embd=model_args.n_embd, n_head=2,
                                           vocab_size=64, n_positions=16))
    trainer = Trainer(model=model, args=training_args, train_dataset=blocks(64, 1), eval_dataset=blocks(8, 2))
    if training_args.do_train:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
    if training_args.do_eval:
        trainer.save_metrics("eval", trainer.evaluate())
    if training_args.do_predict:
        logits = torch.as_tensor(trainer.predict(blocks(8, 2)).predictions)
        if trainer.is_world_process_zero():
            torch.save(logits, os.path.join(training_args.output_dir, "predict_logits.pt"))
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
