"""Offloading the optimizer (stages 1-3) and the parameters (stage 3) to host memory changes where the
states live, not what training computes: every mode equals the same run without offload.

In bf16, runs are compared on what the claim is about, the fp32 masters; across whole runs that holds only
until the host kernel and ATen round one master an fp32 ulp apart across a bf16 tie (it depends on the
CPU), after which the forward passes differ. So bf16 offload is compared step by step, each step from the
engine's own state, in tests/zero/test_mixed_precision.py; here bf16 runs check that the bf16 weights are
their masters' rounding and that the first step, before any weight can differ, gives the same masters."""
from __future__ import annotations

import pytest
import torch

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from tests.conftest import SMALL_BUCKETS
from tests.engine.test_engine import FP32_TOL
from tests.helpers import (
    Scenario,
    assert_weights_round_the_masters,
    max_diff,
    run_scenarios,
    train_single_process,
)

# Immediate, and under each mode of the simulation of a GPU (tests/conftest.py: copies).
pytestmark = pytest.mark.usefixtures("copies")

STEPS = 4
CLIP = 0.5


def offload_scenarios() -> list[Scenario]:
    scenarios = []
    for dtype in ("fp32", "bf16"):
        steps = STEPS if dtype == "fp32" else 1
        for stage in (1, 2, 3):
            base = {"zero_stage": stage, "dtype": dtype, "gradient_clipping": CLIP, **SMALL_BUCKETS}
            scenarios.append(Scenario(f"s{stage}_{dtype}", config=base, steps=steps))
            scenarios.append(Scenario(f"s{stage}_{dtype}_opt", config={**base, "offload_optimizer": "cpu"},
                                      steps=steps))
        base = {"zero_stage": 3, "dtype": dtype, **SMALL_BUCKETS, "gradient_clipping": CLIP}
        scenarios.append(Scenario(f"s3_{dtype}_param", config={**base, "offload_param": "cpu"}, steps=steps))
        scenarios.append(Scenario(f"s3_{dtype}_opt_param", config={**base, "offload_param": "cpu",
                                                                    "offload_optimizer": "cpu"}, steps=steps))
    return scenarios


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request, copies) -> list[dict]:
    return spawn_gloo(run_scenarios, request.param, offload_scenarios())


MODES = [(1, "opt"), (2, "opt"), (3, "opt"), (3, "param"), (3, "opt_param")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage, offload", MODES, ids=[f"s{s}_{o}" for s, o in MODES])
def test_offload_trains_exactly_as_without_it(runs, stage, dtype, offload):
    for rank_result in runs:
        plain, offloaded = rank_result[f"s{stage}_{dtype}"], rank_result[f"s{stage}_{dtype}_{offload}"]
        gap = max_diff(offloaded["masters"], plain["masters"])
        if offload == "param":  # the same arithmetic, only the shard's home moves: bitwise
            assert gap == 0.0 and max_diff(offloaded["params"], plain["params"]) == 0.0
        else:  # the host Adam rounds as ATen does, an ulp apart on a few elements: the engine tests' tolerance
            assert gap <= FP32_TOL, gap
        for run in (plain, offloaded):
            assert_weights_round_the_masters(run["params"], run["masters"], hf_zero.ZeroConfig(dtype=dtype).torch_dtype)
        assert offloaded["norms"] == pytest.approx(plain["norms"], rel=1e-5)


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The independent reference: one process on the global batch, torch's own AdamW and clip_grad_norm_."""
    return train_single_process("gpt2", STEPS, 8, clip=CLIP)


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload", MODES, ids=[f"s{s}_{o}" for s, o in MODES])
def test_offload_trains_as_one_process_with_torchs_adamw_and_clipping(runs, one_process, stage, offload):
    """Against the run without offload alone, a bug both paths share (a norm not summed over ranks) passes."""
    assert min(one_process["norms"]) > CLIP  # the clipping acts at every step
    for rank_result in runs:
        offloaded = rank_result[f"s{stage}_fp32_{offload}"]
        assert max_diff(offloaded["params"], one_process["params"]) < FP32_TOL
        assert offloaded["norms"] == pytest.approx(one_process["norms"], rel=1e-5)


def test_offloaded_states_are_in_host_memory_and_counted_in_the_ledger():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    psi = sum(p.numel() for p in model.parameters())
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()),
                                {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"})
    engine.backward(engine(torch.randn(4, 8)).sum())
    engine.step()
    opt = engine.sharded_optimizer.backend
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in opt.master_shards)
    assert all(g.device.type == "cpu" for g in engine.params.grads.grad_shards)
    assert all(s.device.type == "cpu" for s in engine.params.param_shards)
    # 12 bytes per element of fp32 master + Adam moments, over one rank.
    assert engine.ledger.state_bytes["optimizer_states"] == 12 * psi + 4  # + Adam's fp32 step counters
