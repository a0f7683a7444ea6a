"""`hf-zero run`: unmodified Trainer scripts get the --zero_* flags and the engine."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_zero.runtime.launch import free_port

SCRIPT = Path(__file__).parents[1] / "scripts" / "hf_style_clm.py"
MLM_SCRIPT = Path(__file__).parents[1] / "scripts" / "hf_style_mlm.py"
COMMON = ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"]


def hf_zero(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_zero", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


# The script's training at stage 3, on one node of 2 processes and on two nodes of one.
STAGE3_TRAINING = [str(SCRIPT), "--zero_stage", "3", "--do_train", "--max_steps", "8", "--learning_rate", "3e-3",
                   *COMMON]


@pytest.fixture(scope="module")
def one_node_at_stage3(tmp_path_factory) -> Path:
    """STAGE3_TRAINING on one node of 2 processes, then evaluation and prediction: its output folder."""
    out = tmp_path_factory.mktemp("one_node") / "out"
    run = hf_zero("run", "--nproc_per_node", "2", *STAGE3_TRAINING, "--do_eval", "--do_predict",
                  "--output_dir", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow
def test_unmodified_script_trains_at_stage3_on_two_processes_and_saves_a_loadable_model(one_node_at_stage3):
    out = one_node_at_stage3
    args = torch.load(out / "training_args.bin", weights_only=False)
    assert type(args).__name__ == "ZeroTrainingArguments" and args.zero_engine_config.zero_stage == 3
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] < 4.15  # ln(64) = 4.16 untrained

    engine_logits = torch.load(out / "predict_logits.pt")  # what the trained, partitioned model computed
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))  # the script's eval blocks
    with torch.no_grad():
        reloaded_logits = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded_logits, engine_logits, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_unmodified_masked_lm_script_trains_compiled_at_stage3_as_one_eager_process_on_the_global_batch(tmp_path):
    """--torch_compile_backend aot_eager compiles each block (dynamo prints the graphs it compiled: TORCH_LOGS).
    BertForMaskedLM's decoder is its word embeddings: at stage 3 that weight must stay gathered for both.
    Its loss ignores the num_items_in_batch the Trainer passes (transformers 5.24), so the stock Trainer's loss and
    gradients on 2 processes with accumulation 2 are 4x one process's; hf_zero's are one process's. The
    reference is the stock Trainer in one process on the global batch (8 = 2 ranks x 2 x accumulation 2), the
    same examples in each step, each step's masked tokens counted over the whole batch; evaluation likewise
    (16 = 2 ranks x 8)."""
    flags = ["--max_steps", "6", "--learning_rate", "1e-3", "--logging_steps", "1", *COMMON]
    runs = {"stage3": hf_zero("run", "--nproc_per_node", "2", str(MLM_SCRIPT), "--zero_stage", "3",
                              "--output_dir", str(tmp_path / "stage3"), "--per_device_train_batch_size", "2",
                              "--gradient_accumulation_steps", "2", "--torch_compile_backend", "aot_eager", *flags,
                              env={**os.environ, "TORCH_LOGS": "graph_code"}),
            "one_process": subprocess.run([sys.executable, str(MLM_SCRIPT), "--output_dir", str(tmp_path / "one_process"),
                                           "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
                                           *flags],
                                          capture_output=True, text=True, timeout=600)}
    history = {}
    for name, run in runs.items():
        assert run.returncode == 0, run.stderr[-3000:]
        history[name] = json.loads((tmp_path / name / "log_history.json").read_text())
    losses, grad_norms = ({name: [entry[key] for entry in h if "loss" in entry] for name, h in history.items()}
                          for key in ("loss", "grad_norm"))
    assert len(losses["one_process"]) == 6 and losses["one_process"][-1] < losses["one_process"][0]
    torch.testing.assert_close(losses["stage3"], losses["one_process"], rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_norms["stage3"], grad_norms["one_process"], rtol=1e-5, atol=0)
    assert "its loss does not read num_items_in_batch" in runs["stage3"].stderr  # said, once per run
    assert runs["stage3"].stderr.count("its loss does not read num_items_in_batch") == 1
    # A BertLayer's graph takes its attention's weights as inputs (dynamo names them by their path from the block).
    graphs = re.findall(r"===== __compiled_fn_\w+ =====.*?def forward\((.*?)\):", runs["stage3"].stderr, flags=re.S)
    assert any("L_self_modules_attention_modules_self_modules_query_parameters_weight_" in g for g in graphs), graphs
    stage3_eval = json.loads((tmp_path / "stage3" / "eval_results.json").read_text())["eval_loss"]
    one_eval = json.loads((tmp_path / "one_process" / "eval_results.json").read_text())["eval_loss"]
    assert stage3_eval == pytest.approx(one_eval, rel=1e-5)


def test_patched_classes_survive_the_transformers_module_swap():
    code = ("from hf_zero.cli.run import patch_transformers; patch_transformers(); import evaluate; "
            "import transformers.processing_utils; "
            "from transformers import TrainingArguments, Trainer, Seq2SeqTrainer, Seq2SeqTrainingArguments; "
            "print(TrainingArguments.__name__, Trainer.__name__, Seq2SeqTrainer.__name__, "
            "Seq2SeqTrainingArguments.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["ZeroTrainingArguments", "ZeroTrainer", "ZeroSeq2SeqTrainer",
                                  "ZeroSeq2SeqTrainingArguments"], run.stderr[-2000:]


REPORTS_THE_COLLECTOR = """
import gc, json
import accelerate, torch, transformers.modeling_utils
from hf_zero import ZeroTrainer
def made_by_the_script(): pass
walked = {id(o) for o in gc.get_objects()}
started_with = (torch.nn.Module.__init__, transformers.modeling_utils.PreTrainedModel.save_pretrained,
                accelerate.Accelerator.__init__, ZeroTrainer.train)
print(json.dumps({"enabled": gc.isenabled(),
                  "walked": [id(f) in walked for f in (*started_with, made_by_the_script)]}))
"""


def test_a_rank_runs_its_script_with_the_trainer_stack_frozen_out_of_the_cyclic_collector(tmp_path):
    """A rank as torchrun starts it (`-m hf_zero.cli.run SCRIPT`; without torchrun's variables it runs alone) imports
    torch, transformers' Trainer stack and hf_zero's before the script, with the collector off, then freezes them
    (hf_zero.runtime.host_memory.start_up_frozen): no full collection walks them again, and the collector is on for
    what the script makes."""
    script = tmp_path / "script.py"
    script.write_text(REPORTS_THE_COLLECTOR)
    run = subprocess.run([sys.executable, "-m", "hf_zero.cli.run", str(script)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout)
    assert said == {"enabled": True, "walked": [False, False, False, False, True]}, said


@pytest.mark.parametrize("flags, message", [
    (["--zero_stage", "2", "--zero_offload_param", "cpu"],
     "--zero_offload_param needs --zero_stage 3 (only stage 3 partitions parameters)"),
])
def test_bad_flags_stop_the_script_before_training_with_the_flag_named(tmp_path, flags, message):
    run = hf_zero("run", str(SCRIPT), "--output_dir", str(tmp_path), "--do_train", *flags, *COMMON, timeout=300)
    assert run.returncode == 2
    assert message in run.stderr
    assert not (tmp_path / "model.safetensors").exists()


def test_a_missing_script_is_named(refused_before_launch):
    code, err = refused_before_launch("run", "no_such_script.py")
    assert code == 2 and "no such script: no_such_script.py" in err


@pytest.mark.parametrize("flags, message", [
    # auto is a choice too (docs/plan.md), so argparse compares, and quotes, the choices as strings
    (["--zero_stage", "5"], "hf-zero run: argument --zero_stage/--zero-stage: invalid choice: '5' (choose from '0', "
                            "'1', '2', '3', 'auto')"),
    (["--zero_stgae", "2"], "hf-zero run: unknown flag --zero_stgae; did you mean --zero_stage?"),
    (["--tensor_parallel_size", "3"], "hf-zero run: --tensor_parallel_size must be a positive integer dividing the "
                                      "number of processes (2); got 3"),
    (["--bf16", "--zero_loss_scale", "nan"], "hf-zero run: --zero_loss_scale must be a finite number; got nan"),
    (["--zero_stage", "3", "--deepspeed", "no_ds_config.json"], "hf-zero run: --deepspeed no_ds_config.json: no such file"),
    (["--zero_delayed_param_update"], "hf-zero run: --zero_delayed_param_update overlaps the CPU optimizer step"),
    (["--torch_compile_backend", "inductr"], "hf-zero run: --torch_compile_backend 'inductr' is not a torch.compile "
                                             "backend"),
])
def test_bad_zero_flags_are_one_line_before_any_process_starts(refused_before_launch, tmp_path, flags, message):
    code, err = refused_before_launch("run", "--nproc_per_node", "2", str(SCRIPT), "--output_dir", str(tmp_path),
                                      "--do_train", *flags, *COMMON)
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1, err


def test_a_deepspeed_config_is_read_and_checked_against_the_scripts_flags_before_any_process_starts(
        refused_before_launch, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}')
    code, err = refused_before_launch("run", "--nproc_per_node", "2", str(SCRIPT), "--output_dir", str(tmp_path),
                                      "--do_train", "--deepspeed", str(config), "--learning_rate", "5e-5", *COMMON)
    assert code == 2
    assert err.startswith(f"hf-zero run: --deepspeed {config}: these DeepSpeed values disagree with the "
                          f"TrainingArguments: optimizer.params.lr=0.001 vs the Trainer's --learning_rate=5e-05"), err


def test_under_torchrun_every_rank_stops_and_the_error_is_said_once(tmp_path):
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), "-m", "hf_zero.cli.run", str(SCRIPT), "--output_dir", str(tmp_path),
                          "--zero_stage", "2", "--zero_offload_param", "cpu", *COMMON],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.count("--zero_offload_param needs --zero_stage 3") == 1, run.stderr[-3000:]


def test_a_zero_flag_far_from_every_engine_flag_is_left_to_the_script():
    from hf_zero.hf.flags import check_script_flags
    from hf_zero.settings.config import ZeroConfigError

    check_script_flags(["--zero_shot", "--zero_stage", "3", "--use_cpu"], 2)  # the script's own flag, say
    check_script_flags(["--help", "--use_cpu"], 2)  # the script's parser answers it
    with pytest.raises(ZeroConfigError, match="unknown flag --zero_offload_optimiser; did you mean "
                                              "--zero_offload_optimizer?"):
        check_script_flags(["--zero_offload_optimiser", "cpu", "--use_cpu"], 2)


def test_more_processes_per_node_than_gpus_are_refused_naming_the_count(monkeypatch):
    """A second rank on a one-GPU machine would look for cuda:1; refused before any process starts."""
    import hf_zero.runtime.device
    from hf_zero.hf.flags import check_script_flags
    from hf_zero.settings.config import ZeroConfigError

    monkeypatch.setattr(hf_zero.runtime.device, "has_accelerator", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_script_flags(["--zero_stage", "2"], 1)
    check_script_flags(["--zero_stage", "2", "--use_cpu"], 2)
    with pytest.raises(ZeroConfigError, match="2 processes per node but this machine has 1 GPU"):
        check_script_flags(["--zero_stage", "2"], 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CPU only: with a GPU transformers starts distributed")
def test_several_processes_without_a_gpu_and_without_use_cpu_are_refused_naming_it(refused_before_launch):
    """transformers on CPU starts distributed training only with --use_cpu; without it each process would train
    alone on the same data into the same folder."""
    code, err = refused_before_launch("run", "--nproc_per_node", "2", str(SCRIPT), "--output_dir", "unused",
                                      "--zero_stage", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "2 processes without a GPU need --use_cpu" in err


def test_a_tensor_parallel_group_larger_than_a_node_is_refused_unless_asked(refused_before_launch):
    from hf_zero.hf.flags import check_script_flags
    from hf_zero.settings.config import ZeroConfigError

    flags = ["--tensor_parallel_size", "4", "--use_cpu"]
    with pytest.raises(ZeroConfigError, match="--tensor_parallel_size 4 is larger than the 2 processes per node"):
        check_script_flags(flags, 8, per_node=2)
    check_script_flags([*flags, "--tensor_parallel_across_nodes"], 8, per_node=2)
    check_script_flags(flags, 8, per_node=4)
    code, err = refused_before_launch("run", "--nnodes", "2", "--nproc_per_node", "2", "--master_addr", "node0",
                                      "--master_port", "29999", str(SCRIPT), *flags)
    assert code == 2 and "larger than the 2 processes per node" in err


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_as_many_processes(one_node_at_stage3, tmp_path):
    """Two "nodes" on 127.0.0.1 of one process each, each started with the same command, meeting at a c10d
    rendezvous endpoint as under SLURM or an elastic launcher (torchrun gives each its ranks; the static
    rendezvous, --master_addr and --node_rank, is the same torchrun with other options:
    test_each_rendezvous_reaches_torchrun_as_asked). Whichever node's process is rank 1 is local rank 0, so the
    ranks and the local ranks are numbered differently, as on any cluster. The reference is one node of 2
    processes (the test above's run): the stock Trainer's sampler gives 2 ranks other samples per step than one
    process. (Two nodes of two processes against one node of four took 2.3x this test's time and checked the
    same.) Each node's only process runs one thread, as torchrun gives each of several processes on a node: it
    would otherwise get accelerate's choice (every core), and other rounding in its matmuls."""
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "hf_zero", "run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes", *STAGE3_TRAINING,
                               "--output_dir", str(tmp_path / "two_nodes")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, err[-3000:]
    expected = AutoModelForCausalLM.from_pretrained(one_node_at_stage3).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "two_nodes").state_dict()
    assert max((trained[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


@pytest.mark.parametrize("launch, message", [
    (["--nnodes", "2"], "--nnodes above 1 needs --master_addr and --master_port"),
    # Every node but the first would wait on its own loopback until the rendezvous timed out.
    (["--nnodes", "2", "--master_port", "29500"], "--nnodes above 1 needs --master_addr and --master_port"),
    (["--nnodes", "2", "--node_rank", "2", "--master_port", "29500"], "--node_rank must be between 0 and"),
    (["--rdzv_backend", "c10d"], "--rdzv_backend c10d needs --rdzv_endpoint"),
    (["--rdzv_endpoint", "node0:29400", "--master_addr", "node0"], "are for the static rendezvous"),
    (["--rdzv_backend", "static", "--rdzv_id", "job"], "are for the c10d rendezvous"),
])
def test_a_launch_the_nodes_could_not_agree_on_is_refused_in_one_line(refused_before_launch, launch, message):
    code, err = refused_before_launch("run", *launch, str(SCRIPT))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1



@pytest.fixture(scope="module")
def launched_then_killed(tmp_path_factory) -> dict[str, Any]:
    """`hf-zero run` of a script whose 2 ranks write their pid and glibc mmap threshold (the launcher started without
    one set), then wait; once both wrote, the launcher is killed (SIGKILL: torchrun cannot stop its ranks itself).
    Returns each rank's threshold and the ranks still running 10 s later (killed then)."""
    folder = tmp_path_factory.mktemp("launch")
    script = folder / "wait.py"
    script.write_text("import os, sys, time\nrank = os.environ['RANK']\n"
                      "open(os.path.join(sys.argv[1], 'threshold' + rank), 'w')"
                      ".write(os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset'))\n"
                      "open(os.path.join(sys.argv[1], 'pid' + rank), 'w').write(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    launcher = subprocess.Popen([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", "2", str(script),
                                 str(folder), "--use_cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=environ)
    try:
        deadline = time.monotonic() + 120
        while not all((folder / f"pid{rank}").is_file() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)  # the pid files written through
        ranks = [int((folder / f"pid{rank}").read_text()) for rank in (0, 1)]
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(map(is_running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = [pid for pid in ranks if is_running(pid)]
    for pid in still:
        os.kill(pid, 9)
    return {"thresholds": [(folder / f"threshold{rank}").read_text() for rank in (0, 1)], "still_running": still}


def test_the_launched_processes_get_an_8_mib_mmap_threshold_unless_one_is_set(launched_then_killed, monkeypatch):
    """glibc's sliding threshold makes peaks follow allocation history (hf_zero/runtime/launch.py: 4.63-4.90 against
    4.35-4.37 GiB per rank on the gpt2-large-shape run); hf-zero's launchers fix it, and keep a value the user
    set. The launched ranks are checked for the first; the second is decided in the launcher's environment,
    which torchrun hands to the ranks as it is (the first shows that too)."""
    from hf_zero.runtime.host_memory import use_mmap_for_large_allocations

    assert launched_then_killed["thresholds"] == [str(8 * 2**20)] * 2
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    use_mmap_for_large_allocations()
    assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_an_error_hf_zero_raises_inside_a_rank_is_one_line(tmp_path):
    """A rank as torchrun starts it (`-m hf_zero.cli.run`), failing with a CheckpointError: one line, no traceback.
    That several ranks holding it say it once is the torchrun test above (say_once)."""
    script = tmp_path / "resume.py"
    script.write_text("from hf_zero.checkpoint import CheckpointError\n"
                      "raise CheckpointError('checking ckpt failed on rank 1: CheckpointError: ckpt/x is missing')\n")
    run = subprocess.run([sys.executable, "-m", "hf_zero.cli.run", str(script)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2
    assert run.stderr == "resume.py: checking ckpt failed on rank 1: CheckpointError: ckpt/x is missing\n", run.stderr


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a process reparented to an init that does not reap stays one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_ranks_end_within_seconds_when_their_launcher_is_killed(launched_then_killed):
    assert not launched_then_killed["still_running"], "ranks outlived their launcher"


@pytest.mark.parametrize("launch, expected", [
    ([], ["--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port"]),
    (["--nnodes", "2", "--node_rank", "1", "--master_addr", "node0", "--master_port", "29500"],
     ["--node_rank", "1", "--master_addr", "node0", "--master_port", "29500"]),
    (["--nnodes", "2", "--rdzv_endpoint", "node0:29400", "--rdzv_id", "job7"],
     ["--rdzv_backend", "c10d", "--rdzv_endpoint", "node0:29400", "--rdzv_id", "job7"]),
])
def test_each_rendezvous_reaches_torchrun_as_asked(launch, expected):
    """The rendezvous options `hf-zero run` and `hf-zero train` hand torchrun: the static rendezvous with node 0's
    address (one node: this machine, any free port), or c10d at the endpoint the nodes share."""
    from hf_zero.cli import commands as cli

    parser = argparse.ArgumentParser()
    cli._add_launch_arguments(parser, default_nproc=2)
    args = parser.parse_args(launch)
    cli._check_launch(parser, args)
    handed = cli._rendezvous_args(args)
    assert handed[:len(expected)] == expected and len(handed) == 6


def test_hf_zero_run_help_lists_every_flag_hf_zero_adds_to_the_scripts_arguments(capsys):
    """`hf-zero run` parses only the launch flags and hands the rest to the script, whose parser takes the
    --zero_* flags: its --help lists them all the same, from the same declarations."""
    from hf_zero.cli import commands as cli
    from hf_zero.settings.flag_names import ENGINE_FLAGS, EXTRA_FLAGS

    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert re.search(r"^  --nproc_per_node ", shown, re.MULTILINE)  # the launch flags stay
    for flag in [*ENGINE_FLAGS, *EXTRA_FLAGS, "ddp_timeout"]:
        assert re.search(rf"^  --{flag}[ ,\n]", shown, re.MULTILINE), flag


@pytest.mark.parametrize("args, message", [
    (["--nproc_per_nodes", "2", str(SCRIPT)],
     "hf-zero run: unrecognized arguments: --nproc_per_nodes; did you mean --nproc_per_node?"),
    (["--nproc_per_node", "2", str(SCRIPT), "--zero_stgae", "2"],
     "hf-zero run: unknown flag --zero_stgae; did you mean --zero_stage?"),
])
def test_a_misspelt_flag_is_said_before_torch_or_transformers_is_imported(args, message):
    """Importing them takes 3-4 s on a 2-core machine (benchmarks/bench_startup.py times the whole start)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_zero", "run", *args], capture_output=True,
                         text=True, timeout=120)
    said = [line for line in run.stderr.splitlines() if not line.startswith("import time:")]
    assert run.returncode == 2 and len(said) == 1 and said[0].startswith(message), run.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "hf_zero.cli.commands" in imported  # what -X importtime lists is read
    assert not {name for name in imported if name.split(".")[0] in ("torch", "transformers")}


def test_the_flag_names_checked_before_any_import_are_those_the_scripts_parser_takes():
    """hf_zero.settings.flag_names is what `hf-zero run` checks a script's --zero_* flags against before transformers exists;
    the script's parser is HfArgumentParser over ZeroTrainingArguments, whose flags hf_zero adds are the mixin's."""
    from transformers import HfArgumentParser, TrainingArguments

    from hf_zero.hf.arguments import ZeroArgumentsMixin
    from hf_zero.settings.flag_names import flag_names

    stock = set(HfArgumentParser(TrainingArguments)._option_string_actions)
    mixin = {f"--{action.dest}" for action in HfArgumentParser(ZeroArgumentsMixin)._actions if action.dest != "help"}
    assert flag_names() == mixin
    assert flag_names() - stock == flag_names() - {"--ddp_timeout"}  # the one Trainer flag hf_zero gives a default
