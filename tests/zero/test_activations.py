"""ZeRO-R activation checkpointing (hf_zero/zero/activations.py): P_a keeps 1/tp of each block's input
checkpoint, P_a+cpu keeps it in host memory, M_D in one buffer per step; the losses stay those of
plain checkpointing, and the ledger shows one all-gather of seq x hidden x batch per block."""
from __future__ import annotations

import logging

import pytest
import torch

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.zero.activations import CheckpointStore, apply_activation_checkpointing
from tests.helpers import SEQ, batch, make_optimizer, tiny_model
from tests.runtime.test_tensor_parallel import tp_model

# Immediate, and under each mode of the simulation of a GPU (tests/conftest.py: copies).
pytestmark = pytest.mark.usefixtures("copies")

STEPS, GLOBAL_BATCH = 3, 8
MODES = {"whole": None, "pa": {"partition_activations": True},
         "pa_cpu": {"partition_activations": True, "cpu_checkpointing": True}}


def measure(tp: int) -> dict[str, dict]:
    """Per mode: losses, peak checkpoint bytes on the device and in host memory, last step's ledger.
    "plain" is transformers' own checkpointing; "whole" keeps the block inputs whole through the store,
    which measures what plain checkpointing holds."""
    results = {}
    for mode in ("plain", *MODES):
        model, mesh = tp_model("gpt2-tp", tp)
        model.train()
        store = None
        if mode == "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        elif mode == "whole":
            store = CheckpointStore(None, partition=False, cpu=False)
            apply_activation_checkpointing(model, store)
        engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, **(MODES.get(mode) or {})},
                                    mesh=mesh)
        store = store or engine.activation_store
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        losses, in_buffer = [], []
        for step in range(STEPS):
            b = {k: v.chunk(dp)[dp_rank] for k, v in batch("gpt2-tp", step, GLOBAL_BATCH).items()}
            loss = engine(**b).loss
            if store is not None and store.buffer is not None:  # M_D: this step's checkpoints lie in one buffer
                base = store.buffer.untyped_storage().data_ptr()
                in_buffer.append(all(s.kept.untyped_storage().data_ptr() == base for s in store.live))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[mode] = {"losses": losses, "ledger": dict(engine.ledger.last_step_elements),
                         "peak": dict(store.peak_held_bytes) if store else None, "in_buffer": in_buffer,
                         "blocks": model.config.n_layer, "local_batch": GLOBAL_BATCH // dp,
                         "hidden": model.config.n_embd}
    return results


def test_partitioned_and_cpu_checkpoints_shrink_memory_by_tp_and_keep_the_losses():
    for tp in (2, 4):
        for rank_result in spawn_gloo(measure, 4, tp):
            plain, whole, pa, pa_cpu = (rank_result[m] for m in ("plain", "whole", "pa", "pa_cpu"))
            # The block-input checkpoints of one step, as the paper counts them: seq x hidden x batch per block.
            per_block = SEQ * whole["hidden"] * whole["local_batch"]
            checkpoint_bytes = 4 * per_block * whole["blocks"]
            assert whole["peak"] == {"device": checkpoint_bytes, "host": 0}
            assert pa["peak"] == {"device": checkpoint_bytes // tp, "host": 0}           # P_a: 1/tp
            assert pa_cpu["peak"] == {"device": 0, "host": checkpoint_bytes // tp}       # P_a+cpu: off the device
            # Recomputation starts from the exact gathered input: the same losses as plain checkpointing.
            for run in (whole, pa, pa_cpu):
                assert run["losses"] == plain["losses"]
            # M_D: from the second step on, every kept checkpoint lies in the step's one buffer.
            assert pa["in_buffer"] == [True] * (STEPS - 1) and pa_cpu["in_buffer"] == [True] * (STEPS - 1)
            # The ledger: P_a adds one all-gather of seq x hidden x batch per block, and nothing else.
            for run in (pa, pa_cpu):
                extra = {op: run["ledger"].get(op, 0) - plain["ledger"].get(op, 0)
                         for op in run["ledger"].keys() | plain["ledger"].keys()}
                assert extra == {**{op: 0 for op in extra}, "all_gather": per_block * whole["blocks"]}


def train_single(config: dict, gradient_checkpointing: bool) -> tuple[list[float], hf_zero.ZeroEngine]:
    model = tiny_model("gpt2")
    model.train()
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, **config})
    losses = []
    for step in range(STEPS):
        loss = engine(**batch("gpt2", step, GLOBAL_BATCH)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def test_without_tensor_parallelism_cpu_checkpointing_offloads_whole_checkpoints():
    plain, _ = train_single({}, gradient_checkpointing=True)
    offloaded, engine = train_single({"cpu_checkpointing": True}, gradient_checkpointing=False)
    assert offloaded == plain
    blocks, hidden = engine.module.config.n_layer, engine.module.config.n_embd
    assert engine.activation_store.peak_held_bytes == {"device": 0, "host": 4 * SEQ * hidden * GLOBAL_BATCH * blocks}


def test_without_tensor_parallelism_partition_activations_says_there_is_nothing_to_partition(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        losses, engine = train_single({"partition_activations": True}, gradient_checkpointing=False)
    assert "tensor parallel size is 1" in caplog.text and "nothing to partition" in caplog.text
    assert losses == train_single({}, gradient_checkpointing=True)[0]
    assert not engine.activation_store.partition


def test_activation_checkpointing_needs_a_model_that_supports_it():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="Sequential does not support gradient checkpointing. Use a transformers "
                                         "model whose blocks support it, or leave both settings off"):
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"cpu_checkpointing": True})
