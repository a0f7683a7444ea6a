"""Where the reduced gradients land (hf_zero/zero/grad_landing.py): one strategy per offload_optimizer, chosen
once, and the memory its shards hold around a step."""
from __future__ import annotations

import pytest

import hf_zero
from hf_zero.zero.grad_landing import DeviceShard, HostShard, NvmeFiles
from tests.helpers import batch, make_optimizer, tiny_model


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("offload, landing, held_after_backward, held_after_step", [
    ("none", DeviceShard, True, False),  # from the first landed chunk until the step has used them
    ("cpu", HostShard, True, True),  # pinned host memory for good
    ("nvme", NvmeFiles, False, False),  # never: the chunks go to the files
])
def test_offload_optimizer_chooses_where_the_reduced_gradients_land(tmp_path, stage, offload, landing,
                                                                     held_after_backward, held_after_step):
    model = tiny_model("gpt2")
    files = {"nvme_path": str(tmp_path)} if offload == "nvme" else {}
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": stage, "offload_optimizer": offload,
                                                               **files})
    grads = engine.params.grads
    assert type(grads.landing) is landing
    engine.backward(engine(**batch("gpt2", 0, 4)).loss)
    assert (grads.held_bytes() > 0) == held_after_backward
    engine.step()
    assert (grads.held_bytes() > 0) == held_after_step
