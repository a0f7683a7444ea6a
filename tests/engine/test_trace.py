"""A torch.profiler trace of one stage-3 step reads by phase: each unit's gather, wait and release, each bucket's
reduction, the gradient norm, the optimizer step, the offload copies and the checkpoint save are spans named
"hf_zero.<phase> <what>" (hf_zero/runtime/trace.py), as FSDP2 and torchtitan label theirs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.runtime.trace import PREFIX
from tests.helpers import batch, local_part, make_optimizer, tiny_model

pytestmark = pytest.mark.slow
WORLD = 2


def profiled_stage3_step(folder: str) -> tuple[list[str], list[str]]:
    """The span names of one profiled stage-3 step with the optimizer and parameters in host memory, and a save;
    and the units' titles."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3, "param_persistence_threshold": 0,
                                                               "offload_optimizer": "cpu", "offload_param": "cpu"})
    engine.backward(engine(**local_part(batch("gpt2", 0, 4), rank, world)).loss)  # a first step, unprofiled
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        engine.backward(engine(**local_part(batch("gpt2", 1, 4), rank, world)).loss)
        engine.step()
        engine.save_checkpoint(Path(folder) / "checkpoint")
    spans = sorted({event.name for event in trace.events() if event.name.startswith(PREFIX)})
    return spans, [unit.title for unit in engine.params.units]


def test_a_profiled_stage3_step_names_every_phase(tmp_path):
    spans, units = spawn_gloo(profiled_stage3_step, WORLD, str(tmp_path))[0]
    for unit in units:
        assert {f"hf_zero.gather {unit}", f"hf_zero.wait_for_gather {unit}", f"hf_zero.release {unit}"} <= set(spans)
        assert any(span.startswith("hf_zero.reduce") and unit in span for span in spans), (unit, spans)
    phases = {span.split(" ")[0] for span in spans}
    assert {"hf_zero.backward", "hf_zero.step", "hf_zero.grad_norm", "hf_zero.optimizer_step", "hf_zero.host_step",
            "hf_zero.copy_to_host", "hf_zero.save_checkpoint"} <= phases, spans


def test_spans_cost_nothing_without_a_profiler():
    """Outside a profiler a span is no record_function at all (which costs about 4 µs each)."""
    from hf_zero.runtime.trace import span

    assert not torch.autograd._profiler_enabled()
    assert type(span("gather", "unit 'h.0'")).__name__ == "nullcontext"
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        with span("gather", "unit 'h.0'"):
            torch.ones(1).add_(1)
    assert "hf_zero.gather unit 'h.0'" in {event.name for event in trace.events()}
