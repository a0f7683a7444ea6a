"""hf_zero.runtime.device: the simulation of a GPU's asynchronous copies behaves as CUDA's copy engine would at its
most unlucky, and catches the host touching a buffer that a queued copy still uses."""
from __future__ import annotations

import contextlib

import pytest
import torch

from hf_zero.runtime import device, pinned
from hf_zero.runtime.device import (
    LatestCopy,
    bytes_of,
    copy_to_device,
    copy_to_host,
    to_device,
    to_host,
)
from hf_zero.settings.environment import SIMULATE_ENV, SIMULATION_MODES
from hf_zero.testing import simulated_gpu
from hf_zero.testing.simulated_gpu import COMM, COPY, PendingCopyError


@pytest.fixture
def simulated(monkeypatch):
    """The simulation "late" as a run gets it: the simulated GPU installs itself at the first device work, with
    the stream checker."""
    monkeypatch.setenv(SIMULATE_ENV, "1")
    yield
    simulated_gpu.engine.queued.clear()


@pytest.fixture
def copy_engine(monkeypatch):
    """The simulation "late" without the stream checker: these tests read a destination before its wait to see what
    the copy engine left there (poison), which the checker refuses as any unordered read."""
    monkeypatch.setenv(SIMULATE_ENV, "1")
    simulated_gpu.install(check_order=False)
    yield
    simulated_gpu.uninstall()
    simulated_gpu.engine.queued.clear()


def test_a_copy_to_the_device_keeps_its_source_lent_until_waited_on(copy_engine):
    host = torch.arange(4.0)
    on_device, copy = to_device(host, torch.device("cpu"), "the test buffer")
    assert on_device.data_ptr() != host.data_ptr() and torch.equal(on_device, host)  # device work sees it
    with pytest.raises(PendingCopyError, match="the host writes the test buffer while a queued copy still reads"):
        bytes_of(host, writing=True)  # file I/O refilling the buffer: defect 2's shape
    bytes_of(host, writing=False)  # reading a copy's source is fine
    copy.wait()
    bytes_of(host, writing=True)


def test_a_torch_write_into_a_lent_source_is_caught_when_the_copy_is_waited_on(copy_engine):
    host = torch.zeros(3)
    _, copy = to_device(host, torch.device("cpu"), "the staged outputs")
    host.add_(1)
    with pytest.raises(PendingCopyError, match="the staged outputs was written by the host while a queued copy"):
        copy.wait()


def test_a_copy_to_the_host_lands_the_values_the_source_had_when_it_was_queued(copy_engine):
    src = torch.arange(5.0)
    dst, copy = to_host(src, "the checkpoint piece")
    assert dst.isnan().all()  # not landed: what a read would see on a GPU is unspecified
    with pytest.raises(PendingCopyError, match="the host reads the checkpoint piece while a queued copy still will"):
        bytes_of(dst, writing=False)
    src.fill_(-1)  # later device work on the source is ordered after the copy
    copy.wait()
    assert torch.equal(dst, torch.arange(5.0))


def test_waiting_on_a_copy_lands_every_copy_queued_before_it_and_not_after(copy_engine):
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    first = copy_to_host(a, torch.ones(2), "a")
    second = copy_to_host(b, torch.full((2,), 2.0), "b")
    third = copy_to_host(c, torch.full((2,), 3.0), "c")
    latest = LatestCopy()
    latest.add(first)
    latest.add(second)
    latest.wait()
    assert a.tolist() == [1, 1] and b.tolist() == [2, 2] and c.isnan().all()
    assert first.landed and second.landed and not third.landed
    third.wait()
    assert c.tolist() == [3, 3]


def test_a_later_copy_over_the_same_host_buffer_is_ordered_after_the_earlier_one(copy_engine):
    """Device work is stream-ordered: a copy to the device out of a buffer a copy to the host is still filling
    reads the filled values, as an offloaded activation checkpoint is brought back."""
    kept = torch.zeros(3)
    copy_to_host(kept, torch.tensor([1.0, 2.0, 3.0]), "kept activations")
    back, copy = to_device(kept, torch.device("cpu"), "kept activations")
    assert back.tolist() == [1, 2, 3]
    copy.wait()


def test_a_copy_on_the_copy_stream_reaches_the_device_only_when_a_stream_waits_on_it(copy_engine):
    """Compute queued after a copy on the copy stream does not wait for it: its destination holds poison until a
    stream waits on the copy (`ready`), and its source stays lent until the host does."""
    host = torch.arange(4.0)
    on_device, copy = to_device(host, torch.device("cpu"), "the host shard", overlap=True)
    assert on_device.isnan().all()
    copy.ready()
    assert torch.equal(on_device, host)
    with pytest.raises(PendingCopyError, match="the host writes the host shard while a queued copy still reads"):
        bytes_of(host, writing=True)
    copy.wait()
    bytes_of(host, writing=True)


def test_copies_on_two_streams_over_one_host_buffer_are_refused_unless_a_wait_orders_them(copy_engine):
    """A copy to the host on the copy stream and a copy out of the same host memory on the compute stream may
    run in either order on a GPU. On one stream they are ordered; a wait between them orders them too."""
    kept = torch.zeros(3)
    copy_to_host(kept, torch.tensor([1.0, 2.0, 3.0]), "an offloaded activation", overlap=True)
    with pytest.raises(PendingCopyError, match="on the compute stream while an offloaded activation, on the copy "
                                               "stream, still uses the same host memory"):
        to_device(kept, torch.device("cpu"), "the activation back")
    back, copy = to_device(kept, torch.device("cpu"), "the activation back", overlap=True)  # same stream: ordered
    copy.ready()
    assert back.tolist() == [1, 2, 3]
    copy.wait()
    staged = torch.ones(2)
    first = copy_to_device(torch.empty(2), staged, "staged values", overlap=True)
    copy_to_device(torch.empty(2), staged, "staged values again")  # two reads of one buffer do not race
    first.wait()


def test_a_reduction_whose_landing_copies_to_the_host_orders_that_copy_before_the_compute_streams_next(copy_engine):
    """What a reduction's landing copies runs on the communication stream; the compute stream's wait on the
    reduction orders its later copies after it, as `wait_event` does on a GPU."""
    landing = torch.zeros(2)
    stream = device.CommStream(torch.device("cpu"))
    landed: list[device.Copy] = []
    reduction = stream.submit(lambda: _Finished(), lambda: landed.append(
        copy_to_host(landing, torch.tensor([5.0, 6.0]), "a reduced chunk")))
    stream.wait(reduction)
    assert landed[0].stream == COMM and landing.isnan().all()
    back, copy = to_device(landing, torch.device("cpu"), "the chunk back")  # ordered by the wait: no error
    assert back.tolist() == [5, 6]


class _Finished:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def test_copies_that_overlap_compute_are_queued_on_the_copy_stream_and_the_rest_where_they_are_issued(
        simulated, monkeypatch):
    """A prefetched stage-3 shard's copy to the device and the activation checkpoints' copies to
    the host and back go on the copy stream, so that no compute waits behind them; a reduced gradient chunk's copy
    to the host goes with its reduction on the communication stream."""
    import hf_zero
    from tests.helpers import batch, make_optimizer, tiny_model

    streams: dict[str, set[str]] = {}
    queue = simulated_gpu.CopyEngine.queue

    def recorded(self, dst, src, name, to_device, stream):
        streams.setdefault(name.split(" of ")[0], set()).add(stream)
        return queue(self, dst, src, name, to_device, stream)

    monkeypatch.setattr(simulated_gpu.CopyEngine, "queue", recorded)
    for config in ({"zero_stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu", "cpu_checkpointing": True},
                   {"zero_stage": 2, "offload_optimizer": "cpu"}):
        model = tiny_model("gpt2")
        engine = hf_zero.initialize(model, make_optimizer(model), {**config, "dtype": "bf16"})
        engine.backward(engine(**batch("gpt2", 0, 4)).loss)
        engine.step()
    assert streams == {"the host shard": {COPY}, "an offloaded activation checkpoint": {COPY},
                       "the reduced gradient chunk": {COMM}}


def test_early_runs_every_copy_and_reduction_whole_the_moment_it_is_issued(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "early")
    dst, copy = to_host(torch.arange(3.0), "a checkpoint piece")
    assert dst.tolist() == [0, 1, 2] and copy.landed
    on_device, copy = to_device(torch.arange(3.0), torch.device("cpu"), "a shard", overlap=True)
    assert on_device.tolist() == [0, 1, 2]
    landed = []
    device.CommStream(torch.device("cpu")).submit(lambda: _Finished(), lambda: landed.append(True))
    assert landed == [True]  # a shard read or zeroed after the hand-over sees the reduction done


def test_an_unknown_simulation_mode_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "sometimes")
    with pytest.raises(ValueError, match="HF_ZERO_SIMULATE_ASYNC must be one of late, early"):
        simulated_gpu.simulating()


def collectives_under_simulation(mode: str) -> dict:
    """Each asynchronous collective of hf_zero.runtime.comm, on 2 ranks, with what it shows before and after its wait."""
    import os

    import torch.distributed as dist

    from hf_zero.runtime.comm import Communicator, Ledger
    os.environ[SIMULATE_ENV] = mode
    simulated_gpu.install(check_order=False)  # outputs are read before their waits, to see what they hold
    comm, me = Communicator(Ledger()), dist.get_rank()
    seen = {}
    values = torch.arange(4.0) + 10 * me
    reduce_out = torch.empty(2)
    work = comm.reduce_scatter_(reduce_out, values.clone(), async_op=True)
    seen["reduce_scatter"] = (reduce_out.clone(), work.wait() and reduce_out.clone())
    summed = values.clone()
    work = comm.all_reduce_(summed, async_op=True)
    seen["all_reduce"] = (summed.clone(), work.wait() and summed.clone())
    gathered = torch.empty(8)
    work = comm.all_gather_(gathered, values, async_op=True)
    seen["all_gather"] = (gathered.clone(), work.wait() and gathered.clone())
    exchanged = torch.empty(4)
    work = comm.all_to_all_(exchanged, values, async_op=True)
    seen["all_to_all"] = (exchanged.clone(), work.wait() and exchanged.clone())
    sent = values.clone()
    work = comm.all_gather_(torch.empty(8), sent, async_op=True)
    sent.add_(1)  # written before the wait: on a GPU the gather may not have read it yet
    try:
        work.wait()
        seen["input written"] = "not caught"
    except Exception as e:  # noqa: BLE001 (the message is what the test reads)
        seen["input written"] = str(e)
    return seen


@pytest.mark.parametrize("mode", SIMULATION_MODES)
def test_every_asynchronous_collective_delivers_at_its_wait_when_late_and_at_once_when_early(mode):
    from hf_zero.runtime.launch import spawn_gloo
    ranks = spawn_gloo(collectives_under_simulation, 2, mode)
    everyone = [torch.arange(4.0) + 10 * r for r in range(2)]
    expected = {"reduce_scatter": lambda r: (everyone[0] + everyone[1])[2 * r:2 * r + 2],
                "all_reduce": lambda r: everyone[0] + everyone[1],
                "all_gather": lambda r: torch.cat(everyone),
                "all_to_all": lambda r: torch.cat([everyone[0][2 * r:2 * r + 2], everyone[1][2 * r:2 * r + 2]])}
    for r, seen in enumerate(ranks):
        for op, result in expected.items():
            before, after = seen[op]
            assert torch.equal(after, result(r)), op
            assert before.isnan().all() if mode == "late" else torch.equal(before, result(r)), op
        if mode == "late":
            assert "an input was written while the collective could still read it" in seen["input written"]


def test_without_the_simulation_copies_on_cpu_are_immediate_and_make_no_copy_of_host_tensors(monkeypatch):
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    host = torch.arange(3.0)
    same, copy = to_device(host, torch.device("cpu"), "x")
    assert same is host and copy.landed
    dst = torch.zeros(3)
    assert copy_to_device(dst, host, "x").landed and torch.equal(dst, host)


def test_file_io_refuses_device_memory():
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match="file I/O reads host memory; got a tensor on meta"):
        bytes_of(meta, writing=False)


def test_file_io_takes_host_memory_only():
    """Defect 1's guard: ctypes would read a device address as a host one (on CUDA: garbage or a crash)."""
    with pytest.raises(ValueError, match="file I/O reads host memory; got a tensor on meta"):
        bytes_of(torch.empty(4, device="meta"), writing=False)


def _compute_device_beside_a_gpu() -> str:
    device.has_accelerator = lambda: True  # as on a GPU machine (this rank's module copy only)
    return str(device.compute_device())


@pytest.mark.slow
def test_gloo_ranks_compute_on_the_host_even_on_a_machine_with_a_gpu():
    """Seen on an H100 machine: local gloo ranks (tests, --use_cpu) built their models on the one GPU."""
    from hf_zero.runtime.launch import spawn_gloo

    assert spawn_gloo(_compute_device_beside_a_gpu, 2) == ["cpu", "cpu"]


def test_simulated_pinned_memory_cannot_be_resized_as_pinned_memory_cannot(copy_engine):
    """On a GPU, giving back a pinned shard by resizing its storage fails; the simulation's host buffers refuse it
    too, so that CPU tests meet it first."""
    host = device.host_empty(8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="not resizable"):
        host.untyped_storage().resize_(0)


PINNING_CONFIGS = [{"zero_stage": 2}, {"zero_stage": 2, "offload_optimizer": "cpu"},
                   {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}]


@pytest.mark.parametrize("config", PINNING_CONFIGS, ids=["s2", "s2_opt", "s3_opt_param"])
def test_only_buffers_that_copies_reuse_are_pinned_and_a_save_pins_nothing(simulated, tmp_path, config):
    """Seen on an H100 (docs/BENCHMARKS.md, GPT-2 1.3B, one rank): the offloaded fp32 masters were pinned
    (12.2 GiB page-locked, never copied to the device), and a stage-2 save left 23.5 GiB pinned for the rest of
    the run (its 12Ψ pieces in pinned buffers, kept by the caching host allocator). Against the formula: masters
    are 4 bytes a parameter, a save's pieces 12; what copies reuse is at most the bf16 parameters and, with the
    optimizer offloaded, the bf16 gradient shard the reduced chunks land in, 2 bytes each."""
    import gc

    import hf_zero
    from tests.helpers import batch, make_optimizer, tiny_model

    model = tiny_model("gpt2")
    psi = sum(p.numel() for p in model.parameters())
    gc.collect()  # what earlier tests pinned is let go now, not while this one counts
    start = device.pinned_host_bytes()[0]
    engine = hf_zero.initialize(model, make_optimizer(model), {**config, "dtype": "bf16"})
    engine.backward(engine(**batch("gpt2", 0, 4)).loss)
    engine.step()
    gc.collect()
    kept = device.pinned_host_bytes()[0] - start
    assert kept <= 4 * psi + 4096, f"{kept} bytes pinned after a step, for {psi} parameters"
    device.reset_pinned_peak()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    during_save = device.pinned_host_bytes()[1] - start - kept
    assert during_save < 0.01 * 12 * psi, f"a save pinned {during_save} bytes"


INIT_OFFLOADS = [{"zero_stage": 2, "offload_optimizer": "cpu"},
                 {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                 {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}]


def initialize_measured(config: dict, nvme: str) -> tuple[int, int]:
    """(peak bytes `initialize` allocated on the simulated device, Ψ) for a GPT-2 of 8 blocks, in bf16; at stage 3
    built on meta and filled unit by unit, as a large model is."""
    import model_zoo
    from hf_zero import initialize
    from hf_zero.zero.construct import SeededInit

    stage3 = config["zero_stage"] == 3
    with torch.device("meta" if stage3 else "cpu"):
        model = model_zoo.build("gpt2-xl", n_embd=128, n_head=4, n_layer=8, vocab_size=1024, n_positions=64)
    psi = sum(p.numel() for p in model.parameters())
    with simulated_gpu.DeviceMemory() as memory:
        initialize(model, torch.optim.AdamW(model.parameters()),
                   {**config, "dtype": "bf16", **({"nvme_path": nvme} if "nvme" in config.values() else {})},
                   init_from=SeededInit(0) if stage3 else None)
    return memory.peak, psi


@pytest.mark.parametrize("config", INIT_OFFLOADS, ids=["s2_cpu", "s3_cpu", "s3_nvme"])
def test_initialize_with_offload_allocates_on_the_device_only_the_bf16_parameters_it_holds(simulated, config,
                                                                                           tmp_path):
    """ZeRO-Offload's promise from the start, on the simulated device's budget (the GPU's own measure is
    tests/test_gpu.py's): with the optimizer offloaded, `initialize` allocates on the device the bf16 parameters
    the stage holds there (all of them at stage 2; at stage 3, with the parameters offloaded too, one unit at a
    time) and no fp32 state. Seen on an H100 before (docs/BENCHMARKS.md): 6Ψ at stage 2, 8Ψ at stage 3. Without
    offload the same budget sees the fp32 masters on the device: it counts what it should."""
    peak, psi = initialize_measured(config, str(tmp_path))
    bf16_on_device = 2 * psi if config["zero_stage"] == 2 else 2 * psi / 8  # stage 3: a block, an eighth of Ψ
    print(f"{config}: {peak / psi:.3f} bytes a parameter")
    assert peak <= 1.1 * bf16_on_device, f"initialize allocated {peak / psi:.2f} bytes a parameter on the device"
    kept_on_device = {"zero_stage": config["zero_stage"]}
    peak_without, _ = initialize_measured(kept_on_device, str(tmp_path))
    assert peak_without >= (2 + 4) * psi if config["zero_stage"] == 2 else 4 * psi


class RecordingCudart:
    """torch.cuda.cudart() as host_buffers_for_good calls it, recording what is page-locked and unlocked."""

    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes))
        return self.register_error

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address, 0))
        self.mapped_when_unlocked = mapped(address)
        return 0


def mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's memory mappings."""
    with open("/proc/self/maps") as maps:
        spans = (line.split()[0].split("-") for line in maps)
        return any(int(lo, 16) <= address < int(hi, 16) for lo, hi in spans)


def test_buffers_kept_for_good_are_page_locked_to_the_byte_until_their_last_view_is_gone(monkeypatch):
    """The buffers an offloaded run keeps (gradient shards, staged parameters) no longer come from the caching
    host allocator, which rounds each block up to a power of two (a 2.6 GB gradient shard took 4 GiB page-locked on
    an H200). One block of exactly their bytes is page-locked where it lies, and unlocked only once no tensor views it
    (a view still read by a copy must stay locked). tests/test_gpu.py checks the locking itself on CUDA."""
    import gc

    cudart = RecordingCudart()
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    monkeypatch.setattr(device, "_pins", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: cudart.calls.append(("synchronize", 0, 0)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the rank's GPU when locking
    monkeypatch.setattr(torch.cuda, "device", lambda index: cudart.calls.append(("on device", index, 0))
                        or contextlib.nullcontext())
    before = pinned.locked_bytes["now"]
    numels = [3, 1000, 5]
    buffers = device.host_buffers_for_good(numels, torch.bfloat16)
    assert [b.numel() for b in buffers] == numels and all(b.dtype == torch.bfloat16 for b in buffers)
    address = buffers[0].data_ptr()
    assert cudart.calls == [("register", address, 2 * sum(numels))]
    assert pinned.locked_bytes["now"] - before == 2 * sum(numels)
    kept = buffers[2][1:]  # a view of the last buffer alone keeps the whole block
    del buffers
    gc.collect()
    assert len(cudart.calls) == 1
    kept.fill_(1.0)
    del kept
    gc.collect()
    # On the rank's GPU whichever thread lets it go, once no copy is still moving it.
    assert cudart.calls[1:] == [("on device", 3, 0), ("synchronize", 0, 0), ("unregister", address, 0)]
    assert cudart.mapped_when_unlocked and not mapped(address)  # unlocked, then unmapped
    assert pinned.locked_bytes["now"] == before


def test_a_buffer_kept_for_good_that_cannot_be_page_locked_is_an_error_naming_the_limit(monkeypatch):
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    monkeypatch.setattr(device, "_pins", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: RecordingCudart(register_error=2))
    with pytest.raises(RuntimeError, match=r"page-locking 8 bytes of host memory failed \(CUDA error 2\).*ulimit -l"):
        device.host_buffers_for_good([2], torch.float32)
