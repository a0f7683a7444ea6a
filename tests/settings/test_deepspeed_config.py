"""A DeepSpeed configuration is read as it is: DeepSpeed's and transformers' documented files give the settings
their keys mean, "auto" is filled as transformers' own DeepSpeed integration fills it, DeepSpeed's schedules run
as transformers' own schedules do one step later, and what hf_zero does not implement is refused by name."""
from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest
import torch
from transformers import GPT2Config, HfArgumentParser, TrainingArguments, get_scheduler

from hf_zero import ZeroConfig, ZeroConfigError
from hf_zero.settings.deepspeed_config import engine_config
from training_args import ZeroTrainingArguments

# DeepSpeed's ZeRO tutorial (docs/_tutorials/zero.md): stage 1, stage 2, and ZeRO-Infinity's offload to CPU.
DEEPSPEED_TUTORIAL = {
    "stage1": {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
    "stage2": {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                     "reduce_scatter": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}},
    "stage3_offload": {"zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
}
# What each sets, read from DeepSpeed's documentation of its keys (docs/_pages/config-json.md).
TUTORIAL_SETTINGS = {
    "stage1": ZeroConfig(zero_stage=1, reduce_bucket_size=500_000_000),
    "stage2": ZeroConfig(zero_stage=2, overlap_comm=True, reduce_bucket_size=500_000_000,
                         allgather_bucket_size=500_000_000),
    "stage3_offload": ZeroConfig(zero_stage=3, prefetch_bucket_size=10_000_000, param_persistence_threshold=100_000,
                                 reduce_bucket_size=10_000_000, offload_optimizer="cpu", offload_param="cpu"),
}

# transformers' documented ds_config_zero2.json and ds_config_zero3.json (docs/source/en/deepspeed.md).
_TRANSFORMERS_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
TRANSFORMERS_ZERO2 = {**_TRANSFORMERS_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True}}
TRANSFORMERS_ZERO3 = {**_TRANSFORMERS_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}

TRAINER_FLAGS = ["--bf16", "--learning_rate", "3e-4", "--weight_decay", "0.01", "--adam_beta2", "0.95",
                 "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5",
                 "--warmup_steps", "5"]


def parse(*flags: str) -> ZeroTrainingArguments:
    (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--use_cpu", "--report_to", "none", *flags])
    return args


def write(tmp_path, config: dict, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def learning_rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    """The rate each of `steps` optimizer steps runs at."""
    rates = [scheduler.get_last_lr()[0]]
    for _ in range(steps - 1):
        scheduler.optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    return rates


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)


class _Model(torch.nn.Module):
    """A model with a transformers config, as the Trainer hands it over (hidden size 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = GPT2Config(n_embd=64)
        self.linear = torch.nn.Linear(64, 64)


def transformers_filled(config: dict, args: TrainingArguments, model: torch.nn.Module, steps: int) -> dict:
    """The configuration as transformers' DeepSpeed integration fills it (HfTrainerDeepSpeedConfig's own
    trainer_config_process and trainer_config_finalize). Its constructor insists on DeepSpeed being installed,
    so its methods run on accelerate's config base, which is what they run on when it is."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    methods = {k: v for k, v in vars(HfTrainerDeepSpeedConfig).items() if k not in ("__init__", "__dict__")}
    filling = type("TransformersFilling", (HfDeepSpeedConfig,), methods)(copy.deepcopy(config))
    filling.mismatches, filling._dtype = [], None
    filling.trainer_config_process(args)
    filling.trainer_config_finalize(args, model, steps)
    return filling.config


@pytest.mark.parametrize("name", sorted(DEEPSPEED_TUTORIAL))
def test_deepspeeds_tutorial_configs_give_the_settings_their_keys_document(tmp_path, name, caplog):
    expected = TUTORIAL_SETTINGS[name]
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        assert engine_config(DEEPSPEED_TUTORIAL[name]) == expected  # hf_zero.initialize(config=dict)
        assert engine_config(write(tmp_path, DEEPSPEED_TUTORIAL[name])) == expected  # and a file
    # Under the Trainer, through transformers' own flag; clipping is the Trainer's (--max_grad_norm, default 1.0).
    assert parse("--deepspeed", write(tmp_path, DEEPSPEED_TUTORIAL[name])).zero_engine_config \
        == dataclasses.replace(expected, gradient_clipping=1.0)
    if name != "stage1":  # the keys that mean nothing here are named, with why
        assert "zero_optimization.contiguous_gradients (hf_zero's gradients always lie in one flat buffer)" \
            in caplog.text


@pytest.mark.parametrize("documented", [TRANSFORMERS_ZERO2, TRANSFORMERS_ZERO3], ids=["zero2", "zero3"])
def test_auto_is_filled_as_transformers_deepspeed_integration_fills_it(tmp_path, documented):
    """The file with "auto" and the file transformers filled (model hidden size 64, 20 steps) give the same
    engine settings, optimizer and schedule."""
    from hf_zero.settings.deepspeed_config import read

    args = parse("--deepspeed", write(tmp_path, documented), *TRAINER_FLAGS)
    model = _Model()
    ours = args.zero_deepspeed
    settings = ours.sized_for(args.zero_engine_config, model)
    filled = transformers_filled(documented, parse(*TRAINER_FLAGS), model, steps=20)
    theirs = read(filled, "filled", args)
    assert ZeroConfig(**{**settings.to_dict(), **theirs.settings}) == settings
    assert theirs.optimizer == ours.optimizer
    assert ours.optimizer.lr == 3e-4 and ours.optimizer.betas == (0.9, 0.95) and ours.optimizer.weight_decay == 0.01
    assert settings.offload_optimizer == "cpu" and settings.dtype == "bf16" and settings.gradient_clipping == 0.5
    if documented is TRANSFORMERS_ZERO3:  # sized by the model: hidden**2, 0.9 hidden**2, 10 hidden
        assert (settings.reduce_bucket_size, settings.prefetch_bucket_size, settings.param_persistence_threshold) \
               == (4096, 3686, 640)
    # The schedule of transformers' filled steps is the schedule of ours filled at create_scheduler.
    assert learning_rates(ours.scheduler.build(sgd(), 20, args.get_warmup_steps(20)), 20) \
        == learning_rates(theirs.scheduler.build(sgd(), 20, args.get_warmup_steps(20)), 20)


def test_a_value_that_disagrees_with_the_trainer_is_refused_naming_both(tmp_path):
    config = copy.deepcopy(TRANSFORMERS_ZERO2)
    config["optimizer"]["params"]["lr"] = 1e-3
    config["train_micro_batch_size_per_gpu"] = 16
    with pytest.raises(ZeroConfigError) as refused:
        parse("--deepspeed", write(tmp_path, config), *TRAINER_FLAGS)
    assert "train_micro_batch_size_per_gpu=16 vs the Trainer's --per_device_train_batch_size=4" in str(refused.value)
    assert "optimizer.params.lr=0.001 vs the Trainer's --learning_rate=0.0003" in str(refused.value)
    # transformers' integration calls the same two values mismatched.
    with pytest.raises(ValueError, match=r"ds optimizer.params.lr=0.001 vs hf learning_rate=0.0003"):
        transformers_filled(config, parse(*TRAINER_FLAGS), _Model(), steps=20)


def test_flags_win_over_the_file_and_numbers_take_any_json_form(tmp_path):
    file = write(tmp_path, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7,
                                                  "stage3_prefetch_bucket_size": "auto"}})
    config = parse("--zero_config", file, "--zero_stage", "2").zero_engine_config
    assert (config.zero_stage, config.reduce_bucket_size) == (2, 50_000_000)
    assert type(config.reduce_bucket_size) is int
    args = parse("--deepspeed", file, "--zero_prefetch_bucket_size", "7")
    assert args.zero_deepspeed.sized_for(args.zero_engine_config, _Model()).prefetch_bucket_size == 7


@pytest.mark.parametrize("config, flags, message", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}}, [],
     "zero_optimization.reduce_bucket_sise is not a DeepSpeed key hf_zero reads; did you mean "
     "zero_optimization.reduce_bucket_size?"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, [],
     r"zero_optimization.offload_optimizer.ratio=0.3 is not implemented by hf_zero"),
    ({"zero_optimization": {"stage": 2}, "compile": {"deepcompile": True}}, [],
     "compile.deepcompile=True is not implemented by hf_zero, which only runs it as False"),
    ({"zero_optimization": {"stage": 2}, "compile": {"enabled": "auto", "kwargs": {"fullgraph": True}}},
     ["--torch_compile"],
     "compile.kwargs.fullgraph: hf_zero passes torch.compile its backend and mode only"),
    ({"zero_optimization": {"stage": 2}, "compile": {"enabled": "auto", "offload_activation": True}},
     ["--torch_compile"],
     "compile.offload_activation is not a key of DeepSpeed's compile block that hf_zero reads"),
    ({"zero_optimization": {"stage": 2}, "compile": {"enabled": True, "backend": "aot_eager"}}, [],
     "compile.enabled=True vs the Trainer's --torch_compile=False; compile.backend=aot_eager vs the Trainer's "
     "--torch_compile_backend=inductor"),
    ({"fp16": {"enabled": "auto", "hysteresis": 2}}, ["--fp16"], "fp16.hysteresis=2: hf_zero's dynamic loss scale"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, [], "optimizer.type 'Lamb' is not one hf_zero builds"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, [], "scheduler.type 'OneCycle' is not one hf_zero runs"),
    ({"zero_optimization": {"stage": 2}, "zero_stage": 3}, [],
     r"mixes DeepSpeed keys \['zero_optimization'\] with hf_zero keys \['zero_stage'\]"),
    ({"zero_optimization": {"stage": 2}}, ["--zero_config", "other.json"],
     "--deepspeed .* and --zero_config other.json each name the engine's configuration; give one"),
])
def test_what_hf_zero_does_not_implement_is_refused_by_name(tmp_path, config, flags, message):
    with pytest.raises(ZeroConfigError, match=message):
        parse("--deepspeed", write(tmp_path, config), *flags)


def test_the_compile_block_is_the_engines_compile_setting_and_the_trainers_flags_fill_it(tmp_path):
    """DeepSpeed's `compile` block (enabled, backend, kwargs.mode) is hf_zero's compile setting: read as it is by
    hf_zero.initialize; under the Trainer "auto" takes --torch_compile's values and a given value must agree."""
    block = {"enabled": True, "backend": "aot_eager"}
    config = engine_config({"zero_optimization": {"stage": 3}, "compile": block})
    assert (config.compile, config.compile_backend, config.compile_mode) == (True, "aot_eager", None)
    config = engine_config({"zero_optimization": {"stage": 2},
                            "compile": {"enabled": True, "kwargs": {"mode": "max-autotune"}}})
    assert (config.compile, config.compile_backend, config.compile_mode) == (True, None, "max-autotune")
    auto = {"zero_optimization": {"stage": 2}, "compile": {"enabled": "auto", "backend": "auto"}}
    config = parse("--deepspeed", write(tmp_path, auto), "--torch_compile_backend", "aot_eager").zero_engine_config
    assert (config.compile, config.compile_backend) == (True, "aot_eager")
    assert not parse("--deepspeed", write(tmp_path, auto)).zero_engine_config.compile
    for idle in ({}, {"enabled": False, "backend": "inductor", "kwargs": {"mode": "default"}}, {"kwargs": {}}):
        config = engine_config({"zero_optimization": {"stage": 2}, "compile": idle})  # not enabled: means nothing
        assert not config.compile and config.compile_backend is None and config.compile_mode is None, idle
        assert not parse("--deepspeed", write(tmp_path, {"zero_optimization": {"stage": 2}, "compile": idle}))\
            .zero_engine_config.compile
    agreeing = {"zero_optimization": {"stage": 2}, "compile": block}
    args = parse("--deepspeed", write(tmp_path, agreeing), "--torch_compile_backend", "aot_eager")
    assert args.zero_engine_config.compile


def test_auto_outside_the_trainer_is_refused_naming_the_key():
    with pytest.raises(ZeroConfigError, match='gradient_clipping is "auto", which only the Hugging Face Trainer'):
        engine_config({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"})
    with pytest.raises(ZeroConfigError, match="optimizer: hf_zero.initialize steps the torch optimizer you pass it"):
        engine_config({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


@pytest.mark.parametrize("kind, transformers_kind", [("WarmupDecayLR", "linear"),
                                                     ("WarmupLR", "constant_with_warmup")])
def test_deepspeeds_linear_warmup_schedules_run_transformers_schedules_one_step_later(tmp_path, kind,
                                                                                   transformers_kind):
    """DeepSpeed sets warmup_min_lr when its scheduler is built and moves the rate after each optimizer step:
    with linear warmup its rate at step k is transformers' rate at step k - 1 (DeepSpeed 0.19.8's
    lr_schedules.py)."""
    config = {"scheduler": {"type": kind, "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto", "warmup_type": "linear"}}}
    if kind == "WarmupDecayLR":
        config["scheduler"]["params"]["total_num_steps"] = "auto"
    args = parse("--deepspeed", write(tmp_path, config), *TRAINER_FLAGS)
    deepspeed = learning_rates(args.zero_deepspeed.scheduler.build(sgd(), 30, 5), 30)
    optimizer = sgd()
    transformers = learning_rates(get_scheduler(transformers_kind, optimizer, num_warmup_steps=5,
                                                num_training_steps=30), 30)
    assert deepspeed[0] == 0.0 and max(transformers) == 3e-4
    torch.testing.assert_close(deepspeed[1:], transformers[:-1], rtol=1e-12, atol=1e-15)


def test_deepspeeds_log_warmup_follows_its_documented_curve(tmp_path):
    """warmup_type "log" (DeepSpeed's default): min_lr + (max_lr - min_lr) * log(i + 1) / log(warmup_num_steps)
    at the i-th scheduler step, then max_lr."""
    import math

    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": "auto",
                                                           "warmup_num_steps": 8}}}
    spec = parse("--deepspeed", write(tmp_path, config), *TRAINER_FLAGS).zero_deepspeed.scheduler
    rates = learning_rates(spec.build(sgd(), 30, 5), 13)
    documented = [1e-5] + [1e-5 + (3e-4 - 1e-5) * (math.log(i + 1) / math.log(8) if i < 8 else 1.0)
                           for i in range(12)]
    torch.testing.assert_close(rates, documented, rtol=1e-12, atol=0)


def test_the_trainer_steps_deepspeeds_optimizer_and_schedule_from_the_config(tmp_path):
    """One process: the optimizer block is AdamW over every trainable parameter in one group, weight decay
    included (as DeepSpeed builds it), and the Trainer logs DeepSpeed's WarmupDecayLR rates."""
    from hf_zero import ZeroTrainer
    from tests.trainer_helpers import gpt2_model, lm_examples

    args = parse("--deepspeed", write(tmp_path, {**TRANSFORMERS_ZERO2, "bf16": {"enabled": False}}), "--max_steps",
                 "6", "--warmup_steps", "3", "--learning_rate", "2e-3", "--weight_decay", "0.1", "--logging_steps", "1",
                 "--save_strategy", "no", "--disable_tqdm", "true", "--output_dir", str(tmp_path))
    trainer = ZeroTrainer(model=gpt2_model(), args=args, train_dataset=lm_examples(24, seed=1))
    trainer.train()
    groups = trainer.engine.optimizer.param_groups
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1 and type(trainer.engine.optimizer).__name__ == "AdamW"
    assert trainer.engine.config.offload_optimizer == "cpu"
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    assert logged == learning_rates(args.zero_deepspeed.scheduler.build(optimizer, 6, 3), 6)


@pytest.mark.parametrize("launch", [
    ["--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu", "--gradient_clipping",
     "1.0", "--zero3_save_16bit_model", "true"],
    ["--deepspeed_config_file", "FILE"]], ids=["flags", "config_file"])
def test_accelerate_launch_use_deepspeed_hands_its_configuration_to_the_engine(tmp_path, monkeypatch, launch):
    """The environment accelerate's own launcher prepares for `accelerate launch --use_deepspeed ...`
    (prepare_deepspeed_cmd_env) is read as that configuration, and accelerate is told not to start DeepSpeed."""
    import os

    from accelerate.commands.launch import (
        _validate_launch_command,
        launch_command_parser,
    )
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    file = write(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                  "offload_param": {"device": "cpu"}}})
    launch_args = launch_command_parser().parse_args(["--use_deepspeed", *[file if a == "FILE" else a for a in launch],
                                                      "--num_processes", "1", "train.py"])
    _validate_launch_command(launch_args)
    launch_args.deepspeed_fields_from_accelerate_config = ""  # what accelerate's launch_command sets
    for name, value in prepare_deepspeed_cmd_env(launch_args)[1].items():
        if name.startswith("ACCELERATE"):
            monkeypatch.setenv(name, value)
    config = parse().zero_engine_config
    assert (config.zero_stage, config.offload_optimizer, config.offload_param) == (3, "cpu", "cpu")
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"


@pytest.mark.parametrize("on, init_off", [("1", "0"), ("yes", "off"), ("TRUE", "f")])
def test_accelerate_use_deepspeed_is_on_for_every_value_transformers_reads_as_true(monkeypatch, on, init_off):
    """Transformers reads ACCELERATE_USE_DEEPSPEED=1 as true and set up DeepSpeed's configuration;
    hf_zero read only "true", so it never took the configuration over, and the run died in partition.py
    (`range() arg 3 must not be zero`). ACCELERATE_DEEPSPEED_ZERO3_INIT is read the same way."""
    import os

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", on)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", init_off)
    args = parse()
    assert args.zero_engine_config.zero_stage == 3 and args.zero_config_flag == "accelerate launch --use_deepspeed"
    assert not args.zero_init_partitioned and args.deepspeed is None
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"
