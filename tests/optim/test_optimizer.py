"""ShardedOptimizer (hf_zero/optim/optimizer.py): what every update backend shares."""
from __future__ import annotations

import math

import torch

import hf_zero
from tests.helpers import batch, make_optimizer, tiny_model


def test_the_gradient_norm_is_the_fp64_norm_of_the_reduced_gradients():
    """Summed in fp32, the squares of millions of elements drift by 1e-4 relative and move clipping; the
    reference is the same gradients' norm computed in fp64 from scratch."""
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "reduce_bucket_size": 3000})
    engine.backward(engine(**batch("gpt2", 0, 4)).loss)
    grads = torch.cat([g.reshape(-1) for grads in engine.sharded_optimizer.grad_chunks() for g in grads])
    expected = torch.linalg.vector_norm(grads.double()).item() / engine.scaler.scale
    norm = engine.compute_grad_norm()
    assert math.isclose(norm, expected, rel_tol=1e-13), (norm, expected)
