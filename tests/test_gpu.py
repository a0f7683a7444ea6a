"""The GPU path on a real accelerator: CUDA copies, streams and events, checked against the same references
as on CPU. Skipped without CUDA, and a skip here is never evidence: these run whenever a GPU machine is
lent (docs/BENCHMARKS.md records the device). On CPU the same paths are checked by hf_zero.device's
simulation of asynchronous copies (tests/test_device.py, and the offload tests under `copies`)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hf_zero
from tests.helpers import batch, make_optimizer, named_copy, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not evidence when skipped)")

CUDA = torch.device("cuda", 0)
OFFLOADS = [{"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
            {"zero_stage": 2, "offload_optimizer": "cpu"},
            {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
            {"zero_stage": 2, "offload_optimizer": "cpu", "delayed_param_update": True,
             "delayed_param_update_warmup": 100}]


def on_cuda(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in b.items()}


def plain_cuda_run(steps: int) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2").to(CUDA)
    optimizer = make_optimizer(model)
    for step in range(steps):
        model(**on_cuda(batch("gpt2", step, 8))).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return named_copy(model)


def engine_cuda_run(config: dict, steps: int) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2").to(CUDA)
    engine = hf_zero.initialize(model, make_optimizer(model), {"reduce_bucket_size": 3000, **config})
    for step in range(steps):
        engine.backward(engine(**on_cuda(batch("gpt2", step, 8))).loss)
        engine.step()
    with engine.gathered_parameters():
        return named_copy(model)


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert max((got[k].cpu() - expected[k].cpu()).abs().max().item() for k in expected) < 1e-5


@pytest.mark.parametrize("config", OFFLOADS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_stage_and_offload_trains_on_cuda_as_plain_torch_does(config):
    assert_close(engine_cuda_run(config, 4), plain_cuda_run(4))


def test_nvme_offload_trains_on_cuda_as_plain_torch_does(tmp_path):
    config = {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path)}
    assert_close(engine_cuda_run(config, 4), plain_cuda_run(4))


def test_a_save_holds_no_state_sized_device_memory(tmp_path):
    model = tiny_model("gpt2").to(CUDA)
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
    engine.backward(engine(**on_cuda(batch("gpt2", 0, 8))).loss)
    engine.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    states = 12 * sum(p.numel() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - before < 0.05 * states


def test_hf_zero_train_runs_on_the_gpu():
    done = subprocess.run([sys.executable, "-m", "hf_zero", "train", "--nproc_per_node", "1", "--max_steps", "30",
                           "--max_minutes", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_seeded_build_on_the_gpu_has_the_values_of_one_on_cpu_and_leaves_the_cuda_generator_alone():
    import model_zoo
    from hf_zero.construct import SeededInit, build_seeded

    on_cpu = {n: p.detach().clone() for n, p in build_seeded(lambda: model_zoo.build("gpt2-tiny"), 0)
              .named_parameters()}
    cuda_generator = torch.cuda.get_rng_state()
    with torch.device("meta"):
        model = model_zoo.build("gpt2-tiny")
    model.transformer.wpe.weight.requires_grad_(False)  # frozen: filled whole, beside the units
    engine = hf_zero.initialize(model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad),
                                {"zero_stage": 3}, init_from=SeededInit(0))
    assert torch.equal(torch.cuda.get_rng_state(), cuda_generator)
    assert model.transformer.wpe.weight.device.type == "cuda"
    with engine.gathered_parameters():
        assert all(torch.equal(p.detach().cpu(), on_cpu[n]) for n, p in model.named_parameters())
