"""ZeRO++ on stage 3 (hf_zero/zero/stage3.py, hf_zero/ops/quantize.py). qwZ: units are all-gathered as
block-quantized int8 with fp32 scales, so the model computes forward and backward with the dequantized
weights while the fp32 masters take the update. The reference is one process on the global batch doing
exactly that by hand: each unit's weights cut into the ranks' chunks, each chunk quantized and dequantized
by the torch reference, the gradient taken there and applied to the exact masters by torch's AdamW."""
from __future__ import annotations

import pytest
import torch

import hf_zero
from hf_zero.launch import spawn_gloo
from hf_zero.ops.quantize import dequantize_reference, quantize_reference
from tests.helpers import batch, local_part, make_optimizer, named_copy, tiny_model
from tests.test_engine import FP32_TOL

STEPS, GLOBAL_BATCH, BLOCK, WORLD = 3, 8, 64, 2


def qwz_run(config: dict) -> dict:
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3, **config})
    # Each unit's flat buffer: its parameters' places in it, and the chunk each rank owns.
    layout = [{"chunk": flat.buckets[0].chunk_numel, "padded": flat.padded_numel,
               "slices": [(s.name, s.offset, s.numel) for s in flat.slices]}
              for unit in engine.params.units for flat in unit.flats]
    sent = []
    for step in range(STEPS):
        engine.backward(engine(**local_part(batch("gpt2", step, GLOBAL_BATCH), engine.comm.rank, WORLD)).loss)
        engine.step()
        sent.append(engine.ledger.last_step_bytes.get("all_gather", 0))
    with engine.gathered_parameters():
        return {"params": named_copy(model), "layout": layout, "all_gather_bytes": sent}


def quantized_like_the_ranks(model: torch.nn.Module, layout: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter as the ranks compute with it: its unit's buffer cut into chunks, each chunk
    block-quantized to int8 and back."""
    params, out = dict(model.named_parameters()), {}
    for flat in layout:
        buffer = torch.zeros(flat["padded"])
        for name, offset, numel in flat["slices"]:
            buffer[offset:offset + numel] = params[name].detach().reshape(-1)
        seen = torch.cat([dequantize_reference(quantize_reference(chunk, 8, BLOCK))
                          for chunk in buffer.split(flat["chunk"])])
        for name, offset, numel in flat["slices"]:
            out[name] = seen[offset:offset + numel].view(params[name].shape)
    return out


def qwz_by_hand(layout: list[dict]) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for name, value in quantized_like_the_ranks(model, layout).items():
                model.get_parameter(name).copy_(value)
        model(**batch("gpt2", step, GLOBAL_BATCH)).loss.backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(masters[name])
        optimizer.step()
        optimizer.zero_grad()
    return named_copy(model)


@pytest.mark.slow
def test_qwz_trains_as_one_process_computing_with_the_ranks_quantized_chunks_and_sends_a_quarter():
    config = {"quantized_weights": True, "quantization_block_size": BLOCK}
    ranks = spawn_gloo(qwz_run, WORLD, config)
    plain = spawn_gloo(qwz_run, WORLD, {})
    expected = qwz_by_hand(ranks[0]["layout"])
    for result in ranks:
        assert max((result["params"][n] - p).abs().max().item() for n, p in expected.items()) < FP32_TOL
    # It is not the unquantized run: the test could not pass with qwZ ignored.
    assert max((plain[0]["params"][n] - p).abs().max().item() for n, p in expected.items()) > 100 * FP32_TOL
    # fp32 weights as int8 plus a 4-byte scale per 64 elements: (1 + 4/64) / 4 of the bytes.
    for quantized, exact in zip(ranks[0]["all_gather_bytes"], plain[0]["all_gather_bytes"]):
        assert quantized == pytest.approx(exact * (1 + 4 / BLOCK) / 4, rel=0.01)


def test_qwz_settings_are_refused_where_they_have_no_meaning():
    model = tiny_model("gpt2")
    for config, message in [({"zero_stage": 2, "quantized_weights": True}, "quantized_weights quantizes stage 3's"),
                            ({"zero_stage": 3, "quantized_weights": True, "offload_param": "cpu",
                              "offload_optimizer": "cpu"}, "quantized_weights with offload_param cpu is not"),
                            ({"zero_stage": 3, "quantization_block_size": 3}, "quantization_block_size must be a "
                                                                              "positive even integer")]:
        with pytest.raises(hf_zero.ZeroConfigError, match=message):
            hf_zero.initialize(model, make_optimizer(model), config)
