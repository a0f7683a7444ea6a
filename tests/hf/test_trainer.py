"""ZeroTrainer against the stock transformers Trainer with DDP: same data, seed and schedule on 2 gloo ranks."""
from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_zero import ZeroTrainer
from hf_zero.checkpoint.consolidate import consolidate
from hf_zero.runtime.launch import spawn_gloo
from tests.checkpoint_helpers import PROBE_IDS, assert_same_logits
from tests.helpers import assert_saved_as_stock_saves, tiny_converted_model
from tests.hub_stand_in import HubStandIn, hub_env
from tests.settings.test_deepspeed_config import TRANSFORMERS_ZERO3
from tests.trainer_helpers import (
    EVAL_EXAMPLES,
    TRAIN_EXAMPLES,
    TrainerRun,
    bf16_saving_runs,
    delayed_update_run,
    evaluation_gathers,
    evaluation_under_nvme_offload,
    gpt2_model,
    lm_examples,
    logging_runs,
    pushing_run,
    resume_runs,
    run_trainers,
    saving_run,
    tensor_parallel_arguments,
    tensor_parallel_resume_runs,
    tensor_parallel_runs,
)

STAGES = (0, 1, 2, 3)
PEFT = ("lora", "prompt_tuning")
# transformers' documented ds_config_zero3.json, offloading to CPU, without its scheduler block (DeepSpeed's
# WarmupDecayLR runs transformers' linear schedule one step later, tests/settings/test_deepspeed_config.py): the
# stock run's schedule. Its "auto" optimizer is the Trainer's AdamW over every parameter in one group, which
# with --weight_decay 0 steps as the Trainer's two groups do.
TRANSFORMERS_ZERO3_WITHOUT_SCHEDULER = {k: v for k, v in TRANSFORMERS_ZERO3.items() if k != "scheduler"}
# T5's loss ignores num_items_in_batch (transformers 5.24): the stock Trainer multiplies its mean loss by the
# number of processes and, with accumulation, sums the micro-batches' losses, where hf_zero trains as one process
# on the global batch (tests/cli/test_run.py checks that against one process). Stock DDP without accumulation and
# with average_tokens_across_devices off averages the ranks' means: one process's loss on these equal-length
# examples, so it stays the reference for the ranks' own generations.
T5_WINDOW = {"gradient_accumulation_steps": 1}
FUSED = {"optim": "adamw_torch_fused"}  # the Trainer's default on a GPU
RUNS = ([TrainerRun("stock_gpt2", None)] + [TrainerRun(f"zero{s}_gpt2", s) for s in STAGES]
        + [TrainerRun(f"zero{s}_checkpointing_gpt2", s, args={"gradient_checkpointing": True}) for s in (2, 3)]
        + [TrainerRun("stock_t5", None, "t5", args={**T5_WINDOW, "average_tokens_across_devices": False}),
           TrainerRun("zero3_t5", 3, "t5", args=T5_WINDOW)]
        + [TrainerRun(f"stock_{method}_gpt2", None, peft=method) for method in PEFT]
        + [TrainerRun(f"zero{s}_{method}_gpt2", s, peft=method) for method in PEFT for s in (1, 2, 3)]
        + [TrainerRun("zero3_deepspeed_config_gpt2", 3, args={"deepspeed": TRANSFORMERS_ZERO3_WITHOUT_SCHEDULER})]
        + [TrainerRun("zero3_fused_gpt2", 3, args=FUSED)]
        # Last: its --log_level info stays transformers' verbosity for the runs after it in the process.
        + [TrainerRun("zero_auto_gpt2", "auto", args={"log_level": "info"}),
           TrainerRun("zero_auto_lora_gpt2", "auto", peft="lora", args={"log_level": "info"})])


@pytest.fixture(scope="module")
def trainer_runs() -> list[dict]:
    return spawn_gloo(run_trainers, 2, RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_trainer_logs_the_stock_trainers_losses(trainer_runs, stage):
    """20 optimizer steps, accumulation 2 (with a short last window each epoch), max_grad_norm 1.0."""
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0][f"zero{stage}_gpt2"]
    assert zero["engine_stage"] == stage
    assert zero["global_step"] == stock["global_step"] == 20
    assert len(zero["losses"]) == len(stock["losses"]) == 20
    assert max(abs(a - b) for a, b in zip(zero["losses"], stock["losses"])) < 1e-4
    assert stock["losses"][-1] < stock["losses"][0] - 0.1  # it trains: the comparison is not between constants


@pytest.mark.slow
def test_with_the_fused_adamw_the_zero_trainer_logs_the_stock_trainers_losses_norms_and_lrs(trainer_runs):
    """--optim adamw_torch_fused at stage 3 (stage 2's step): the device decides each step (clipping, a skipped
    step) and the Trainer reads the norm only when it logs. The stock run's AdamW is the for-loop one: the same
    arithmetic, to an ulp a step."""
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0]["zero3_fused_gpt2"]
    assert zero["global_step"] == stock["global_step"] == 20
    assert max(abs(a - b) for a, b in zip(zero["losses"], stock["losses"])) < 1e-4
    assert max(abs(a - b) / b for a, b in zip(zero["grad_norms"], stock["grad_norms"])) < 1e-4
    assert any(n > 1.0 for n in stock["grad_norms"])
    assert zero["lrs"] == stock["lrs"]
    assert zero["engine_global_grad_norm"] == pytest.approx(zero["grad_norms"][-1], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_logged_grad_norm_is_the_global_norm(trainer_runs, stage):
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0][f"zero{stage}_gpt2"]
    # The stock Trainer's norm comes from clip_grad_norm_ over DDP's all-reduced gradients.
    assert max(abs(a - b) / b for a, b in zip(zero["grad_norms"], stock["grad_norms"])) < 1e-4
    assert any(n > 1.0 for n in stock["grad_norms"])  # clipping at 1.0 took effect on some steps
    assert zero["lrs"] == stock["lrs"]
    for rank in trainer_runs:  # every rank logs the same, global, value
        assert rank[f"zero{stage}_gpt2"]["grad_norms"] == zero["grad_norms"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_evaluate_and_predict_match_the_stock_trainer(trainer_runs, stage):
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0][f"zero{stage}_gpt2"]
    assert abs(zero["eval_loss"] - stock["eval_loss"]) < 1e-4
    torch.testing.assert_close(zero["predictions"], stock["predictions"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_checkpointing_recomputes_with_the_same_losses(trainer_runs, stage):
    """At stage 3 recomputation in backward runs the blocks' forward hooks again, gathering their units."""
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0][f"zero{stage}_checkpointing_gpt2"]
    assert max(abs(a - b) for a, b in zip(zero["losses"], stock["losses"])) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("method", PEFT)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_peft_adapter_fine_tunes_at_every_stage_as_under_stock_ddp(trainer_runs, stage, method):
    """peft's LoRA on the attention, and prompt tuning (virtual tokens' embeddings, in peft's prompt encoder),
    through the Trainer's own AdamW: its decay group holds the adapters and its no-decay group nothing, an empty
    group torch takes and so must the engine (it refused it before). The losses, grad norms and trained adapters
    are stock DDP's; the frozen base is never written; save_model writes the adapter, as stock does."""
    stock, zero = trainer_runs[0][f"stock_{method}_gpt2"], trainer_runs[0][f"zero{stage}_{method}_gpt2"]
    assert zero["engine_stage"] == stage
    assert max(abs(a - b) for a, b in zip(zero["losses"], stock["losses"])) < 1e-4
    assert max(abs(a - b) / b for a, b in zip(zero["grad_norms"], stock["grad_norms"])) < 1e-4
    assert sorted(zero["trainable"]) == sorted(stock["trainable"])
    assert all(("lora_" if method == "lora" else "prompt_encoder") in n for n in stock["trainable"])
    for name, adapter in stock["trainable"].items():
        torch.testing.assert_close(zero["trainable"][name], adapter, atol=1e-5, rtol=0)
    if method == "lora":  # LoRA's B starts at zero: it moved, so the adapters were trained, not compared at start
        assert min(a.abs().max().item() for n, a in stock["trainable"].items() if "lora_B" in n) > 1e-3
    assert zero["frozen_moved"] == stock["frozen_moved"] == 0.0
    # save_model writes the adapter peft's from_pretrained loads, bit for bit the trained one (at stage 3 it
    # wrote a LoRA adapter of no tensors, and peft loaded an untrained one with a warning; prompt tuning's save
    # ran peft's prompt encoder on its partitioned weight and failed).
    assert sorted(zero["saved_adapter"]) == sorted(zero["trainable"])
    for name, adapter in zero["trainable"].items():
        assert torch.equal(zero["saved_adapter"][name], adapter), name


@pytest.mark.slow
@pytest.mark.parametrize("method", PEFT)
def test_a_peft_checkpoint_consolidates_into_its_adapter_and_merges_as_peft_merges_it(trainer_runs, method):
    """`hf-zero consolidate` of a stage-3 peft checkpoint writes the adapter folder peft loads onto the base (it
    wrote the PeftModel's prefixed keys under the architecture PeftModelForCausalLM, which from_pretrained loaded
    as an untrained model); `--merge` writes the base model with the LoRA merged in, as peft's merge_and_unload of
    the adapter save_model wrote gives it."""
    zero = trainer_runs[0][f"zero3_{method}_gpt2"]
    assert sorted(zero["consolidated_adapter"]) == sorted(zero["trainable"])
    for name, adapter in zero["trainable"].items():
        assert torch.equal(zero["consolidated_adapter"][name], adapter), name
    if method == "lora":
        assert zero["merged"].keys() == zero["peft_merged"].keys()
        assert not any("lora" in name for name in zero["merged"])
        for name, tensor in zero["peft_merged"].items():
            assert torch.equal(zero["merged"][name], tensor), name


@pytest.mark.slow
def test_transformers_documented_deepspeed_config_trains_as_stock_ddp(trainer_runs):
    """`--deepspeed ds_config_zero3.json` as transformers documents it: stage 3 with parameters and optimizer states
    offloaded to CPU, every "auto" filled from the TrainingArguments and the model (buckets sized by its hidden
    size, as transformers sizes them), and the Trainer's losses, grad norms, rates and evaluation those of stock."""
    stock, zero = trainer_runs[0]["stock_gpt2"], trainer_runs[0]["zero3_deepspeed_config_gpt2"]
    config, hidden = zero["engine_config"], gpt2_model().config.hidden_size
    assert (config.zero_stage, config.offload_optimizer, config.offload_param) == (3, "cpu", "cpu")
    assert (config.reduce_bucket_size, config.param_persistence_threshold) == (hidden * hidden, 10 * hidden)
    assert max(abs(a - b) for a, b in zip(zero["losses"], stock["losses"])) < 1e-4
    assert max(abs(a - b) / b for a, b in zip(zero["grad_norms"], stock["grad_norms"])) < 1e-4
    assert zero["lrs"] == stock["lrs"] and abs(zero["eval_loss"] - stock["eval_loss"]) < 1e-4


@pytest.mark.slow
def test_zero_stage_auto_trains_as_the_planned_stage_given_and_checks_the_step_against_the_plan(trainer_runs):
    """--zero_stage auto: rank 0 plans the model for the first batch on this machine, every rank trains with the
    choice, exactly as the run given that stage (the first batch is read with every random generator kept), and the
    second step's measured peak is set beside the plan's."""
    for rank, runs in enumerate(trainer_runs):
        auto = runs["zero_auto_gpt2"]
        chosen = auto["engine_config"]
        given = runs[f"zero{chosen.zero_stage}_gpt2"]
        assert (chosen.offload_optimizer, chosen.offload_param) == ("none", "none") == \
            (given["engine_config"].offload_optimizer, given["engine_config"].offload_param)
        assert auto["losses"] == given["losses"] and auto["grad_norms"] == given["grad_norms"]
        assert auto["eval_loss"] == given["eval_loss"]
        if rank == 0:
            planned = next(line for line in auto["said"] if line.startswith("planned: "))
            assert planned.startswith(f"planned: --zero_stage {chosen.zero_stage} ") and "chosen" in planned
            checked = [line for line in auto["said"] if "at its peak" in line]
            assert len(checked) == 1 and checked[0].startswith("rank 0: the step took "), auto["said"]


@pytest.mark.slow
def test_zero_stage_auto_plans_a_lora_adapter_and_fine_tunes_it_as_under_stock_ddp(trainer_runs):
    """--zero_stage auto around peft's LoRA: the plan trains the adapter alone (its trained parameters and the
    optimizer states of those), and every rank fine-tunes with the choice as stock DDP does."""
    stock = trainer_runs[0]["stock_lora_gpt2"]
    for rank, runs in enumerate(trainer_runs):
        auto = runs["zero_auto_lora_gpt2"]
        assert auto["engine_stage"] == auto["engine_config"].zero_stage
        assert max(abs(a - b) for a, b in zip(auto["losses"], stock["losses"])) < 1e-4
        assert max(abs(a - b) / b for a, b in zip(auto["grad_norms"], stock["grad_norms"])) < 1e-4
        assert auto["frozen_moved"] == 0.0
        if rank == 0:
            for name, adapter in stock["trainable"].items():
                torch.testing.assert_close(auto["trainable"][name], adapter, atol=1e-5, rtol=0)
            planned = next(line for line in auto["said"] if line.startswith("planned: "))
            assert planned.startswith(f"planned: --zero_stage {auto['engine_stage']} ")
            trained = sum(adapter.numel() for adapter in stock["trainable"].values())
            assert f" parameters, {trained:,} trained; " in planned  # the adapter alone, as stock DDP trains it


@pytest.mark.slow
def test_seq2seq_generation_at_stage3_with_ranks_finishing_at_different_lengths(trainer_runs):
    for rank, result in enumerate(trainer_runs):
        stock, zero = result["stock_t5"], result["zero3_t5"]
        assert abs(zero["losses"][-1] - stock["losses"][-1]) < 1e-4
        assert torch.equal(zero["generated"], stock["generated"])
    # Predictions are gathered from both ranks: rank 0's half ended after 3 tokens, rank 1's after 6.
    generated = trainer_runs[0]["zero3_t5"]["generated"]
    eos_position = (generated == 1).int().argmax(dim=1)
    assert eos_position.tolist() == [3] * 4 + [6] * 4
    assert len(set(generated[:, 1:6].flatten().tolist())) > 2  # real tokens, not a constant


@pytest.mark.slow
def test_resuming_a_two_rank_run_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Stages 1-3, and LoRA at stage 3: the adapter and the partitioned base come back from the checkpoint."""
    results = spawn_gloo(resume_runs, 2, str(tmp_path))
    for run in ("stage1", "stage2", "stage3", "stage3_lora"):
        assert results[0][f"{run}_checkpoints"] == ["checkpoint-3", "checkpoint-6"]
        straight, resumed = results[0][run]["straight"], results[0][run]["resumed"]
        assert straight.keys() == resumed.keys()
        for name, p in straight.items():
            assert torch.equal(p, resumed[name]), f"{run}: {name} differs after resuming"
    assert any("lora_B" in name for name in results[0]["stage3_lora"]["straight"])


def test_zero_trainer_needs_zero_training_arguments(tmp_path):
    with pytest.raises(TypeError, match="needs its arguments as training_args.ZeroTrainingArguments"):
        ZeroTrainer(model=gpt2_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("saving")
    return root, spawn_gloo(saving_run, 2, str(root))[0]


@pytest.mark.slow
def test_load_best_model_at_end_restores_the_best_checkpoint_and_save_total_limit_keeps_it(saved_run):
    root, run = saved_run
    assert run["evals"][0] == max(run["evals"]) and run["best"] == "checkpoint-2"  # the best is not the last
    assert run["checkpoints"] == ["checkpoint-2", "checkpoint-8"]
    assert run["eval_loss_after"] == run["best_metric"]
    # The engine checkpoint it loaded and the weights save_model wrote beside it agree.
    with safe_open(str(root / "run" / "checkpoint-2" / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    for name, param in run["params"].items():
        if name != "lm_head.weight":  # tied to transformer.wte.weight, saved once
            assert torch.equal(saved[name], param), name


@pytest.mark.slow
def test_stage3_save_model_writes_a_folder_from_pretrained_loads_with_the_same_logits(saved_run):
    root, run = saved_run
    model = GPT2LMHeadModel.from_pretrained(root / "final").eval()
    with torch.no_grad():
        assert_same_logits(model(input_ids=PROBE_IDS).logits, run["logits"])
    assert AutoTokenizer.from_pretrained(root / "final").vocab_size == 30522  # the tokenizer went along


@pytest.mark.slow
def test_a_trainer_checkpoint_consolidates_to_its_saved_weights_with_tokenizer(saved_run, tmp_path):
    root, _ = saved_run
    checkpoint = root / "run" / "checkpoint-8"
    consolidate(checkpoint, tmp_path, progress=False)
    assert AutoTokenizer.from_pretrained(tmp_path).vocab_size == 30522
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as ours, \
            safe_open(str(checkpoint / "model.safetensors"), framework="pt") as saved:
        assert set(ours.keys()) == set(saved.keys())
        for key in saved.keys():
            assert torch.equal(ours.get_tensor(key), saved.get_tensor(key)), key


@pytest.mark.parametrize("kind", ["mixtral", "lara_mini"])
def test_a_converted_models_checkpoint_saved_model_and_consolidation_are_what_stock_save_pretrained_writes(
        kind, tmp_path):
    """Trained 2 steps at stage 3 in this process: checkpoint-2's weights, save_model's and `hf-zero consolidate`'s
    of checkpoint-2 are stock save_pretrained's of the trained weights, in the checkpoint layout transformers loads
    Mixtral's experts (one tensor each) and LaraMini's `in_proj` (four projections in one tensor) from."""
    from training_args import ZeroTrainingArguments

    args = ZeroTrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[], max_steps=2,
                                 save_strategy="steps", save_steps=2, per_device_train_batch_size=4, disable_tqdm=True,
                                 zero_stage=3, learning_rate=1e-2)
    trainer = ZeroTrainer(model=tiny_converted_model(kind), args=args, train_dataset=lm_examples(16, seed=1))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    with trainer.engine.gathered_parameters():
        trained = {name: t.clone() for name, t in trainer.model.state_dict().items()}
    stock = tiny_converted_model(kind)
    stock.load_state_dict(trained)
    stock.save_pretrained(tmp_path / "stock")
    consolidate(tmp_path / "run" / "checkpoint-2", tmp_path / "consolidated", progress=False)
    for folder in ("run/checkpoint-2", "final", "consolidated"):
        assert_saved_as_stock_saves(tmp_path / folder, tmp_path / "stock")


@pytest.mark.slow
def test_under_bf16_save_model_writes_the_fp32_masters_as_stock_writes_its_fp32_weights(tmp_path):
    """The stock Trainer under --bf16 keeps an fp32 model (autocast computes in bf16) and saves fp32. The engine
    computes with bf16 parameters over fp32 masters: save_model writes the masters, bitwise, at stages 1 and 3
    (it wrote the bf16 parameters before, each weight rounded to 8 bits of mantissa)."""
    from safetensors.torch import load_file

    stock = Trainer(model=gpt2_model(), args=TrainingArguments(
        output_dir=str(tmp_path / "stock"), bf16=True, max_steps=1, use_cpu=True, report_to=[], save_strategy="no",
        per_device_train_batch_size=4), train_dataset=lm_examples(TRAIN_EXAMPLES, seed=1))
    stock.train()
    stock.save_model(str(tmp_path / "stock"))
    stock_dtypes = {t.dtype for t in load_file(str(tmp_path / "stock" / "model.safetensors")).values()}
    assert stock_dtypes == {torch.float32}
    for stage, run in spawn_gloo(bf16_saving_runs, 2, str(tmp_path))[0].items():
        assert {t.dtype for t in run["saved"].values()} == stock_dtypes, stage
        assert run["masters"].keys() <= run["saved"].keys()
        for name, master in run["masters"].items():
            assert torch.equal(run["saved"][name], master), (stage, name)
        assert any(not torch.equal(m, m.bfloat16().float()) for m in run["masters"].values())  # not bf16 values


@pytest.mark.slow
def test_push_to_hub_at_stage3_uploads_consolidated_weights_that_load(tmp_path, monkeypatch):
    with HubStandIn(tmp_path / "hub") as hub:
        for key, value in hub_env(hub).items():
            monkeypatch.setenv(key, value)
        # Fresh interpreters: huggingface_hub reads HF_ENDPOINT when imported, and a forkserver has.
        run = spawn_gloo(pushing_run, 2, str(tmp_path), start_method="spawn")[0]
    assert hub.unexpected == []
    assert [c["summary"] for c in hub.commits] == ["Training in progress, step 2", "Training in progress, step 4",
                                                   "End of training"]
    files = hub.files("user/zero3-tiny-gpt2")
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md", "training_args.bin"} <= set(files)
    assert not [f for f in files if "zero_checkpoint" in f or f.startswith("rank")]  # engine shards stay local
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hub" / "user" / "zero3-tiny-gpt2").eval()
    for name, param in model.named_parameters():
        assert torch.equal(param, run["params"][name]), name
    with torch.no_grad():
        assert_same_logits(model(input_ids=PROBE_IDS).logits, run["logits"])


@pytest.mark.slow
def test_stage3_evaluation_gathers_each_unit_once_per_loop_not_once_per_batch(tmp_path):
    """Evaluate() runs a forward per batch on weights that do not change; at stage 3 the units are gathered
    once when the loop starts and freed when it ends (within generation_max_live_parameters), not again by every
    batch's forward. The loss is the per-forward path's, bit for bit (and stock's:
    test_evaluate_and_predict_match_the_stock_trainer)."""
    for rank in spawn_gloo(evaluation_gathers, 2, str(tmp_path)):
        kept, per_forward = rank["kept"], rank["per_forward"]
        assert kept["eval_loss"] == per_forward["eval_loss"]
        assert kept["gathers"] == kept["units"]  # each unit once, the root included
        assert per_forward["gathers"] >= 3 * (per_forward["units"] - 1)  # every batch gathers every block again
        assert kept["left_gathered"] == per_forward["left_gathered"] == 0


def test_trainer_runs_with_the_delayed_update_are_equal_bitwise_whenever_the_update_runs(tmp_path):
    """The Trainer's scheduler sets the next step's learning rate right after optimizer.step(), while the delayed
    update of that step runs in the background: each update must step with its own step's rate, so that the run does
    not depend on when the thread reads it (runs of one script parted at step 5 by 0.004 in the adapters)."""
    runs = {when: delayed_update_run(str(tmp_path / when.replace(" ", "_")), when)
            for when in ("in the background", "at once", "late")}
    assert any("lora" in name for name in runs["at once"])
    for name, tensor in runs["at once"].items():
        assert torch.equal(tensor, runs["in the background"][name]) and torch.equal(tensor, runs["late"][name]), name


def test_stage3_with_parameters_on_nvme_never_holds_the_whole_model_in_evaluation_unless_it_fits(tmp_path, caplog):
    """A user offloads parameters because the model does not fit: evaluate(), predict() and generate() keep units
    gathered only up to what a training step holds (the largest unit and prefetch_bucket_size), never every unit at
    once; a model within that still has every unit gathered once per loop. Their results are the same bit for bit."""
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        beyond = evaluation_under_nvme_offload(str(tmp_path / "beyond"), prefetch_bucket_size=0)
    assert "budget" in caplog.text and "offload_param nvme: what a training step holds gathered" in caplog.text
    assert len([r for r in caplog.records if "units gathered in generate() and evaluation loops" in r.message]) == 1
    within = evaluation_under_nvme_offload(str(tmp_path / "within"), prefetch_bucket_size=10**9)
    units = beyond["units"]
    assert units >= 4  # the root and the blocks: holding all but one would still be most of the model
    for loop in ("evaluate", "predict", "generate"):
        assert beyond[loop]["most_gathered"] < units, loop
        assert within[loop]["most_gathered"] == units and within[loop]["gathers"] == units, loop
        assert beyond[loop]["gathers"] > units, loop  # gathered again by later forwards
    assert beyond["evaluate"]["output"] == within["evaluate"]["output"]
    assert (beyond["predict"]["output"] == within["predict"]["output"]).all()
    assert torch.equal(beyond["generate"]["output"], within["generate"]["output"])


@pytest.mark.slow
def test_tensor_parallel_trainer_with_partitioned_cpu_checkpoints_logs_the_stock_trainers_losses(tmp_path):
    """--tensor_parallel_size 2 (dp 2) and 4 (dp 1) on 4 ranks, --zero_partition_activations
    --zero_cpu_checkpointing, against the stock Trainer in one process on the same global batch of 8:
    losses, gradient norms, evaluation loss, predictions and the count of tokens seen."""
    runs = spawn_gloo(tensor_parallel_runs, 4, str(tmp_path))
    stock = Trainer(model=gpt2_model("gpt2-tp"), args=TrainingArguments(**tensor_parallel_arguments(
        str(tmp_path / "stock"), 8, 1)), train_dataset=lm_examples(TRAIN_EXAMPLES, 1),
        eval_dataset=lm_examples(EVAL_EXAMPLES, 2))
    stock.train()
    logs = [h for h in stock.state.log_history if "loss" in h]
    stock_losses, stock_norms = [h["loss"] for h in logs], [h["grad_norm"] for h in logs]
    stock_eval_loss, stock_prediction = stock.evaluate()["eval_loss"], stock.predict(lm_examples(EVAL_EXAMPLES, 2))
    assert stock_losses[-1] < stock_losses[0] - 0.1
    for tp in (2, 4):
        for rank_result in runs:
            run = rank_result[f"tp{tp}"]
            assert max(abs(a - b) for a, b in zip(run["losses"], stock_losses)) < 1e-4
            assert run["grad_norms"] == pytest.approx(stock_norms, rel=1e-4)
            assert run["checkpoint_bytes"]["device"] == 0 and run["checkpoint_bytes"]["host"] > 0
            # Evaluation counts each sample once, though every rank of a tp group computed it.
            assert run["eval_loss"] == pytest.approx(stock_eval_loss, abs=1e-4)
            assert run["prediction"].predictions.shape == stock_prediction.predictions.shape
            assert (run["prediction"].label_ids == stock_prediction.label_ids).all()
            assert abs(run["prediction"].predictions - stock_prediction.predictions).max() < 1e-3
            assert run["tokens_seen"] == stock.state.num_input_tokens_seen
        # The saved model is transformers' own folder: it loads and gives the trained model's logits.
        saved = GPT2LMHeadModel.from_pretrained(tmp_path / f"tp{tp}" / "final")
        with torch.no_grad():
            assert_same_logits(saved(input_ids=PROBE_IDS).logits, stock.model(input_ids=PROBE_IDS).logits)
    # Under --bf16 with gradient checkpointing (its recomputation failed before: fp32 DTensor wrappers over bf16
    # parts), the gradients are the fp32 run's to bf16's precision; save_model writes the fp32 masters whole, as
    # stock writes its fp32 model (it wrote the bf16 parameters before); the rest (buffers) in fp32.
    bf16 = runs[0]["tp2_bf16"]
    assert bf16["grad_norms"] == pytest.approx(runs[0]["tp2"]["grad_norms"][:2], rel=1e-2)
    assert {t.dtype for t in bf16["saved"].values()} == {torch.float32}
    assert bf16["masters"].keys() <= bf16["saved"].keys()
    for name, master in bf16["masters"].items():
        assert torch.equal(bf16["saved"][name], master), name
    assert any(not torch.equal(m, m.bfloat16().float()) for m in bf16["masters"].values())  # not bf16 values


@pytest.mark.slow
def test_resuming_a_tensor_parallel_run_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """--tensor_parallel_size 2 x dp 2 at stage 3 with P_a: the Trainer's checkpoint-3 resumes to the
    same parameters as the 6 steps straight through."""
    for rank_result in spawn_gloo(tensor_parallel_resume_runs, 4, str(tmp_path)):
        for name, param in rank_result["straight"].items():
            assert torch.equal(param, rank_result["resumed"][name]), f"{name} differs after resuming"
    assert (tmp_path / "straight" / "checkpoint-3" / "zero_checkpoint" / "manifest.json").is_file()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA (r 4, alpha 8) on a tiny GPT-2, trained 2 steps at stage 1 in this process, checkpoint-2 saved."""
    from peft import LoraConfig, get_peft_model

    from training_args import ZeroTrainingArguments

    out = tmp_path_factory.mktemp("lora") / "run"
    args = ZeroTrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=2, save_strategy="steps",
                                 save_steps=2, per_device_train_batch_size=4, disable_tqdm=True, zero_stage=1)
    model = get_peft_model(gpt2_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    ZeroTrainer(model=model, args=args, train_dataset=lm_examples(16, seed=1)).train()
    return out


def resume_lora(run_folder, tmp_path, base=None, **lora):
    """A fresh Trainer resuming `run_folder`'s checkpoint-2 (copied) with this adapter and base, to step 3."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from training_args import ZeroTrainingArguments

    out = tmp_path / "run"
    shutil.copytree(run_folder, out)
    args = ZeroTrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=3, save_strategy="no",
                                 per_device_train_batch_size=4, disable_tqdm=True, zero_stage=1)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "lora_dropout": 0.0, **lora}
    model = get_peft_model(base if base is not None else gpt2_model(), LoraConfig(**settings))
    trainer = ZeroTrainer(model=model, args=args, train_dataset=lm_examples(16, seed=1))
    trainer.train(resume_from_checkpoint=True)
    return trainer


@pytest.mark.parametrize("changed, says", [
    ({"lora_alpha": 32}, "was saved with lora_alpha 8, and this model's adapter has lora_alpha 32"),
    ({"r": 8}, "was saved with r 4, and this model's adapter has r 8"),
    ({"target_modules": ["c_attn", "c_proj"]}, "was saved with target_modules ['c_attn'], and this model's adapter "
                                               "has target_modules ['c_attn', 'c_proj']"),
])
def test_a_lora_checkpoint_resumed_into_another_adapter_is_refused_naming_the_setting(lora_run, tmp_path, changed,
                                                                                      says):
    """Alpha 32 against a checkpoint of alpha 8 loaded without a word, and another r gave a
    traceback per rank from peft's load, before the engine's own check."""
    from hf_zero.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=re.escape(says)) as refused:
        resume_lora(lora_run, tmp_path, **changed)
    assert "adapter_config.json" in str(refused.value) and "\n" not in str(refused.value)


def test_a_lora_checkpoint_resumed_onto_another_base_is_refused_and_the_same_base_resumes(lora_run, tmp_path):
    """A base of the same shapes but other values got the checkpoint's old base put back, where
    stock keeps the base the script built. Here the adapter must resume on the base it was trained on."""
    from hf_zero.checkpoint import CheckpointError

    other = gpt2_model()
    with torch.no_grad():
        other.transformer.h[0].mlp.c_fc.weight.add_(0.01)
    with pytest.raises(CheckpointError, match=r"the frozen weight \S*transformer.h.0.mlp.c_fc.weight differs from the "
                                              r"checkpoint's \(by up to 0.01\)"):
        resume_lora(lora_run, tmp_path / "other", base=other)
    trainer = resume_lora(lora_run, tmp_path / "same")
    assert trainer.state.global_step == 3


@pytest.fixture(scope="module")
def logging_runs_on_two_ranks(tmp_path_factory):
    return spawn_gloo(logging_runs, 2, str(tmp_path_factory.mktemp("logging")))


@pytest.mark.slow
def test_what_each_rank_holds_and_sends_is_said_at_the_stock_trainers_logging_steps_only(logging_runs_on_two_ranks):
    """30 steps at --logging_steps 10, then evaluate: a line at each of the 3 steps the stock Trainer logs a loss at,
    on rank 0 (--log_level info); none at the end of training or for the evaluation, none on rank 1
    (--log_level_replica is warning)."""
    stock, zero = logging_runs_on_two_ranks[0]["stock"], logging_runs_on_two_ranks[0]["zero2"]
    assert zero["loss_steps"] == stock["loss_steps"] == [10, 20, 30]
    reports = [line for line in zero["said"] if line.startswith("rank 0 holds")]
    assert len(reports) == len(stock["loss_steps"]), zero["said"]
    assert not any("holds" in line for line in stock["said"] + logging_runs_on_two_ranks[1]["zero2"]["said"])


@pytest.mark.slow
def test_each_logging_step_gives_the_callbacks_the_bytes_held_and_sent_per_link_beside_the_loss(
        logging_runs_on_two_ranks):
    """Stage 2 in fp32 on 2 ranks of one node: each rank holds the whole fp32 parameters (4Ψ bytes), half the
    gradients (2Ψ) and half of Adam's two moments (4Ψ), and sends each step to the next rank half of the gradients'
    reduce-scatter and half of the parameters' all-gather (2Ψ + 2Ψ), within the flat buffers' padding."""
    for rank, runs in enumerate(logging_runs_on_two_ranks):
        zero, psi = runs["zero2"], runs["zero2"]["psi"]
        with_loss = [logs for logs in zero["received"] if "loss" in logs]
        assert len(with_loss) == len(runs["stock"]["loss_steps"]) == 3
        for logs in with_loss:
            assert 4 * psi <= logs["zero/held_bytes/parameters"] <= 4 * psi + 64, (rank, logs)
            assert abs(logs["zero/held_bytes/gradients"] - 2 * psi) <= 64, (rank, logs)
            assert abs(logs["zero/held_bytes/optimizer_states"] - 4 * psi) <= 64, (rank, logs)
            assert abs(logs["zero/sent_bytes/intra-node"] - 4 * psi) <= 64, (rank, logs)
            assert logs["zero/sent_bytes/inter-node"] == 0
        others = [logs for logs in zero["received"] if "loss" not in logs]  # the end of training, the evaluation
        assert len(others) == 2 and not any(key.startswith("zero/") for logs in others for key in logs), others


@pytest.mark.parametrize("evaluate_first", [False, True])
@pytest.mark.parametrize("stage", [2, 3])
def test_evaluate_and_predict_report_the_stock_trainers_metrics_before_and_after_training(tmp_path, stage,
                                                                                           evaluate_first):
    """Stock reports eval_model_preparation_time (and predict_...) once accelerate prepared the model for an
    evaluation, which it does only when training has not prepared it yet: after training alone, never."""
    def metric_names(trainer_class: type[Trainer], arguments: type[TrainingArguments], **zero: Any) -> list[list[str]]:
        args = arguments(output_dir=str(tmp_path / trainer_class.__name__), use_cpu=True, report_to=[], max_steps=2,
                         per_device_train_batch_size=4, per_device_eval_batch_size=4, save_strategy="no",
                         disable_tqdm=True, **zero)
        trainer = trainer_class(model=gpt2_model(), args=args, train_dataset=lm_examples(8, seed=1),
                                eval_dataset=lm_examples(8, seed=2))
        def evaluate_and_predict() -> list[list[str]]:
            return [sorted(trainer.evaluate()), sorted(trainer.predict(lm_examples(4, seed=3)).metrics)]

        before = evaluate_and_predict() if evaluate_first else []
        trainer.train()
        return before + evaluate_and_predict()

    from training_args import ZeroTrainingArguments

    stock = metric_names(Trainer, TrainingArguments)
    assert ("eval_model_preparation_time" in stock[-2]) == evaluate_first  # the case each parameter stands for
    assert metric_names(ZeroTrainer, ZeroTrainingArguments, zero_stage=stage) == stock
