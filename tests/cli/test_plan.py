"""`hf-zero plan` as a user runs it: its JSON, the setting it chooses checked against the simulated ranks, and one
line for each bad flag."""
import json
import sys

import pytest

import model_zoo
from hf_zero.cli.commands import main

TINY = ["--model", "gpt2-tiny", "--seq_len", "32", "--gpus_per_node", "2"]
FIXED = ["--zero_stage", "3", "--offload_optimizer", "none", "--offload_param", "none",
         "--gradient_checkpointing", "false", "--micro_batch", "2"]


def test_a_fixed_setting_gives_the_documented_json(capsys):
    assert main(["plan", *TINY, *FIXED, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setting"] == {"zero_stage": 3, "offload_optimizer": "none", "offload_param": "none",
                              "micro_batch": 2, "gradient_checkpointing": False, "hpz_partition_size": 1}
    assert out["params"] == model_zoo.parameter_count("gpt2-tiny")
    device = out["per_rank"]["device"]
    assert device["peak"] == sum(device[k] for k in ("parameters", "gradients", "optimizer_states", "activations",
                                                      "buffers", "other"))
    assert device["activations"] > 0 and out["per_rank"]["host"]["peak"] == 0
    # one node: every byte stays on it; stage 3 sends (p-1)/p of 3Ψ in bf16 per rank, the root unit kept gathered
    assert out["traffic_per_step"]["inter_node"] == 0
    assert 0.8 * 3 * out["params"] < out["traffic_per_step"]["intra_node"] <= 3 * out["params"]
    assert out["fits"] is True


def test_auto_chooses_the_fastest_setting_that_fits_and_says_why_the_others_lost(capsys):
    # 2.5 MB a device: stage 0's 16Ψ of model states (2 MB) leaves too little for its step
    assert main(["plan", *TINY, "--gpu_memory", "0.0025GB", "--max_micro_batch", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["per_rank"]["device"]["peak"] <= 2_500_000
    outcomes = {c["setting"]: c["outcome"] for c in out["candidates"]}
    assert sum(o == "chosen" for o in outcomes.values()) == 1
    assert outcomes["stage 0, micro-batch 1"].startswith("device memory:")
    assert all(o in ("chosen", "as fast, at more device memory") or o.startswith(("slower:", "device memory:",
                                                                                  "not simulated:"))
               for o in outcomes.values())
    chosen_speed = out["tokens_per_second_per_gpu"]
    for outcome in outcomes.values():
        if outcome.startswith("slower:"):
            assert float(outcome.split()[1].replace(",", "")) <= chosen_speed


def test_nothing_fitting_says_what_would(capsys):
    assert main(["plan", *TINY, *FIXED, "--gpu_memory", "0.0005GB"]) == 1
    out = capsys.readouterr().out
    assert "(does not fit)" in out and "more GPUs: its model states alone take" in out


def test_a_stage_that_keeps_the_states_whole_is_told_to_partition_them_not_to_add_gpus(capsys):
    """At stage 0 every GPU holds all 16Ψ bytes whatever their number: more GPUs cannot help, a higher stage can. 5%
    too little memory for stage 0's peak; the same at stage 3 names no higher stage."""
    def plan(stage: int, memory: str) -> dict:
        assert main(["plan", *TINY, *FIXED[2:], "--zero_stage", str(stage), "--gpu_memory", memory, "--json"]) in (0, 1)
        return json.loads(capsys.readouterr().out)

    psi = model_zoo.parameter_count("gpt2-tiny")
    peak = plan(0, "80GB")["per_rank"]["device"]["peak"]
    said = plan(0, f"{0.95 * peak / 1e9:.9f}GB")["what_would"]
    assert f"a higher --zero_stage: at stage 0 every GPU keeps its optimizer states, gradients, parameters whole " \
           f"({16 * psi / 1e9:.3g} GB at any number of GPUs)" in said, said
    assert "more GPUs" not in said
    peak = plan(3, "80GB")["per_rank"]["device"]["peak"]
    said = plan(3, f"{0.95 * peak / 1e9:.9f}GB")["what_would"]
    assert "higher --zero_stage:" not in said and "more GPUs: " in said, said


def test_activations_past_the_device_are_told_a_shorter_sequence_or_checkpointing_and_either_then_fits(capsys):
    """gpt2-tiny at stage 3 over 128 tokens (its longest), 16 sequences a GPU, without checkpointing: activations are
    most of the peak. With 5% too little memory the answer names a shorter sequence or checkpointing with the
    activations' bytes, and taking either advice (half the sequence, or checkpointing) then fits that memory."""
    def plan(*flags: str) -> dict:
        assert main(["plan", "--model", "gpt2-tiny", "--gpus_per_node", "2", "--zero_stage", "3", "--offload_optimizer",
                     "none", "--offload_param", "none", "--micro_batch", "16", "--json", *flags]) in (0, 1)
        return json.loads(capsys.readouterr().out)

    fitting = plan("--seq_len", "128", "--gradient_checkpointing", "false")
    device = fitting["per_rank"]["device"]
    assert device["activations"] > 0.5 * device["peak"]  # the premise
    memory = f"{0.95 * device['peak'] / 1e9:.9f}GB"
    short = plan("--seq_len", "128", "--gradient_checkpointing", "false", "--gpu_memory", memory)
    assert short["fits"] is False
    assert f"a shorter sequence or checkpointing: activations take {device['activations'] / 1e9:.3g} GB" \
        in short["what_would"], short["what_would"]
    assert plan("--seq_len", "64", "--gradient_checkpointing", "false", "--gpu_memory", memory)["fits"] is True
    assert plan("--seq_len", "128", "--gradient_checkpointing", "true", "--gpu_memory", memory)["fits"] is True


def test_a_hub_model_in_the_local_cache_is_planned_offline(tmp_path, monkeypatch, capsys):
    """`--model org/name` names a model in huggingface_hub's cache (its layout: refs/main naming the snapshot that holds
    config.json), read without the network. huggingface_hub's own scan of the cache finds it, and the plan counts
    the parameters of the model its config builds."""
    import huggingface_hub
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=48, n_head=2, vocab_size=300, n_positions=64,
                        architectures=["GPT2LMHeadModel"])
    repo = tmp_path / "models--someone--gpt2-small-cached"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    config.save_pretrained(repo / "snapshots" / revision)
    (cached,) = huggingface_hub.scan_cache_dir(tmp_path).repos
    (snapshot,) = cached.revisions
    assert cached.repo_id == "someone/gpt2-small-cached" and {f.file_name for f in snapshot.files} == {"config.json"}
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "someone/gpt2-small-cached", *TINY[2:], *FIXED, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == sum(p.numel() for p in GPT2LMHeadModel(config).parameters())


def test_a_folder_whose_config_names_no_architecture_is_planned_as_transformers_builds_it(tmp_path, capsys):
    """A config saved on its own (GPT2Config().save_pretrained) names no class in "architectures": the plan builds
    what AutoModelForCausalLM.from_config builds from it."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=48, n_head=2, vocab_size=300, n_positions=64)
    config.save_pretrained(tmp_path)
    assert not json.loads((tmp_path / "config.json").read_text()).get("architectures")
    assert main(["plan", "--model", str(tmp_path), *TINY[2:], *FIXED, "--json"]) == 0
    built = AutoModelForCausalLM.from_config(config)
    assert json.loads(capsys.readouterr().out)["params"] == sum(p.numel() for p in built.parameters())


@pytest.mark.parametrize("config_class, architectures, said", [
    ("GPT2Config", ["GPT2WithOurOwnHead"], "names the architecture GPT2WithOurOwnHead, which is not a model class"),
    ("GPT2Config", ["GPT2Config"], "names the architecture GPT2Config, which is not a model class"),
    ("ViTConfig", None, "names no architecture, and ViTConfig has no causal language model"),
])
def test_a_model_transformers_cannot_build_is_one_line_before_anything_is_simulated(config_class, architectures, said,
                                                                                  tmp_path, monkeypatch, capsys):
    """A class of the model's own code (a plan runs none from its folder), or none named where the config's type has
    no causal language model: refused naming --model and the class, before any rank is simulated."""
    import transformers

    from hf_zero.plan import planner

    def simulated(*args, **kwargs):
        raise AssertionError("a rank was simulated")

    monkeypatch.setattr(planner, "simulate_rank", simulated)
    getattr(transformers, config_class)(architectures=architectures).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--model", str(tmp_path), "--seq_len", "16"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model" in err and said in err, err


@pytest.mark.parametrize("flags, named", [
    (["--model", "no-such-model"], "--model"),
    (["--model", "gpt2-tiny", "--gpu_memory", "80XB"], "--gpu_memory"),
    (["--model", "gpt2-tiny", "--hpz_partition_size", "3"], "--hpz_partition_size"),
    (["--model", "gpt2-tiny", "--zero_stage", "2", "--offload_param", "cpu"], "--offload_param"),
    (["--model", "gpt2-tiny", "--seq_len", "4096"], "--seq_len"),
    (["--model", "gpt2-tiny", "--nodes", "0"], "--nodes"),
    (["--model", "gpt2-tiny", "--offload_optimizer", "nvme"], "--nvme"),
    (["--model", "gpt2-tiny", "--offload_param", "nvme", "--offload_optimizer", "cpu", "--nvme", "1TB"],
     "--offload_optimizer"),
    (["--model", "gpt2-tiny", "--nvme", "3.8XB"], "--nvme"),
    (["--model", "gpt2-tiny", "--adapter", "/no/such/adapter"], "--adapter"),
    (["--model", "gpt2-tiny", "--frozen", "/no/such/frozen.json"], "--frozen"),
    (["--model", "gpt2-tiny", "--optimizer", "os.system"], "--optimizer"),
    (["--model", "gpt2-tiny", "--optimizer", "no_such_library.Lion"], "--optimizer"),
    (["--model", "gpt2-tiny", "--optimizer", "Lion"], "--optimizer"),
    (["--model", "gpt2-tiny", "--optimizer", "lion_pytorch.Lion", "--optimizer_kwargs", '{"lr": -1}'],
     "--optimizer_kwargs"),
    (["--model", "gpt2-tiny", "--optimizer_kwargs", "[1]"], "--optimizer_kwargs"),
    (["--model", "gpt2-tiny", "--engine_settings", '{"reduce_bucket_sise": 5}'], "--engine_settings"),
    (["--model", "gpt2-tiny", "--engine_settings", '{"zero_stage": 3}'], "--engine_settings"),
    (["--model", "gpt2-tiny", "--engine_settings", '{"reduce_bucket_size": -5}'], "--engine_settings"),
])
def test_bad_input_is_one_line_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["plan", *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


def test_frozen_parameters_the_model_does_not_have_are_one_line_naming_the_flag(tmp_path, capsys):
    (tmp_path / "frozen.json").write_text(json.dumps(["transformer.h.0.attn.c_attn.weight", "no.such.parameter"]))
    with pytest.raises(SystemExit) as stopped:
        main(["plan", *TINY, *FIXED, "--frozen", str(tmp_path / "frozen.json")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--frozen names 1 parameter(s)" in err and "no.such.parameter" in err, err


@pytest.mark.parametrize("layout", ["a module", "a package's subfolder", "a namespace package",
                                    "a file its package imports"])
def test_an_optimizers_code_another_account_can_change_is_refused_before_any_of_it_runs(layout, tmp_path, capsys,
                                                                                        monkeypatch, request):
    """The plan imports the optimizer's module by name, which runs its code: where another account could change what
    the import runs (the module's folder, a subfolder of its package, a namespace package's folder, a file of the
    package that its own code imports), it is refused, naming the flag and the place, and nothing of it runs. Made
    private, the same module plans."""
    code = tmp_path / "code"
    code.mkdir(mode=0o755)
    body = f"import pathlib, torch\npathlib.Path({str(tmp_path / 'ran')!r}).touch()\n" \
           f"class SGD(torch.optim.SGD):\n    pass\n"
    # A name of its own per layout: this process keeps what it imported.
    package = {"a module": "planted_module", "a package's subfolder": "planted_package",
               "a namespace package": "planted_namespace", "a file its package imports": "planted_import"}[layout]
    files, name, writable = {
        "a module": ({f"{package}.py": body}, f"{package}.SGD", code),
        "a package's subfolder": ({f"{package}/__init__.py": "", f"{package}/sub/__init__.py": "",
                                   f"{package}/sub/optimizers.py": body}, f"{package}.sub.optimizers.SGD",
                                  code / package / "sub"),
        "a namespace package": ({f"{package}/optimizers.py": body}, f"{package}.optimizers.SGD", code / package),
        "a file its package imports": ({f"{package}/__init__.py": "from . import helpers\n",
                                        f"{package}/helpers.py": body, f"{package}/optimizers.py": "from .helpers "
                                        "import SGD\n"}, f"{package}.optimizers.SGD", code / package / "helpers.py"),
    }[layout]
    for path, text in files.items():
        (code / path).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        (code / path).write_text(text)
        (code / path).chmod(0o644)
    monkeypatch.syspath_prepend(str(code))
    request.addfinalizer(lambda: [sys.modules.pop(module) for module in list(sys.modules)
                                  if module.split(".")[0] == package])
    flags = ["plan", *TINY, *FIXED, "--optimizer", name, "--optimizer_kwargs", '{"lr": 0.1}']
    writable.chmod(0o777)
    with pytest.raises(SystemExit) as stopped:
        main(flags)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"hf-zero plan: --optimizer: {writable} can be written by other accounts"), err
    assert not (tmp_path / "ran").exists()

    writable.chmod(0o755 if writable.is_dir() else 0o644)
    assert main([*flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer"] == name
    assert (tmp_path / "ran").exists()


def test_the_engines_other_settings_narrow_the_candidates_to_those_the_engine_takes(capsys):
    """qwZ's quantized weights are stage 3's: given them, the plan considers stage 3 alone, and plans with them."""
    assert main(["plan", *TINY, "--micro_batch", "1", "--gradient_checkpointing", "false", "--json",
                 "--engine_settings", '{"quantized_weights": true}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["setting"]["zero_stage"] == 3 and out["engine_settings"] == {"quantized_weights": True}
    assert out["candidates"] and all(c["setting"].startswith("stage 3") for c in out["candidates"])


def test_nvme_is_not_a_candidate_for_an_optimizer_whose_states_it_cannot_stream(capsys):
    """The engine streams Adam's states through NVMe only: with SGD the plan goes on without NVMe's candidates."""
    assert main(["plan", *TINY, "--micro_batch", "1", "--gradient_checkpointing", "false", "--json", "--nvme", "1TB",
                 "--optimizer", "torch.optim.SGD", "--optimizer_kwargs", '{"lr": 0.1, "momentum": 0.9}']) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["optimizer"] == "torch.optim.SGD"
    assert out["candidates"] and not any("nvme" in c["setting"] for c in out["candidates"])


def test_plot_draws_each_candidates_memory_by_kind_and_its_step(tmp_path, capsys):
    """A PNG, and an SVG whose text is read back: the device's and the host's memory by kind, and each simulated
    candidate's step labelled with the tokens/s the printed table gives it."""
    import re

    drawn = tmp_path / "plan.png"
    assert main(["plan", *TINY, "--gpu_memory", "0.0025GB", "--max_micro_batch", "2", "--plot", str(drawn)]) == 0
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and drawn.stat().st_size > 10_000
    table = capsys.readouterr().out
    assert main(["plan", *TINY, "--gpu_memory", "0.0025GB", "--max_micro_batch", "2", "--plot",
                 str(tmp_path / "plan.svg")]) == 0
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", (tmp_path / "plan.svg").read_text())
    for label in ("GB per GPU at the step's peak", "host GB per node at the step's peak",
                  "step time, s (modelled, at its micro-batch)", "device capacity", "parameters", "gradients",
                  "optimizer states", "activations", "buffers", "other"):
        assert label in texts, label
    rows = [[cell.strip() for cell in row.split("|")[1:-1]] for row in table.splitlines() if row.startswith("| stage ")]
    speeds = [cells[4] for cells in rows if cells[4]]  # the simulated candidates
    assert speeds and [t for t in texts if t.endswith(" tokens/s")] == [f"{s} tokens/s" for s in speeds]
    with pytest.raises(SystemExit):
        main(["plan", *TINY, "--plot", str(tmp_path / "plan.txt")])
    assert "--plot must name a .png, .svg or .pdf file" in capsys.readouterr().err


def test_a_sample_of_other_tensors_plans_the_model_that_takes_them(tmp_path, capsys):
    """--sample: a sequence classifier's batch (a label per sequence) planned for the model its config names, the
    sequence length read from input_ids."""
    from tests.helpers import tiny_model

    classifier = tiny_model("bert")
    classifier.config.architectures = [type(classifier).__name__]
    classifier.config.save_pretrained(tmp_path)
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps({"input_ids": {"shape": [24], "dtype": "int64", "high": 64},
                                  "labels": {"shape": [], "dtype": "int64", "high": 3}}))
    assert main(["plan", "--model", str(tmp_path), "--sample", str(sample), "--gpus_per_node", "2",
                 *FIXED, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == sum(p.numel() for p in classifier.parameters())
    assert out["seq_len"] == 24 and out["fits"] and out["per_rank"]["device"]["activations"] > 0


@pytest.mark.parametrize("sample, said", [
    ("[1, 2]", "expected an object of one or more tensors"),
    ('{"input_ids": {"shape": [0], "dtype": "int64", "high": 9}}', "input_ids's shape must be a list of positive"),
    ('{"input_ids": {"shape": [8], "dtype": "int65", "high": 9}}', "input_ids's dtype must name a torch dtype"),
    ('{"input_ids": {"shape": [8], "dtype": "int64"}}', "input_ids's high must be a positive integer"),
    ("{not json", "--sample"),
])
def test_a_bad_sample_is_one_line_naming_the_flag(tmp_path, sample, said, capsys):
    path = tmp_path / "sample.json"
    path.write_text(sample)
    with pytest.raises(SystemExit):
        main(["plan", "--model", "gpt2-tiny", "--sample", str(path)])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--sample" in err and said in err, err
