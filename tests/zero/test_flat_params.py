"""Stages 1-2 share the updated chunks after the step in few launches: buckets grouped up to
allgather_bucket_size elements per launch (one NCCL group each), with the same result as one process.
Stage 3 gathers each unit (one flat buffer per param group) in one launch."""
from __future__ import annotations

import pytest
import torch

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from tests.conftest import SMALL_BUCKETS
from tests.helpers import (
    Scenario,
    batch,
    communicators_in_pieces_above,
    max_diff,
    named_copy,
    run_scenarios,
    tiny_model,
    train_single_process,
)

STEPS = 3


def greedy_groups(bucket_numels: list[int], limit: int) -> int:
    """How many launches packing buckets in order, each launch at most `limit` elements (at least one bucket)."""
    launches, filled = 0, limit
    for numel in bucket_numels:
        if filled + numel > limit:
            launches, filled = launches + 1, 0
        filled += numel
    return launches


def train_grouping(grouped_launches: bool) -> dict:
    """Stages 1 and 2 on 2 ranks; `grouped_launches` takes the path NCCL takes (one launch per group of buckets)
    instead of gloo's per-rank broadcasts."""
    with communicators_in_pieces_above(None if grouped_launches else 0):
        results = run_scenarios([Scenario(f"s{stage}", config={"zero_stage": stage, **SMALL_BUCKETS}, steps=STEPS)
                                 for stage in (1, 2, 3)])
    return {name: {"params": r["params"], "launches": r["events"].get("all-gather launches", 0),
                   "unit_gathers": r["events"].get("unit all-gathers", 0),
                   "bucket_numels": r["bucket_numels"]} for name, r in results.items()}


@pytest.mark.parametrize("grouped_launches", [True, False], ids=["nccl-style groups", "gloo pieces"])
def test_all_gathers_are_grouped_into_few_launches_and_match_one_process(grouped_launches):
    expected = train_single_process("gpt2", STEPS, 8)["params"]
    for rank_result in spawn_gloo(train_grouping, 2, grouped_launches):
        s3 = rank_result["s3"]
        assert max_diff(s3["params"], expected) < 1e-5
        if grouped_launches:
            assert s3["launches"] == s3["unit_gathers"] > 0  # a unit's two param groups in one launch
        for stage in (1, 2):
            r = rank_result[f"s{stage}"]
            assert max_diff(r["params"], expected) < 1e-5
            buckets = len(r["bucket_numels"])
            if grouped_launches:
                assert r["launches"] == greedy_groups(r["bucket_numels"], SMALL_BUCKETS["allgather_bucket_size"])
                assert r["launches"] < buckets
            else:
                assert r["launches"] == 2 * buckets  # one broadcast per rank and bucket


def test_left_unset_the_buckets_take_at_most_half_the_memory_the_rank_has_left(monkeypatch):
    """reduce_bucket_size and allgather_bucket_size unset: three gradient buckets (two reducing, one filling), and the
    all-gathers in flight, fit in half of what memory_left says the rank has; plenty leaves the defaults (one bucket
    for this small model). Cut smaller, the step is the same."""
    def trained(left: int) -> tuple[hf_zero.ZeroEngine, dict]:
        monkeypatch.setattr("hf_zero.runtime.memory.memory_left", lambda device, ranks: (left, "the test's figure"))
        model = tiny_model("gpt2")
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_stage": 2})
        for step in range(2):
            engine.backward(engine(**batch("gpt2", step, 4)).loss)
            engine.step()
        return engine, named_copy(model)

    plenty, plenty_weights = trained(10**12)
    little, little_weights = trained(48_000)  # 24,000 bytes to take: 6,000 fp32 elements
    assert [len(f.buckets) for f in plenty.params.flats] == [1]
    assert max(b.numel for f in little.params.flats for b in f.buckets) <= 6_000 // 3
    assert little.params.allgather_bucket_size == 6_000 and plenty.params.allgather_bucket_size == 50_000_000
    assert max_diff(plenty_weights, little_weights) == 0


def test_a_full_device_never_cuts_a_param_group_into_more_than_most_buckets(monkeypatch):
    """Nothing left (a model that will not fit): the budget would cut one element a bucket, a hang for a large
    model before its out-of-memory error; at most MOST_BUCKETS per param group instead."""
    from hf_zero.zero.flat_params import MOST_BUCKETS

    monkeypatch.setattr("hf_zero.runtime.memory.memory_left", lambda device, ranks: (0, "the test's figure"))
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"zero_stage": 2})
    assert all(1 < len(f.buckets) <= MOST_BUCKETS for f in engine.params.flats)
