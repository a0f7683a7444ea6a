"""The host side of ZeRO-Offload's step (hf_zero/optim/host.py): how many threads the CPU Adam gets, and when the
updated chunks start back to the device."""
from __future__ import annotations

import logging
import os

import torch

import hf_zero
from hf_zero.optim import host
from hf_zero.optim.host import HostUpdate
from tests.helpers import batch, make_optimizer, simulated, tiny_model


def threads_seen_by_the_cpu_adam(monkeypatch, delayed: bool = False) -> list[int]:
    """One offloaded step of a tiny GPT-2 with torch on one thread, as torchrun leaves every process of a node
    shared by several (OMP_NUM_THREADS=1): the intra-op threads each chunk's CPU Adam ran on (`delayed`: in the
    background, from the first step)."""
    seen: list[int] = []
    real_step = host.adam_step_with_state

    def recording_step(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(host, "adam_step_with_state", recording_step)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model("gpt2")
        engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "offload_optimizer": "cpu",
                                                                   "delayed_param_update": delayed,
                                                                   "delayed_param_update_warmup": 0})
        engine.backward(engine(**batch("gpt2", 0, 4)).loss)
        engine.step()
        engine.finish_pending_update()
        assert torch.get_num_threads() == 1  # given back after the step
    finally:
        torch.set_num_threads(before)
    assert seen
    return seen


def test_the_cpu_adam_runs_on_the_cores_shared_by_the_processes_of_the_node(monkeypatch, caplog):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("HF_ZERO_CPU_ADAM_THREADS", raising=False)
    for local_processes in (1, 2):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_processes))
        with caplog.at_level(logging.INFO, logger="hf_zero"):
            caplog.clear()
            seen = threads_seen_by_the_cpu_adam(monkeypatch)
        expected = max(1, cores // local_processes)
        assert set(seen) == {expected}
        assert f"CPU Adam on {expected} threads ({cores} cores / {local_processes} processes on this node)" \
            in caplog.text


def test_a_delayed_update_leaves_one_core_to_the_thread_that_drives_the_device(monkeypatch, caplog):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("HF_ZERO_CPU_ADAM_THREADS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        seen = threads_seen_by_the_cpu_adam(monkeypatch, delayed=True)
    assert set(seen) == {max(1, cores - 1)}
    assert f"CPU Adam on {max(1, cores - 1)} threads ({cores} cores / 1 processes on this node, less one" in caplog.text


def test_hf_zero_cpu_adam_threads_sets_the_cpu_adams_threads(monkeypatch, caplog):
    monkeypatch.setenv("HF_ZERO_CPU_ADAM_THREADS", "3")
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        assert set(threads_seen_by_the_cpu_adam(monkeypatch)) == {3}
    assert "CPU Adam on 3 threads (HF_ZERO_CPU_ADAM_THREADS)" in caplog.text


def test_hf_zero_cpu_adam_threads_sets_the_threads_of_any_offloaded_optimizers_step(monkeypatch, caplog):
    """An optimizer the C++ Adam does not step (SGD here) runs its own step() on the host masters: on as many
    threads, said in the log, not on torchrun's one."""
    monkeypatch.setenv("HF_ZERO_CPU_ADAM_THREADS", "3")
    seen: list[int] = []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    real_step = optimizer.step
    monkeypatch.setattr(optimizer, "step", lambda: (seen.append(torch.get_num_threads()), real_step()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO, logger="hf_zero"):
            update = HostUpdate(optimizer, [[torch.zeros(4)]], fp32_init=None, staged=False, chunks_lent=None)
            update.step(1.0, [[torch.full((4,), 0.5)]])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen == [3]
    assert "SGD.step() on 3 threads (HF_ZERO_CPU_ADAM_THREADS)" in caplog.text
    torch.testing.assert_close(update.masters[0][0], torch.full((4,), -0.05))  # SGD's step, as torch takes it


def test_each_updated_chunk_starts_back_to_the_device_as_soon_as_its_update_is_done(monkeypatch):
    """With the parameters on a device, chunk k's copy back is queued before chunk k+1's update runs, so
    the copies overlap the rest of the host step (not all of them after the last chunk's Adam)."""
    events: list[str] = []
    real_step, real_copy = host.HostAdam.step_chunk, host.copy_to_device

    def step_chunk(self, g, master, *args, **kwargs):
        events.append(f"update {master.numel()}")
        return real_step(self, g, master, *args, **kwargs)

    def copy_to_device(dst, src, name, overlap=False):
        events.append(f"copy {dst.numel()}")
        return real_copy(dst, src, name, overlap)

    monkeypatch.setattr(host.HostAdam, "step_chunk", step_chunk)
    monkeypatch.setattr(host, "copy_to_device", copy_to_device)
    chunks = [torch.zeros(n) for n in (3, 5, 7)]
    grads = [torch.full((n,), 0.5) for n in (3, 5, 7)]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    update = HostUpdate(optimizer, [chunks], fp32_init=None, staged=True, chunks_lent=None)
    update.step(1.0, [grads])
    update.publish()  # nothing left to queue
    assert events == ["update 3", "copy 3", "update 5", "copy 5", "update 7", "copy 7"]
    for k in range(3):
        update.outputs.writable(0, k)  # the copies have landed
    for chunk, expected in zip(chunks, torch_adamw_steps(grads, steps=1)):
        torch.testing.assert_close(chunk, expected, rtol=0, atol=1e-7)


def torch_adamw_steps(grads: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Parameters from zero after `steps` of torch's AdamW (lr 0.1) with the same gradients every step."""
    reference = [torch.zeros(g.numel(), requires_grad=True) for g in grads]
    torch_adamw = torch.optim.AdamW(reference, lr=0.1)
    for _ in range(steps):
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        torch_adamw.step()
    return [p.detach() for p in reference]


def test_a_delayed_update_writes_each_chunk_once_its_own_copy_back_has_landed(monkeypatch):
    """A delayed update starts while the previous update's copies back are still on their way, and waits,
    before writing chunk k, for chunk k's copy only. Waiting for every copy first put the whole copy back (2.6 GB for
    the 1.31B GPT-2) in front of the host Adam, on the critical path of every step. Under the simulation "late" a copy
    lands only when waited on, and one written by the host before it landed is refused."""
    copies: list = []
    landed_when_updating: list[list[bool]] = []
    real_step, real_copy = host.HostAdam.step_chunk, host.copy_to_device

    def step_chunk(self, *args, **kwargs):
        landed_when_updating.append([copy.landed for copy in copies])
        return real_step(self, *args, **kwargs)

    def copy_to_device(dst, src, name, overlap=False):
        copies.append(real_copy(dst, src, name, overlap))
        return copies[-1]

    monkeypatch.setattr(host.HostAdam, "step_chunk", step_chunk)
    monkeypatch.setattr(host, "copy_to_device", copy_to_device)
    with simulated("late"):
        chunks = [torch.zeros(n) for n in (3, 5, 7)]
        grads = [torch.full((n,), 0.5) for n in (3, 5, 7)]
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        update = HostUpdate(optimizer, [chunks], fp32_init=None, staged=True, chunks_lent=None, delayed=True)
        update.step(1.0, [grads])
        update.publish()  # the first update's values leave for the device
        landed_when_updating.clear()
        update.step(1.0, [grads])
        assert landed_when_updating == [[True, False, False], [True, True, False], [True, True, True]]
        update.publish()
        for k in range(3):
            update.outputs.writable(0, k)
    for chunk, expected in zip(chunks, torch_adamw_steps(grads, steps=2)):
        torch.testing.assert_close(chunk, expected, rtol=0, atol=1e-7)


def test_a_delayed_update_reads_gradients_the_next_backward_does_not_write(monkeypatch):
    """The update running in the background during step i+1's backward keeps its gradient shards as they
    are, without a copy; that backward lands in the other set."""
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "offload_optimizer": "cpu",
                                                               "delayed_param_update": True,
                                                               "delayed_param_update_warmup": 0})
    backend = engine.sharded_optimizer.backend
    handed: list[list[list[torch.Tensor]]] = []
    real_step = backend.step
    monkeypatch.setattr(backend, "step",
                        lambda coef, grads, **kwargs: handed.append(grads) or real_step(coef, grads, **kwargs))
    sets = [{s.untyped_storage().data_ptr() for s in shards} for shards in engine.params.grads.shard_sets]
    for step in range(3):
        engine.backward(engine(**batch("gpt2", step, 4)).loss)
        landed_in = {s.untyped_storage().data_ptr() for s in engine.params.grads.grad_shards}
        engine.step()
        engine.sharded_optimizer.delayed.pending.result()  # the update has run (and recorded what it read)
        read_from = {g.untyped_storage().data_ptr() for grads in handed[-1] for g in grads}
        assert read_from == landed_in and read_from in sets  # the shards themselves, not a copy
        assert {s.untyped_storage().data_ptr() for s in engine.params.grads.grad_shards} != read_from
    engine.finish_pending_update()
