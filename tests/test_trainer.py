"""ZeroTrainer against the stock transformers Trainer with DDP: same data, seed and schedule on 2 gloo ranks."""
from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments

from hf_zero import ZeroTrainer
from hf_zero.launch import spawn_gloo
from tests.trainer_helpers import TrainerRun, gpt2_model, resume_runs, run_trainers
from training_args import ZeroTrainingArguments

STAGES = (0, 1, 2, 3)
RUNS = ([TrainerRun("stock_gpt2", None)] + [TrainerRun(f"zero{s}_gpt2", s) for s in STAGES]
        + [TrainerRun(f"zero{s}_checkpointing_gpt2", s, args={"gradient_checkpointing": True}) for s in (2, 3)]
        + [TrainerRun("stock_t5", None, "t5"), TrainerRun("zero3_t5", 3, "t5")])


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
    results = spawn_gloo(resume_runs, 2, str(tmp_path))
    for stage in (1, 2, 3):
        assert results[0][f"stage{stage}_checkpoints"] == ["checkpoint-3", "checkpoint-6"]
        straight, resumed = results[0][f"stage{stage}"]["straight"], results[0][f"stage{stage}"]["resumed"]
        for name, p in straight.items():
            assert torch.equal(p, resumed[name]), f"stage {stage}: {name} differs after resuming"


def test_zero_trainer_needs_zero_training_arguments(tmp_path):
    with pytest.raises(TypeError, match="needs its arguments as training_args.ZeroTrainingArguments"):
        ZeroTrainer(model=gpt2_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
