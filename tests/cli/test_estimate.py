"""hf-zero estimate against the ZeRO paper's Figure 1 and Table 2, and against the engine's own ledger."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hf_zero.cli import estimate, main
from hf_zero.cli.estimate import GB, Setting


def test_figure1_7_5b_on_64_gpus_per_stage():
    totals = [sum(estimate.model_states(int(7.5e9), Setting(s, 64))[0].values()) / GB for s in estimate.STAGES]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


def test_table2_largest_models_on_64_gpus_of_32gb():
    largest = [estimate.largest_params(Setting(s, 64), 32 * GB) / 1e9 for s in estimate.STAGES]
    assert [round(x, 1) for x in largest] == [2.0, 7.6, 14.4, 128.0]


def test_activations_of_the_papers_1_5b_gpt2_at_batch_32_and_1k_tokens():
    """Section 3.2: about 60 GB without checkpointing; checkpointing brings it under 8 GB."""
    assert estimate.activation_bytes("zero-48x1600", 32, 1024, checkpointing=False) / GB == pytest.approx(60, abs=1)
    assert estimate.activation_bytes("zero-48x1600", 32, 1024, checkpointing=True) / GB < 8


def test_optimizer_offload_moves_the_optimizer_state_and_a_gradient_shard_to_the_host():
    psi, nd = int(10e9), 8
    device, host = estimate.model_states(psi, Setting(2, nd, offload_optimizer="cpu"))
    assert device == {"parameters": 2 * psi, "gradients": 2 * psi / nd, "optimizer_states": 0.0}
    assert host == 16 * psi / nd


def test_a_model_that_cannot_fit_names_the_smallest_configuration_that_would():
    psi, gpu = int(100e9), 32 * GB
    text = estimate.report(psi, Setting(2, 8), gpu)
    smallest = estimate.smallest_fitting(psi, gpu, 0.0)
    assert "does not fit: stage 2 on 8 GPUs needs 375.00 GB per device" in text
    assert f"smallest configuration that fits with the fewest GPUs: {smallest} (25.00 GB" in text
    assert ("smallest configuration that fits on these GPUs: stage 3 on 8 GPUs with optimizer offload and "
            "parameter offload to CPU") in text
    # The reference: brute force over every setting hf_zero accepts on fewer or as many GPUs.
    fitting = [s for s in estimate.valid_settings(2**k for k in range(17))
               if estimate.device_total(psi, s, 0.0) <= gpu]
    assert smallest == min(fitting, key=lambda s: s.num_gpus) == fitting[0]
    assert smallest.num_gpus == 8 and smallest.stage == 3


@pytest.mark.slow
@pytest.mark.parametrize("stage, dtype", [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")])
def test_the_estimate_agrees_with_the_engines_ledger_within_5_percent(world2, stage, dtype):
    name = f"s{stage}_bf16" if dtype == "bf16" else f"s{stage}_gpt2"
    for rank_result in world2:
        r = rank_result[name]
        measured = sum(r["state_bytes"][k] for k in ("parameters", "gradients", "optimizer_states"))
        estimated = sum(estimate.model_states(r["psi"], Setting(stage, len(world2)), dtype)[0].values())
        assert abs(measured - estimated) / estimated < 0.05, (name, measured, estimated)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_with_fp32_reduction_the_estimate_and_the_ledger_count_fp32_gradient_shards(world2, stage):
    for rank_result in world2:
        fp32, bf16 = rank_result[f"s{stage}_bf16_fp32_reduce"], rank_result[f"s{stage}_bf16"]
        estimated = estimate.model_states(fp32["psi"], Setting(stage, len(world2), reduce_dtype="fp32"), "bf16")[0]
        measured = fp32["state_bytes"]["gradients"]
        assert abs(measured - estimated["gradients"]) / estimated["gradients"] < 0.05, (measured, estimated)
        assert measured == 2 * bf16["state_bytes"]["gradients"]  # the same shard, twice the bytes per element


@pytest.mark.slow
def test_hpz_adds_2_psi_over_n_which_the_engine_holds_from_the_first_forward_to_the_step(world2):
    for rank_result in world2:
        r = rank_result["s3_hpz_bf16"]
        parameters = {n: estimate.model_states(r["psi"], Setting(3, 2, hpz_partition_size=n), "bf16")[0]["parameters"]
                      for n in (1, 2)}
        assert parameters[2] - parameters[1] == 2 * r["psi"] / 2
        measured = r["peaks"]["bytes of secondary partitions"]
        assert abs(measured - (parameters[2] - parameters[1])) / (parameters[2] - parameters[1]) < 0.05, measured


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_zero", "estimate", *args], capture_output=True, text=True,
                          timeout=120)


def test_the_command_prints_every_stage_and_marks_the_chosen_one():
    done = run_cli("--model", "gpt2-xl", "--num_gpus", "8", "--zero_stage", "2", "--batch_size", "8",
                   "--seq_len", "1024", "--checkpoint_activations")
    assert done.returncode == 0, done.stderr
    assert "| 2 (chosen) |" in done.stdout and "activations: " in done.stdout
    assert "largest gpt2 model of the zoo that fits stage 2 on 8 GPUs" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt3", "--num_gpus", "2"], "--model: 'gpt3' is neither a model_zoo name (all-minilm-l6-v2"),
    (["--params", "7.5B", "--num_gpus", "2", "--zero_stage", "3", "--offload_param", "nvme"],
     "--offload_param nvme needs --offload_optimizer nvme"),
    (["--params", "7.5Q", "--num_gpus", "2"], "expected a count such as 7.5e9, 7.5B"),
    (["--params", "7.5B", "--num_gpus", "2", "--zero_stage", "2", "--offload_param", "cpu"],
     "--offload_param needs --zero_stage 3"),
    (["--params", "7.5B", "--num_gpus", "2", "--batch_size", "4", "--seq_len", "128"], "--batch_size needs --model"),
    (["--params", "7.5B", "--num_gpus", "2", "--reduce_dtype", "fp16"],
     "--reduce_dtype must be fp32 or the compute dtype, bf16 (--dtype); got fp16"),
    (["--params", "7.5B", "--num_gpus", "8", "--zero_stage", "2", "--hpz_partition_size", "8"],
     "--hpz_partition_size needs --zero_stage 3 and must divide --num_gpus (8); got 8 at stage 2"),
])
def test_bad_input_is_named(capsys, args, message):
    """In this process, through the entry point `python -m hf_zero` calls (cli.main): refusing bad input is
    argument handling, and a new interpreter per case cost 5 s each; the test above runs the real command."""
    try:
        code = main(["estimate", *args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_a_transformers_model_folder_is_estimated_from_the_parameters_transformers_builds(tmp_path, capsys, kind):
    """Any model transformers has, from its config alone (built on meta): Ψ is what transformers' own model holds,
    tied weights once (T5's embeddings), and each stage's row is the paper's formula for that Ψ."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        LlamaConfig,
        T5Config,
    )

    if kind == "llama":
        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, architectures=["LlamaForCausalLM"])
        built = AutoModelForCausalLM.from_config(config)
    else:
        config = T5Config(d_model=128, d_ff=256, num_layers=2, num_heads=4, vocab_size=500,
                          architectures=["T5ForConditionalGeneration"])
        built = AutoModelForSeq2SeqLM.from_config(config)
    config.save_pretrained(tmp_path)
    psi = sum(p.numel() for p in built.parameters())
    assert estimate.parameter_count(str(tmp_path)) == psi
    assert main(["estimate", "--model", str(tmp_path), "--num_gpus", "4", "--zero_stage", "3", "--batch_size", "2",
                 "--seq_len", "64"]) == 0
    printed = capsys.readouterr().out
    for stage, per_rank in ((0, 16 * psi), (1, 4 * psi + 12 * psi / 4), (2, 2 * psi + 14 * psi / 4),
                            (3, 16 * psi / 4)):
        assert f"| {stage}{' (chosen)' * (stage == 3)} | " in printed
        row = next(line for line in printed.splitlines() if line.startswith(f"| {stage}"))
        assert row.split(" | ")[4] == f"{per_rank / GB:.2f}", row  # model states per rank, in GB
    assert "activations: " in printed


def test_nvme_offload_moves_the_states_the_paper_counts_to_nvme_and_keeps_a_pool_of_tiles_in_host_memory():
    psi, nd = int(7.5e9), 8
    device, host = estimate.model_states(psi, Setting(3, nd, "nvme", "nvme"))
    assert device == {"parameters": 0.0, "gradients": 2 * psi / nd, "optimizer_states": 0.0}
    # K=12 of optimizer states, the fp32 gradient shard (4) and the bf16 parameter shard (2), per rank.
    assert estimate.nvme_bytes(psi, Setting(3, nd, "nvme", "nvme")) == (12 + 4 + 2) * psi / nd
    assert host == 3 * (16 + 4) * 2_000_000  # three buffer sets of nvme_tile_numel elements
    assert estimate.nvme_bytes(psi, Setting(3, nd, "cpu", "cpu")) == 0.0
