"""The GPU path on a real accelerator: CUDA copies, streams and events, checked against the same references
as on CPU. Skipped without CUDA, and a skip here is never evidence: run them on a GPU machine
(docs/BENCHMARKS.md records the device of the last run). On CPU the same paths are checked by hf_zero.runtime.device's
simulation of asynchronous copies (tests/runtime/test_device.py, and the offload tests under `copies`)."""
from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Callable

import pytest
import torch

import hf_zero
from tests.helpers import (
    GPU_PATH_CONFIGS,
    batch,
    config_id,
    make_optimizer,
    named_copy,
    tiny_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not evidence when skipped)")

CUDA = torch.device("cuda", 0)


def on_cuda(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in b.items()}


def plain_cuda_run(steps: int, fused: bool = False, clip: float = 0.0) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2").to(CUDA)
    optimizer = make_optimizer(model, fused=fused)
    for step in range(steps):
        model(**on_cuda(batch("gpt2", step, 8))).loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return named_copy(model)


def engine_cuda_run(config: dict, steps: int, expect_comm_stream: bool = False) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2").to(CUDA)
    engine = hf_zero.initialize(model, make_optimizer(model), {"reduce_bucket_size": 3000, **config})
    # In a process group the reductions run on a CUDA stream of their own; without one, on the compute stream.
    assert (engine.params.grads.comm_stream.stream is not None) == expect_comm_stream
    for step in range(steps):
        engine.backward(engine(**on_cuda(batch("gpt2", step, 8))).loss)
        engine.step()
    with engine.gathered_parameters():
        return named_copy(model)


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert max((got[k].cpu() - expected[k].cpu()).abs().max().item() for k in expected) < 1e-5


@pytest.mark.parametrize("config", GPU_PATH_CONFIGS, ids=config_id)
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
    from hf_zero.zero.construct import SeededInit, build_seeded

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


@pytest.fixture
def one_rank_nccl_group():
    """A process group of one NCCL rank: the engine then runs its GPU collective path (the communication
    stream, NCCL's call shapes), which a process without a group never does."""
    import torch.distributed as dist

    from hf_zero.runtime.launch import free_port

    torch.cuda.set_device(CUDA)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("late", ["compute", "comm", "copy"])
@pytest.mark.parametrize("config", GPU_PATH_CONFIGS, ids=config_id)
def test_every_stage_trains_as_plain_torch_in_an_nccl_group_with_one_stream_far_behind(
        one_rank_nccl_group, monkeypatch, config, late):
    """Device sleeps (HF_ZERO_CUDA_DELAY) keep one side far behind: the compute stream (copies land late, backward
    writes its buckets late), the communication stream (reductions finish late) or the copy stream (a prefetched
    parameter shard arrives late). A missing wait, of a reduction on the compute stream, of the compute stream on
    a reduction or a copy, or of the host on a copy, then reads or writes a buffer too early and the weights
    differ from plain torch's."""
    from hf_zero.settings.environment import CUDA_DELAY_ENV

    monkeypatch.setenv(CUDA_DELAY_ENV, f"{late}:2000000")  # about a millisecond of an H100's clock each
    assert_close(engine_cuda_run(config, 4, expect_comm_stream=True), plain_cuda_run(4))


# Each block compiled with inductor (its CUDA kernels), the engine's hooks and streams around them.
COMPILED_CONFIGS = [{"zero_stage": 2, "compile": True}, {"zero_stage": 3, "compile": True},
                    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "compile": True}]


@pytest.mark.parametrize("late", ["compute", "comm", "copy"])
@pytest.mark.parametrize("config", COMPILED_CONFIGS, ids=config_id)
def test_compiled_blocks_train_as_plain_torch_in_an_nccl_group_with_one_stream_far_behind(
        one_rank_nccl_group, monkeypatch, config, late):
    """As the test above, with the blocks' forward and backward run by inductor's kernels: the engine's waits hold
    around compiled code too."""
    from hf_zero.settings.environment import CUDA_DELAY_ENV

    monkeypatch.setenv(CUDA_DELAY_ENV, f"{late}:2000000")
    torch._dynamo.reset()  # this configuration's graphs compiled anew (inductor's cache on disk keeps it quick)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # reset() leaves dynamo's counters
    assert_close(engine_cuda_run(config, 4, expect_comm_stream=True), plain_cuda_run(4))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the blocks ran compiled


def synchronisations(step: Callable[[], None]) -> int:
    """How many times `step` synchronised the host with the device (torch.cuda.set_sync_debug_mode's count)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("stage", [2, 3])
def test_with_the_fused_adamw_a_step_synchronises_no_more_than_plain_torchs_and_trains_as_it(one_rank_nccl_group,
                                                                                             monkeypatch, stage):
    """torch's fused AdamW with clipping: the device computes the clipping coefficient and skips a non-finite step
    itself, so from the second step a step synchronises the host with the device no more often than plain torch's
    step with clip_grad_norm_ (which never reads the norm back), with the compute stream far behind; and the weights
    are plain torch's."""
    from hf_zero.settings.environment import CUDA_DELAY_ENV

    monkeypatch.setenv(CUDA_DELAY_ENV, "compute:2000000")
    inputs = [on_cuda(batch("gpt2", step, 8)) for step in range(4)]
    plain = tiny_model("gpt2").to(CUDA)
    plain_optimizer = make_optimizer(plain, fused=True)
    model = tiny_model("gpt2").to(CUDA)
    engine = hf_zero.initialize(model, make_optimizer(model, fused=True),
                                {"zero_stage": stage, "reduce_bucket_size": 3000, "gradient_clipping": 0.05})

    def plain_step(b: dict[str, torch.Tensor]) -> None:
        plain(**b).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        plain_optimizer.step()
        plain_optimizer.zero_grad()

    def engine_step(b: dict[str, torch.Tensor]) -> None:
        engine.backward(engine(**b).loss)
        engine.step()

    counts = [(synchronisations(lambda: engine_step(b)), synchronisations(lambda: plain_step(b))) for b in inputs]
    assert all(ours <= theirs for ours, theirs in counts[1:]), counts
    assert engine.global_grad_norm > 0.05  # it clipped
    with engine.gathered_parameters():
        assert_close(named_copy(model), named_copy(plain))


MEDIUM_GPT2 = {"n_embd": 512, "n_head": 8, "n_layer": 8, "vocab_size": 1024}  # Ψ about 26M, 25 blocks' worth
INIT_OFFLOADS = [{"zero_stage": 2, "offload_optimizer": "cpu"},
                 {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                 {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}]


@pytest.mark.parametrize("config", INIT_OFFLOADS, ids=["s2_cpu", "s3_cpu", "s3_nvme"])
def test_initialize_with_offload_holds_no_fp32_states_on_the_device(config, tmp_path):
    """ZeRO-Offload's promise from the start: with the optimizer offloaded, `initialize` allocates on the device
    no more than the bf16 parameters (2Ψ at stage 2, where every rank holds them whole; a shard at stage 3)
    plus its buffers: the fp32 start values are never staged on the device (that would be 6Ψ at stage 2 and 8Ψ
    at stage 3 on top)."""
    import model_zoo
    from hf_zero.zero.construct import SeededInit

    stage3 = config["zero_stage"] == 3
    with torch.device("meta" if stage3 else CUDA):
        model = model_zoo.build("gpt2-xl", **MEDIUM_GPT2)
    psi = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()),
                                {**config, "dtype": "bf16", "reduce_bucket_size": 1_000_000,
                                 **({"nvme_path": str(tmp_path)} if "nvme" in config.values() else {})},
                                init_from=SeededInit(0) if stage3 else None)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - before
    assert allocated <= 2 * psi + 16 * 2**20, f"initialize allocated {allocated / 2**20:.0f} MiB, Ψ = {psi}"
    engine.backward(engine(input_ids=torch.zeros(2, 16, dtype=torch.long, device=CUDA),
                           labels=torch.zeros(2, 16, dtype=torch.long, device=CUDA)).loss)
    engine.step()  # and it trains


def test_a_save_leaves_no_host_memory_pinned(tmp_path):
    """A save's pieces go through ordinary host memory: pinned, the caching host allocator keeps them page-locked
    for the rest of the run (seen on an H100: 23.5 GiB after one save of a 1.3B model at stage 2)."""
    from hf_zero.runtime.device import pinned_host_bytes

    model = tiny_model("gpt2").to(CUDA)
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
    engine.backward(engine(**on_cuda(batch("gpt2", 0, 8))).loss)
    engine.step()
    before = pinned_host_bytes()[0]
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert pinned_host_bytes()[0] == before


def test_buffers_kept_for_good_are_page_locked_to_the_byte_and_a_copy_into_them_leaves_the_host_free():
    """The offloaded gradient shards, the staged parameters and the units' offloaded parameters are locked
    where they lie, not taken from the caching host allocator (which rounded a 2.6 GB shard up to 4 GiB on an H200).
    Locked they must really be: a copy from the device into pageable memory makes the host wait for the device's
    queue, one into page-locked memory does not."""
    import gc

    from hf_zero.runtime.device import (
        copy_to_host,
        host_buffers_for_good,
        pinned_host_bytes,
    )

    gc.collect()
    allocator_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    before = pinned_host_bytes()[0]
    numels = [3 << 20, (5 << 20) + 7]
    buffers = host_buffers_for_good(numels, torch.bfloat16)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == allocator_before
    assert pinned_host_bytes()[0] - before == 2 * sum(numels)
    assert all(b.is_pinned() for b in buffers)
    source = torch.randn(numels[1], device=CUDA).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of device time queued ahead of the copy
    copy = copy_to_host(buffers[1], source, "a copy into a buffer kept for good")
    assert not copy.event.query()  # queued behind the sleep: the host did not wait for it
    copy.wait()
    assert torch.equal(buffers[1], source.cpu())
    del buffers, copy
    gc.collect()
    assert pinned_host_bytes()[0] == before
