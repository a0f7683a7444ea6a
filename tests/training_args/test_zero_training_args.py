"""ZeroTrainingArguments: the --zero_* flags resolve into one validated engine config at parse time."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_zero import ZeroConfig, ZeroConfigError
from training_args import ZeroTrainingArguments


def parse(*flags: str, output_dir: str = "unused") -> ZeroTrainingArguments:
    (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", output_dir, "--use_cpu", "--report_to", "none", *flags])
    return args


def test_defaults_are_the_engines_and_trainer_flags_fill_precision_and_clipping():
    args = parse("--bf16", "--max_grad_norm", "0.5", "--gradient_accumulation_steps", "4")
    config = args.zero_engine_config
    assert config.zero_stage == ZeroConfig().zero_stage
    assert config.reduce_bucket_size == ZeroConfig().reduce_bucket_size
    assert (config.dtype, config.gradient_clipping) == ("bf16", 0.5)
    # The Trainer scales the loss for accumulation and tells the engine where each window ends.
    assert config.gradient_accumulation_steps == 1
    assert args.mixed_precision == "no"  # no accelerate autocast on top of the engine's own casting
    assert parse("--fp16").zero_engine_config.dtype == "fp16"


def test_flags_win_over_the_config_file_which_wins_over_defaults(tmp_path):
    file = tmp_path / "zero.json"
    file.write_text(json.dumps({"zero_stage": 1, "reduce_bucket_size": 1234, "allgather_bucket_size": 999}))
    config = parse("--zero_config", str(file), "--zero_stage", "3", "--zero_reduce_bucket_size", "77",
                   "--zero_param_persistence_threshold", "10").zero_engine_config
    assert (config.zero_stage, config.reduce_bucket_size, config.allgather_bucket_size) == (3, 77, 999)
    assert config.param_persistence_threshold == 10


def test_arguments_pickle_as_the_trainer_saves_them(tmp_path):
    args = parse("--zero_stage", "3")
    restored = pickle.loads(pickle.dumps(args))
    assert type(restored) is ZeroTrainingArguments
    assert restored.zero_engine_config == args.zero_engine_config


@pytest.mark.parametrize("flags, message", [
    (["--zero_stage", "2", "--zero_offload_param", "cpu"], "--zero_offload_param needs --zero_stage 3"),
    (["--zero_stage", "0", "--zero_offload_optimizer", "cpu"], "--zero_offload_optimizer needs --zero_stage 1, 2 or 3"),
    (["--zero_offload_optimizer", "nvme"], "--zero_nvme_path is required when --zero_offload_optimizer"),
    (["--zero_nvme_path", "/tmp"], "--zero_nvme_path is set but nothing is offloaded to nvme"),
    (["--zero_reduce_bucket_size", "0"], "--zero_reduce_bucket_size must be a positive integer; got 0"),
    (["--zero_prefetch_bucket_size", "-1"], "--zero_prefetch_bucket_size must be an integer >= 0; got -1"),
    (["--zero_stage", "3", "--fsdp", "full_shard"], "--fsdp and hf_zero's ZeRO engine cannot both run"),
])
def test_contradictions_and_bad_values_name_the_flag(flags, message):
    with pytest.raises(ZeroConfigError, match=message):
        parse(*flags)


def test_out_of_range_choice_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--zero_stage", "4")
    # auto is a choice too (docs/plan.md), so argparse compares, and quotes, the choices as strings
    assert ("argument --zero_stage/--zero-stage: invalid choice: '4' (choose from '0', '1', '2', '3', 'auto')"
            in capsys.readouterr().err)


@pytest.mark.parametrize("content, message", [
    ({"gradient_accumulation_steps": 4}, "sets 'gradient_accumulation_steps', which the Trainer's "
                                         "--gradient_accumulation_steps sets; remove it from the file"),
    ({"dtype": "bf16"}, "sets 'dtype', which the Trainer's --bf16/--fp16 sets"),
    ({"zero_stag": 3}, "unknown setting 'zero_stag'"),
    ([1, 2], "must hold a JSON object of engine settings"),
])
def test_config_file_problems_name_the_file_and_key(tmp_path, content, message):
    file = tmp_path / "zero.json"
    file.write_text(json.dumps(content))
    with pytest.raises(ZeroConfigError, match=message):
        parse("--zero_config", str(file))


def test_a_missing_config_file_is_named():
    with pytest.raises(ZeroConfigError, match="--zero_config nowhere.json: no such file"):
        parse("--zero_config", "nowhere.json")


@pytest.mark.parametrize("value", ["3", "0"])
def test_tensor_parallel_size_must_divide_the_processes(value):
    with pytest.raises(ZeroConfigError, match=rf"--tensor_parallel_size must be a positive integer dividing the "
                                              rf"number of processes \(1\); got {value}"):
        parse("--tensor_parallel_size", value)


def test_tensor_parallelism_refuses_gathering_evaluation_objects():
    with pytest.raises(ZeroConfigError, match=r"--tensor_parallel_size 2 with --eval_use_gather_object: gathered "
                                              r"objects would hold every sample 2 times"):
        parse("--tensor_parallel_size", "2", "--eval_use_gather_object", "true")


def test_zero_r_flags_reach_the_engine_config():
    config = parse("--zero_partition_activations", "--zero_cpu_checkpointing", "true").zero_engine_config
    assert config.partition_activations is True and config.cpu_checkpointing is True
    assert parse("--tensor_parallel_size", "1").tensor_parallel_size == 1


def test_the_readme_flag_table_is_the_one_the_settings_declare():
    """Each setting is declared once (hf_zero.settings.config): the README's table is made from the declarations."""
    from pathlib import Path

    from hf_zero.hf.arguments import readme_flag_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert readme_flag_table() in readme, "README's flag table is not the declared one; regenerate it (readme_flag_table)"


def test_every_engine_setting_is_a_trainer_flag_or_the_trainers_own():
    from dataclasses import fields

    from hf_zero.settings.config import trainer_flag

    parser = HfArgumentParser(ZeroTrainingArguments)
    flags = {option for action in parser._actions for option in action.option_strings}
    for setting in fields(ZeroConfig):
        assert trainer_flag(setting.name).split("/")[0] in flags, setting.name


@pytest.mark.parametrize("asked", ["bf16", "fp16", "no"])
def test_accelerate_launchs_mixed_precision_sets_the_engine_dtype_as_it_sets_the_stock_trainers(monkeypatch, asked):
    """`accelerate launch --mixed_precision bf16` hands ACCELERATE_MIXED_PRECISION to the processes. The stock
    TrainingArguments read it into mixed_precision (transformers' own reading is the reference); the engine
    computes in that dtype, where before it was dropped and the engine ran in fp32."""
    from transformers import TrainingArguments

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", asked)
    stock = TrainingArguments(output_dir="unused", use_cpu=True).mixed_precision
    assert parse("--zero_stage", "2").zero_engine_config.dtype == {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}[stock]
    assert parse("--zero_stage", "2", "--fp16").zero_engine_config.dtype == "fp16"  # the Trainer's flag wins


def test_accelerates_fp8_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ZeroConfigError, match="accelerate's --mixed_precision fp8 is not a dtype hf_zero's engine "
                                              "computes in: launch with --mixed_precision bf16, fp16 or no"):
        parse("--zero_stage", "2")


def test_accelerate_launchs_dynamo_backend_becomes_the_engines_compile_setting(monkeypatch):
    """`accelerate launch --dynamo_backend X --dynamo_mode M` hands ACCELERATE_DYNAMO_BACKEND and _MODE to the
    processes, which accelerate's own plugin reads (the reference); the engine compiles each block with them.
    accelerate always passes a mode, "default" unless told otherwise, which every backend takes.
    `--dynamo_backend no`, accelerate's default, compiles nothing."""
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune-no-cudagraphs")
    plugin = TorchDynamoPlugin()
    config = parse("--zero_stage", "3").zero_engine_config
    assert plugin.backend == DynamoBackend.INDUCTOR and config.compile
    assert (config.compile_backend, config.compile_mode) == ("inductor", plugin.mode)
    with pytest.raises(ZeroConfigError, match="--dynamo_mode max-autotune-no-cudagraphs and --torch_compile_mode "
                                              "default disagree"):
        parse("--zero_stage", "2", "--torch_compile_mode", "default")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")  # what accelerate launch passes without --dynamo_mode
    assert TorchDynamoPlugin().backend == DynamoBackend.AOT_EAGER
    for flags in ([], ["--torch_compile"], ["--torch_compile_backend", "aot_eager"]):
        config = parse("--zero_stage", "2", *flags).zero_engine_config
        assert (config.compile, config.compile_backend, config.compile_mode) == (True, "aot_eager", None), flags
    with pytest.raises(ZeroConfigError, match="--dynamo_backend aot_eager and --torch_compile_backend inductor "
                                              "disagree"):
        parse("--zero_stage", "2", "--torch_compile_backend", "inductor")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    assert TorchDynamoPlugin().backend == DynamoBackend.NO
    assert not parse("--zero_stage", "2").zero_engine_config.compile


@pytest.mark.parametrize("flags", [["--torch_compile"], ["--torch_compile_backend", "aot_eager"],
                                   ["--torch_compile_mode", "max-autotune-no-cudagraphs"]])
def test_torch_compile_flags_become_the_engines_compile_setting(flags):
    """Each of the three flags turns compilation on, as stock TrainingArguments reads them (the reference)."""
    stock = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none",
                              **{flags[0].removeprefix("--"): flags[1] if len(flags) > 1 else True})
    config = parse("--zero_stage", "3", *flags).zero_engine_config
    assert stock.torch_compile and config.compile
    assert (config.compile_backend or "inductor", config.compile_mode) == (stock.torch_compile_backend,
                                                                           stock.torch_compile_mode)


@pytest.mark.parametrize("flags, message", [
    (["--torch_compile_backend", "inductr"], "--torch_compile_backend 'inductr' is not a torch.compile backend"),
    (["--torch_compile_backend", "aot_eager", "--torch_compile_mode", "max-autotune"],
     "--torch_compile_mode is inductor's; --torch_compile_backend aot_eager takes no mode"),
    (["--zero_stage", "3", "--torch_compile_mode", "reduce-overhead"],
     "--torch_compile_mode reduce-overhead records CUDA graphs"),
])
def test_bad_compile_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ZeroConfigError, match=message):
        parse(*flags)


ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A page's claim that Trainer flags are refused whatever else is given: a sentence (or list item) whose subject is the
# flags alone ("`--a` (and `--b`, `--c`) is refused: ...", "`--a` and `--b` are refused whatever the stage");
# refusals under a condition ("is refused with tp > 1") are the tests of that condition's.
REFUSAL_CLAIM = re.compile(r"^((?:`--[\w-]+`|[\s,()]|and\b|or\b)+)(?:is|are) refused(?=[:.;]| whatever)")
# Values for the refused flags that take one, as a user would give them.
FLAG_VALUES = {"--fsdp": "full_shard", "--torch_compile_mode": "max-autotune", "--torch_compile_backend": "inductor"}
# `--zero_*` names the pages write that are not hf_zero's flags, and why.
NOT_FLAGS = {"--zero_X": "the README's placeholder for any setting X", "--zero_shot": "a script's own flag",
             "--zero_stgae": "a misspelling, in the example of its error", "--zero_stge": "the same"}


def doc_sentences() -> list[tuple[str, str]]:
    """(page, sentence) for every sentence, list item and table cell of the README and docs/, whitespace collapsed."""
    return [(page.name, " ".join(sentence.split())) for page in DOCS
            for sentence in re.split(r"(?<=[.!?])\s+(?:[-*]\s+)?|\n\s*[-*]\s+|\|", page.read_text())]


def test_each_flag_the_docs_say_is_refused_is_refused_by_the_parser():
    claims = [(page, flag) for page, sentence in doc_sentences() if (claim := REFUSAL_CLAIM.match(sentence))
              for flag in re.findall(r"`(--[\w-]+)`", claim.group(1))]
    assert {flag for _, flag in claims} >= {"--fsdp"}, claims  # the claims are read
    actions = HfArgumentParser(ZeroTrainingArguments)._option_string_actions
    for page, flag in claims:
        assert flag in actions, f"{page} says {flag} is refused, and the Trainer has no such flag"
        takes_value = actions[flag].nargs != "?"  # the Trainer's switches are given bare or with a value
        assert not takes_value or flag in FLAG_VALUES, f"give FLAG_VALUES a value for {flag}"
        with pytest.raises(ZeroConfigError):
            parse(flag, *([FLAG_VALUES[flag]] if takes_value else []))
            pytest.fail(f"{page} says {flag} is refused, and the parser takes it")


def test_every_zero_flag_the_docs_name_is_one_the_parser_takes():
    actions = HfArgumentParser(ZeroTrainingArguments)._option_string_actions
    named = {(page, flag) for page, sentence in doc_sentences() for flag in re.findall(r"(--zero_\w+)", sentence)}
    assert len(named) > 30  # the pages are read
    assert not {(page, flag) for page, flag in named if flag not in actions and flag not in NOT_FLAGS}
