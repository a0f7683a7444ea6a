"""Flat buffers: every element owned by exactly one rank, buckets of the configured size, params as views."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.zero.partition import FlatParamBuffer


def params(*shapes):
    torch.manual_seed(0)
    return [(f"p{i}", nn.Parameter(torch.randn(*s))) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_every_element_is_owned_by_exactly_one_shard(num_shards):
    flat = FlatParamBuffer(params((7, 5), (13,), (3, 3)), num_shards, torch.float32, bucket_numel=10)
    owners = torch.zeros(flat.padded_numel, dtype=torch.int64)
    for bucket in flat.buckets:
        assert bucket.numel % num_shards == 0
        for shard in range(num_shards):
            lo, hi = bucket.owned_range(shard)
            owners[lo:hi] += 1
    assert torch.all(owners == 1)
    assert flat.padded_numel - flat.numel < num_shards


def test_buckets_have_the_configured_size_and_params_may_straddle_them():
    flat = FlatParamBuffer(params((7, 5), (13,)), 2, torch.float32, bucket_numel=10)
    assert [b.numel for b in flat.buckets] == [10, 10, 10, 10, 8]
    straddling = [p for p in flat.pieces[3] if p.slice.name == "p0"]
    assert straddling and straddling[0].param_hi == 35  # p0's tail lands in bucket 3 with p1's head


def test_pack_and_bind_makes_params_views_of_one_buffer_with_their_values_and_zero_padding():
    named = params((4, 3), (5,))
    expected = torch.cat([p.detach().reshape(-1).clone() for _, p in named])
    flat = FlatParamBuffer(named, 4, torch.float32)
    flat.data.fill_(9.0)  # the buffer is allocated uninitialised
    flat.pack_and_bind()
    assert torch.equal(flat.data[:flat.numel], expected)
    assert flat.padded_numel == 20 and torch.equal(flat.data[flat.numel:], torch.zeros(3))
    named[1][1].data.add_(1)
    assert torch.equal(flat.data[12:17], expected[12:17] + 1), "parameters are views into the buffer"


def test_read_params_fills_a_chunk_and_pads_with_zero():
    named = params((3,))
    flat = FlatParamBuffer(named, 4, torch.float32)
    out = torch.full((4,), 9.0)
    flat.read_params(0, 4, out)
    assert torch.equal(out[:3], named[0][1].detach()) and out[3] == 0
