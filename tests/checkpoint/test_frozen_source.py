"""A LoRA checkpoint records its frozen base by the pretrained files it came from instead of storing it:
resumed bitwise, on other world sizes and stages, a changed base refused naming its file, and the base stored
as before where it has no source or `checkpoint_frozen_weights` is "stored"."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_zero.checkpoint import CheckpointError
from hf_zero.runtime.launch import spawn_gloo
from tests.checkpoint_helpers import SAVE_AT, train, whole_params
from tests.frozen_source_helpers import (
    continue_lora,
    folder_bytes,
    frozen_whole,
    hub_lora_resumes,
    lora_engine,
    lora_resume,
    lora_trainer,
    put_in_hub_cache,
    read_base,
    resume_runs,
    save_base,
)
from tests.helpers import hf_zero_messages


def stored_keys(checkpoint: Path) -> list[str]:
    keys = []
    for shard in sorted(checkpoint.glob("rank*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys += list(f.keys())
    return keys


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen_source")
    base = save_base(root / "base")
    return root, base, spawn_gloo(resume_runs, 2, str(root), str(base))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_lora_checkpoint_holds_no_base_and_resumes_bitwise_from_the_base_folder(two_rank_runs, stage):
    root, base, ranks = two_rank_runs
    checkpoint = Path(ranks[0][stage]["folder"])
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    # The base is recorded by its file, the hash computed here independently, and none of it is stored.
    file = base / "model.safetensors"
    assert manifest["frozen_source"]["name_or_path"] == str(base.resolve())
    assert manifest["frozen_source"]["files"] == [{"file": "model.safetensors", "bytes": file.stat().st_size,
                                                   "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}]
    assert set(manifest["frozen_source"]["keys"]) == set(manifest["frozen"]) and len(manifest["frozen"]) > 20
    assert not any(key.startswith("frozen/") for key in stored_keys(checkpoint))
    expected = read_base(base)
    assert ranks[0][stage]["loaded_frozen"].keys() == expected.keys()
    for result in ranks:
        # The zeroed base came back from the folder, bit for bit, and training went on as if never stopped.
        assert all(torch.equal(t, expected[n]) for n, t in result[stage]["loaded_frozen"].items())
        for name, param in result[stage]["straight"].items():
            assert torch.equal(param, result[stage]["resumed"][name]), f"{name} differs after resuming"


@pytest.mark.parametrize("config", [{"zero_stage": 1}, {"zero_stage": 3}, {"zero_stage": 2}])
def test_a_two_rank_lora_checkpoint_continues_on_one_rank_at_any_stage_reading_the_base_from_its_folder(
        two_rank_runs, config):
    root, base, ranks = two_rank_runs
    assert "frozen_source" in json.loads((Path(ranks[0][3]["folder"]) / "manifest.json").read_text())
    continued = continue_lora(ranks[0][3]["folder"], str(base), config)
    expected = read_base(base)
    assert all(torch.equal(t, expected[n]) for n, t in continued["loaded_frozen"].items())
    straight = ranks[0][3]["straight"]
    # fp32 rounding of the 2-rank gradient average taken in another order, as any world-size change
    assert max((straight[n] - p).abs().max().item() for n, p in continued["params"].items()) < 1e-5


@pytest.fixture
def base(tmp_path):
    return save_base(tmp_path / "base")


def saved_lora(base: Path | str, folder: Path, **config: str) -> None:
    engine = lora_engine({"zero_stage": 1, **config}, base)
    train(engine, 0, SAVE_AT)
    engine.save_checkpoint(folder)


def test_a_changed_base_file_is_refused_naming_it_and_nothing_changes(base, tmp_path):
    saved_lora(base, tmp_path / "ckpt")
    engine = lora_engine({"zero_stage": 1}, base)
    before = whole_params(engine)
    tensors = read_base(base)
    tensors["transformer.h.0.mlp.c_fc.weight"] += 0.01  # same shapes, same size: only the hash tells
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{base / 'model.safetensors'} changed since the checkpoint was saved"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(p, before[n]) for n, p in whole_params(engine).items())
    assert engine.global_steps == 0
    (base / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{base / 'model.safetensors'} is missing"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_checkpoint_frozen_weights_stored_keeps_the_base_in_the_checkpoint(base, tmp_path):
    saved_lora(base, tmp_path / "by_source")
    saved_lora(base, tmp_path / "stored", checkpoint_frozen_weights="stored")
    manifest = json.loads((tmp_path / "stored" / "manifest.json").read_text())
    assert "frozen_source" not in manifest
    assert {k for k in stored_keys(tmp_path / "stored") if k.startswith("frozen/")} == \
        {f"frozen/{name}/0" for name in manifest["frozen"]}
    size = {name: (tmp_path / name / "rank00000-of-00001.safetensors").stat().st_size for name in ("by_source", "stored")}
    base_bytes = (base / "model.safetensors").stat().st_size
    assert size["stored"] > base_bytes > 5 * size["by_source"]
    # It resumes without the base folder, into a base zeroed.
    engine = lora_engine({"zero_stage": 3, "checkpoint_frozen_weights": "stored"}, base, zeroed=True)
    (base / "model.safetensors").unlink()
    engine.load_checkpoint(tmp_path / "stored")
    expected = read_base_from_checkpoint(tmp_path / "stored")
    assert all(torch.equal(t, expected[n]) for n, t in frozen_whole(engine).items())


def read_base_from_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "rank00000-of-00001.safetensors"), framework="pt") as f:
        manifest = json.loads((folder / "manifest.json").read_text())
        return {name.removeprefix("base_model.model.").replace(".base_layer", ""): f.get_tensor(f"frozen/{name}/0").view(entry["shape"])
                for name, entry in manifest["frozen"].items()}


def test_a_base_built_from_a_config_or_changed_in_memory_is_stored_saying_why(base, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        engine = lora_engine({"zero_stage": 1}, None)  # tiny_model: from the config, no folder
        train(engine, 0, SAVE_AT)
        engine.save_checkpoint(tmp_path / "from_config")
        changed = lora_engine({"zero_stage": 1}, base)
        with torch.no_grad():
            changed.module.base_model.model.transformer.wpe.weight.add_(1.0)
        changed.save_checkpoint(tmp_path / "changed")
    said = [m for m in hf_zero_messages(caplog.records) if "store the frozen weights" in m]
    assert "not loaded with from_pretrained from a local folder" in said[0]
    assert "the frozen weight base_model.model.transformer.wpe.weight is not" in said[1]
    for name, engine in (("from_config", engine), ("changed", changed)):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert "frozen_source" not in manifest
        assert {k for k in stored_keys(tmp_path / name) if k.startswith("frozen/")} == \
            {f"frozen/{n}/0" for n in manifest["frozen"]}
    resumed = lora_engine({"zero_stage": 1}, base, zeroed=True)
    resumed.load_checkpoint(tmp_path / "changed")
    wpe = changed.module.base_model.model.transformer.wpe.weight
    assert torch.equal(frozen_whole(resumed)["transformer.wpe.weight"], wpe)


def test_a_crafted_source_file_name_is_refused_as_damage(base, tmp_path):
    saved_lora(base, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["frozen_source"]["files"][0]["file"] = "../base/model.safetensors"
    path.write_text(json.dumps(manifest))
    engine = lora_engine({"zero_stage": 1}, base)
    with pytest.raises(CheckpointError, match="is not a plain safetensors file name"):
        engine.load_checkpoint(tmp_path / "ckpt")


def test_a_base_changed_in_memory_after_a_save_is_stored_by_the_next_save_saying_so_once(base, tmp_path, caplog):
    """The comparison with the files is not repeated at every save: the parameter's version counter tells the next
    save that the first one's comparison no longer holds."""
    engine = lora_engine({"zero_stage": 1}, base)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "before")
    wpe = engine.module.base_model.model.transformer.wpe.weight
    with torch.no_grad():
        wpe.add_(1.0)
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        for step, name in ((1, "after"), (2, "after_again")):
            train(engine, step, step + 1)
            engine.save_checkpoint(tmp_path / name)
    said = [m for m in hf_zero_messages(caplog.records) if "frozen weights" in m]
    assert len(said) == 1 and "the frozen weight base_model.model.transformer.wpe.weight is not" in said[0]
    sources = {name: "frozen_source" in json.loads((tmp_path / name / "manifest.json").read_text())
               for name in ("before", "after", "after_again")}
    assert sources == {"before": True, "after": False, "after_again": False}
    resumed = lora_engine({"zero_stage": 1}, base, zeroed=True)
    resumed.load_checkpoint(tmp_path / "after")
    assert torch.equal(frozen_whole(resumed)["transformer.wpe.weight"], wpe)


def test_a_manifest_reading_a_weight_from_another_tensor_of_its_shape_is_refused_by_merge_and_load_alike(
        base, tmp_path):
    """Files and shapes check out when two weights of one shape swap their tensors: only the names the model's own
    loading gives them tell, which consolidation and loading check the same way."""
    from hf_zero.checkpoint.consolidate import consolidate

    saved_lora(base, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    keys = manifest["frozen_source"]["keys"]
    first, second = (f"base_model.model.transformer.h.{layer}.attn.c_proj.weight" for layer in (0, 1))
    keys[first], keys[second] = keys[second], keys[first]
    path.write_text(json.dumps(manifest))
    refused = (rf"frozen_source.keys reads the frozen weight {first} from model.safetensors's "
               rf"'transformer.h.1.attn.c_proj.weight', but the model loads it from model.safetensors's "
               rf"'transformer.h.0.attn.c_proj.weight'")
    with pytest.raises(CheckpointError, match=refused):
        consolidate(tmp_path / "ckpt", tmp_path / "merged", merge=True, progress=False)
    assert not (tmp_path / "merged").exists()
    engine = lora_engine({"zero_stage": 1}, base, zeroed=True)
    before = whole_params(engine)
    with pytest.raises(CheckpointError, match=refused):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(p, before[n]) for n, p in whole_params(engine).items())


HUB_ID, COMMIT = "hf-zero-tests/tiny-gpt2", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_base(base, tmp_path, monkeypatch):
    """The base as a download of HUB_ID at COMMIT in a Hub cache of its own, offline: from_pretrained(HUB_ID) reads
    it there, as after `hf download`."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = put_in_hub_cache(base, cache, HUB_ID, COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


@pytest.mark.parametrize("stage", [1, 3])
def test_a_lora_checkpoint_on_a_hub_base_records_its_id_and_commit_and_resumes_bitwise_from_the_cache(
        hub_base, tmp_path, stage):
    run = lora_resume({"zero_stage": stage}, HUB_ID, str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    file = hub_base / "model.safetensors"
    assert {k: v for k, v in manifest["frozen_source"].items() if k != "keys"} == {
        "name_or_path": HUB_ID, "revision": COMMIT,
        "files": [{"file": "model.safetensors", "bytes": file.stat().st_size,
                   "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}]}
    assert not any(key.startswith("frozen/") for key in stored_keys(tmp_path / "ckpt"))
    expected = read_base(hub_base)
    assert run["loaded_frozen"].keys() == expected.keys()
    assert all(torch.equal(t, expected[n]) for n, t in run["loaded_frozen"].items())
    assert all(torch.equal(p, run["straight"][n]) for n, p in run["resumed"].items())


def test_a_two_rank_lora_run_on_a_one_file_hub_base_resumes_bitwise(base, tmp_path):
    """Each rank checks its share of the base's files: here rank 1 has none, and reads its pieces all the same."""
    put_in_hub_cache(base, tmp_path / "hub", HUB_ID, COMMIT)
    assert spawn_gloo(hub_lora_resumes, 2, str(tmp_path / "hub"), HUB_ID, str(tmp_path)) == [True, True]


def test_a_hub_base_missing_from_the_cache_offline_or_changed_there_is_refused_and_nothing_changes(hub_base, tmp_path):
    saved_lora(HUB_ID, tmp_path / "ckpt")
    engine = lora_engine({"zero_stage": 1}, HUB_ID, zeroed=True)
    before = whole_params(engine)
    blob = (hub_base / "model.safetensors").resolve()
    tensors = read_base(hub_base)
    tensors["transformer.h.0.mlp.c_fc.weight"] += 0.01
    save_file(tensors, str(blob), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{hub_base / 'model.safetensors'} changed since the checkpoint"):
        engine.load_checkpoint(tmp_path / "ckpt")
    (hub_base / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"model.safetensors of the Hub model {HUB_ID} at commit {COMMIT} is not "
                                              rf"in the Hub cache and could not be downloaded .*`hf download {HUB_ID} "
                                              rf"--revision {COMMIT}`"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(p, before[n]) for n, p in whole_params(engine).items())
    assert engine.global_steps == 0


@pytest.mark.parametrize("field, value, refused", [
    ("revision", "main", "frozen_source.revision must be a commit: 40 hex digits"),
    ("revision", "../../../../base", "frozen_source.revision must be a commit"),
    ("name_or_path", "../hub/x", "frozen_source.name_or_path is not a Hub id"),
])
def test_a_crafted_hub_source_is_refused_as_damage(hub_base, tmp_path, field, value, refused):
    saved_lora(HUB_ID, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["frozen_source"][field] = value
    path.write_text(json.dumps(manifest))
    engine = lora_engine({"zero_stage": 1}, HUB_ID)
    with pytest.raises(CheckpointError, match=refused):
        engine.load_checkpoint(tmp_path / "ckpt")


# ---- through the Trainer, against the stock Trainer with peft ----------------------------------------------------
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    base = save_base(root / "base")
    for name, zero in (("stock", None), ("by_source", {"zero_stage": 1}),
                       ("stored", {"zero_stage": 1, "zero_checkpoint_frozen_weights": "stored"})):
        lora_trainer(base, root / name, 4, zero)
    return root, base


def test_a_lora_trainer_checkpoint_is_the_size_of_stocks_and_stored_it_holds_the_base(trainer_runs):
    root, base = trainer_runs
    size = {name: folder_bytes(root / name / "checkpoint-2") for name in ("stock", "by_source", "stored")}
    base_bytes = (base / "model.safetensors").stat().st_size
    # Stock holds the adapter and its Adam moments; ours the adapter, its fp32 masters and moments, and a manifest.
    assert size["by_source"] < 1.6 * size["stock"]
    assert size["stored"] - size["by_source"] > 0.99 * base_bytes  # the base's tensors, without the file's header


def test_a_lora_trainer_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(trainer_runs, tmp_path):
    import shutil

    root, base = trainer_runs
    shutil.copytree(root / "by_source", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    resumed = lora_trainer(base, tmp_path / "run", 4, {"zero_stage": 1}, resume=True)
    assert resumed.state.global_step == 4
    straight = read_adapter(root / "by_source" / "checkpoint-4")
    again = read_adapter(tmp_path / "run" / "checkpoint-4")
    assert straight.keys() == again.keys() and all(torch.equal(t, again[n]) for n, t in straight.items())


def read_adapter(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def test_consolidation_merges_the_base_read_from_its_folder_and_refuses_a_changed_one(trainer_runs, tmp_path):
    import shutil

    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    from hf_zero.checkpoint.consolidate import consolidate

    root, base = trainer_runs
    consolidate(root / "by_source" / "checkpoint-4", tmp_path / "merged", merge=True, progress=False)
    merged = GPT2LMHeadModel.from_pretrained(tmp_path / "merged").state_dict()
    peft_merged = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base),
                                            root / "by_source" / "checkpoint-4").merge_and_unload().state_dict()
    assert merged.keys() == peft_merged.keys() and all(torch.equal(t, peft_merged[n]) for n, t in merged.items())
    # The base changed: merging is refused naming its file; the adapter alone needs no base.
    shutil.copy(base / "model.safetensors", tmp_path / "original.safetensors")
    tensors = read_base(base)
    tensors["transformer.wte.weight"][0, 0] += 1.0
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    try:
        with pytest.raises(CheckpointError, match=rf"{base / 'model.safetensors'} changed since the checkpoint"):
            consolidate(root / "by_source" / "checkpoint-4", tmp_path / "merged_again", merge=True, progress=False)
        consolidate(root / "by_source" / "checkpoint-4", tmp_path / "adapter", progress=False)
        assert read_adapter(tmp_path / "adapter").keys() == read_adapter(root / "by_source" / "checkpoint-4").keys()
    finally:
        shutil.copy(tmp_path / "original.safetensors", base / "model.safetensors")
