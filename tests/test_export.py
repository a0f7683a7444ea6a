"""The streaming weight writer: files safetensors and from_pretrained read as if save_pretrained wrote them."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hf_zero.export import ShardedWeightsWriter, meta_like, weights_to_save
from tests.helpers import tiny_model


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 48, generator=g), "a.bias": torch.randn(48, generator=g),
            "b.weight": torch.randn(100, 30, generator=g).to(torch.bfloat16),
            "c.position_ids": torch.arange(37), "d.mask": torch.rand(5, 5, generator=g) > 0.5,
            "e.scale": torch.tensor(3.5), "f.half": torch.randn(7, 3, generator=g).half()}


def plan(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: meta_like(t.shape, t.dtype) for name, t in tensors.items()}


def test_tensors_written_in_any_order_read_back_exactly_in_save_pretrained_shards(tmp_path):
    tensors = mixed_tensors()
    writer = ShardedWeightsWriter(tmp_path, plan(tensors), max_shard_size=4000)
    for name in reversed(list(tensors)):
        writer.write(name, tensors[name])
    files = writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    assert index["weight_map"] == writer.split.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    read = {}
    for file in files[:-1]:
        read.update(load_file(tmp_path / file))
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert read.keys() == tensors.keys()
    for name, t in tensors.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t), name


def test_one_shard_is_model_safetensors_and_replaces_an_earlier_sharded_save(tmp_path):
    tensors = mixed_tensors()
    for size in (8000, 10**9):  # first sharded, then one file
        writer = ShardedWeightsWriter(tmp_path, plan(tensors), max_shard_size=size)
        for name, t in tensors.items():
            writer.write(name, t)
        writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_tensor_never_written_fails_and_leaves_the_folder_as_it_was(tmp_path):
    tensors = mixed_tensors()
    (tmp_path / "model.safetensors").write_bytes(b"an earlier save")
    writer = ShardedWeightsWriter(tmp_path, plan(tensors), max_shard_size=8000)
    writer.write("a.weight", tensors["a.weight"])
    with pytest.raises(RuntimeError, match="planned tensors were never written"):
        writer.close()
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"an earlier save"


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    writer = ShardedWeightsWriter(tmp_path, plan(mixed_tensors()))
    with pytest.raises(ValueError, match=r"a.bias: got shape \[47\], planned \[48\]"):
        writer.write("a.bias", torch.zeros(47))
    writer.abort()


def test_weights_to_save_names_what_save_pretrained_writes(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert set(weights_to_save(model)) == saved
    assert "lm_head.weight" not in saved  # tied to transformer.wte.weight
