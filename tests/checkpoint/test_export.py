"""The streaming weight writer: files safetensors and from_pretrained read as if save_pretrained wrote them, in the
layout save_pretrained writes."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_zero
from hf_zero.checkpoint.export import (
    SavedLayout,
    ShardedWeightsWriter,
    meta_like,
    weights_to_save,
)
from hf_zero.runtime.launch import spawn_gloo
from tests.checkpoint_helpers import rank_world, train
from tests.helpers import (
    CONVERTED_TENSORS,
    assert_saved_as_stock_saves,
    named_copy,
    saved_tensors,
    tiny_converted_model,
    tiny_model,
)


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


SHARD = "8KB"  # every tiny converted model in several files


@pytest.mark.parametrize("kind", list(CONVERTED_TENSORS))
def test_stage3_writes_a_converted_model_as_stock_save_pretrained_writes_the_same_weights(kind, tmp_path):
    """transformers holds these models in another layout than their checkpoints' (experts merged into one tensor,
    projections split, names changed), and save_pretrained reverts it; so does the engine's save, unit by unit."""
    model = tiny_converted_model(kind)
    stock = copy.deepcopy(model)  # the same weights, saved by transformers
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    engine.save_weights(tmp_path / "ours", write=True, max_shard_size=SHARD)
    stock.save_pretrained(tmp_path / "stock", max_shard_size=SHARD)
    assert_saved_as_stock_saves(tmp_path / "ours", tmp_path / "stock")
    held, saved = CONVERTED_TENSORS[kind]
    assert (len(weights_to_save(stock)), len(saved_tensors(tmp_path / "ours"))) == (held, saved)
    # save_weights writes the weights alone; the Trainer adds the config
    shutil.copy(tmp_path / "stock" / "config.json", tmp_path / "ours")
    loaded = named_copy(AutoModelForCausalLM.from_pretrained(tmp_path / "ours"))
    expected = named_copy(stock)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


def trained_and_saved_on_each_rank(root: str) -> None:
    """Each converted model trained 2 steps at stage 3 and saved by the engine; the weights it then holds, gathered,
    saved by save_pretrained."""
    rank, _ = rank_world()
    for kind in CONVERTED_TENSORS:
        model = tiny_converted_model(kind)
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_stage": 3})
        train(engine, 0, 2, kind)
        engine.save_weights(Path(root) / kind / "ours", write=rank == 0, max_shard_size=SHARD)
        with engine.gathered_parameters():
            trained = {name: t.clone() for name, t in engine.module.state_dict().items()}
        if rank == 0:
            stock = tiny_converted_model(kind)
            stock.load_state_dict(trained)
            stock.save_pretrained(Path(root) / kind / "stock", max_shard_size=SHARD)
        dist.barrier()


def test_two_ranks_at_stage3_write_trained_converted_models_as_stock_save_pretrained_writes_them(tmp_path):
    spawn_gloo(trained_and_saved_on_each_rank, 2, str(tmp_path))
    for kind in CONVERTED_TENSORS:
        assert_saved_as_stock_saves(tmp_path / kind / "ours", tmp_path / kind / "stock")


def lara_mini_layout() -> tuple[SavedLayout, dict[str, torch.Tensor]]:
    model = tiny_converted_model("lara_mini")
    weights = {name: t.detach().clone() for name, t in weights_to_save(model).items()}
    return SavedLayout(model, {name: meta_like(t.shape, t.dtype) for name, t in weights.items()}), weights


def test_a_saved_tensor_made_of_several_waits_for_the_last_and_keeps_the_earlier_ones_values():
    """LaraMini's stored `in_proj` is its four projections concatenated: it is written once the fourth arrives,
    from the values the first three had when they arrived (a unit's gathered memory is reused by the next)."""
    layout, weights = lara_mini_layout()
    attention = "model.layers.0.linear_attn."
    first = {attention + "in_proj_qkv.weight": weights[attention + "in_proj_qkv.weight"].clone()}
    assert dict(layout.convert(first)) == {}
    first[attention + "in_proj_qkv.weight"].zero_()  # reused for the next unit
    rest = {attention + f"in_proj_{p}.weight": weights[attention + f"in_proj_{p}.weight"] for p in "zba"}
    made = dict(layout.convert(rest))
    assert list(made) == [attention + "in_proj.weight"]
    assert torch.equal(made[attention + "in_proj.weight"],
                       torch.cat([weights[attention + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]))
    assert dict(layout.convert({attention + "norm.weight": weights[attention + "norm.weight"]})).keys() == \
        {attention + "out_norm.weight"}


def test_a_saved_tensor_whose_parts_never_all_arrive_is_named_with_the_missing_one():
    layout, weights = lara_mini_layout()
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    list(layout.convert({name: weights[name]}))
    with pytest.raises(RuntimeError, match=r"model.layers.0.linear_attn.in_proj.weight is saved from .*, and "
                                           r"model.layers.0.linear_attn.in_proj_a.weight never arrived"):
        layout.check_complete()
    with pytest.raises(ValueError, match="model.layers.9.mlp.weight is not one of the LaraMiniForCausalLM tensors"):
        list(layout.convert({"model.layers.9.mlp.weight": torch.zeros(1)}))
