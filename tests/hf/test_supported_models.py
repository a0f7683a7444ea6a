"""The models docs/supported_models.md lists, each trained at stage 3 on 2 ranks against one process on the global
batch: tiny configurations of transformers' own classes, none written here. The page's table is this module's
MODELS; a model added to one and not the other fails `test_the_supported_models_page_lists_what_this_module_trains`."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers as tf

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from tests.helpers import max_diff, named_copy

STEPS, BATCH, SEQ, VOCAB = 2, 4, 8, 64
# Adam's eps above the rounding noise of gradients that are zero in exact arithmetic (an attention key's bias: the
# softmax cancels it; they come out near 1e-11 in any summation order, and Adam at eps 1e-8 turns such noise into
# steps of a good part of lr, different on each side), far below any real gradient here.
ADAM = {"lr": 1e-3, "eps": 1e-6}
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=32)


def _causal(config_class: type, model_class: type, **extra: Any) -> Callable[[], torch.nn.Module]:
    return lambda: model_class(config_class(**TINY, **extra))


# class name -> how to build it, and what its batches hold ("lm": token ids as labels; "seq2seq": a decoder
# sequence too; "image": pixels and a class).
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "GPT2LMHeadModel": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                                                 n_positions=32)), "lm"),
    "BertForMaskedLM": (_causal(tf.BertConfig, tf.BertForMaskedLM), "lm"),
    "RobertaForMaskedLM": (_causal(tf.RobertaConfig, tf.RobertaForMaskedLM, pad_token_id=1), "lm"),
    "LlamaForCausalLM": (_causal(tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=2), "lm"),
    "MistralForCausalLM": (_causal(tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2), "lm"),
    "Qwen2ForCausalLM": (_causal(tf.Qwen2Config, tf.Qwen2ForCausalLM, num_key_value_heads=2), "lm"),
    "MixtralForCausalLM": (_causal(tf.MixtralConfig, tf.MixtralForCausalLM, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2), "lm"),
    "T5ForConditionalGeneration": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0)),
        "seq2seq"),
    "BartForConditionalGeneration": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=32)), "seq2seq"),
    "ViTForImageClassification": (lambda: tf.ViTForImageClassification(tf.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=16,
        patch_size=8, num_labels=3)), "image"),
}


def build(name: str) -> torch.nn.Module:
    """The model with its transformers initialisation from seed 0, dropout off (eval mode: both sides alike)."""
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    """Every example the same length and every label counted, so each rank's mean loss over its half averages to
    the global batch's."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "image":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 3, (BATCH,), generator=g)}
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids, "labels": torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)}
    return {"input_ids": ids, "labels": ids}


def train(model: torch.nn.Module, kind: str, step: Callable[[dict[str, torch.Tensor]], float],
          rank: int = 0, world: int = 1) -> list[float]:
    return [step({k: v.chunk(world)[rank] for k, v in batch(kind, s).items()}) for s in range(STEPS)]


def one_process(name: str) -> dict[str, Any]:
    model = build(name)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)

    def step(b: dict[str, torch.Tensor]) -> float:
        loss = model(**b).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return {"losses": train(model, MODELS[name][1], step), "params": named_copy(model)}


def stage3_on_every_model() -> dict[str, dict[str, Any]]:
    """Each model at stage 3, this rank training on its half of each global batch; the units stage 3 cut it into."""
    results = {}
    for name, (_, kind) in MODELS.items():
        model = build(name)
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), **ADAM),
                                    {"zero_stage": 3, "param_persistence_threshold": 0})

        def step(b: dict[str, torch.Tensor]) -> float:
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            return mean.item() / engine.comm.world_size

        losses = train(model, kind, step, engine.comm.rank, engine.comm.world_size)
        with engine.gathered_parameters():
            params = named_copy(model)
        units = sorted({type(u.module).__name__ for u in engine.params.units if u.name})
        results[name] = {"losses": losses, "params": params, "units": units}
    return results


@pytest.fixture(scope="module")
def trained() -> dict[str, dict[str, Any]]:
    return spawn_gloo(stage3_on_every_model, 2)[0]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_supported_model_trains_at_stage3_as_one_process(trained, name):
    reference = one_process(name)
    assert trained[name]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert max_diff(trained[name]["params"], reference["params"]) < 1e-5
    assert trained[name]["units"], "cut into blocks, not one unit"


def test_the_supported_models_page_lists_what_this_module_trains(trained):
    """Each row of docs/supported_models.md's table: the class, and the blocks stage 3 gathers one at a time."""
    page = (Path(__file__).parents[2] / "docs" / "supported_models.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page, re.MULTILINE))
    assert sorted(rows) == sorted(MODELS)
    for name, row in rows.items():
        assert row.strip() == ", ".join(f"`{unit}`" for unit in trained[name]["units"]), name
