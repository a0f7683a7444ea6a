"""The ledger counts what the paper counts: 2Ψ per step for stages 0-2, 3Ψ for stage 3, and
model-state bytes per rank equal to the paper's formulas, within padding. The Communicator's collectives equal
torch's, a handle polled under a profiler never deadlocks, and one rank's work longer than the collective timeout
reaches every rank."""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hf_zero.runtime.comm import GLOO_WHOLE_BYTES, Communicator
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.runtime.ledger import Ledger
from hf_zero.runtime.memory import communication_elements, model_state_bytes
from hf_zero.settings.environment import COLLECTIVE_TIMEOUT_ENV

NORM_ALL_REDUCE = 2  # the global gradient norm: one scalar all-reduce, counted 2 x 1 element


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_per_step_is_2psi_for_stages_0_to_2_and_3psi_for_stage_3(world2, stage):
    for rank_result in world2:
        r = rank_result[f"s{stage}_gpt2"]
        sent = r["comm_elements"]
        bulk = sent.get("reduce_scatter", 0) + sent.get("all_gather", 0)
        if stage == 0:
            assert sent == {"all_reduce": 2 * r["psi"]}
            continue
        assert sent["all_reduce"] == NORM_ALL_REDUCE
        expected = communication_elements(stage, r["psi"]) - r["root_numel"]
        passes = 3 if stage == 3 else 2
        assert expected <= bulk <= expected + passes * r["padding"]
        if stage == 3:
            # The root unit stays gathered from forward into backward: gathered once, not twice.
            assert 0 < r["root_numel"] < r["psi"]
            assert 2 * r["psi"] - r["root_numel"] <= sent["all_gather"] <= 2 * r["psi"] - r["root_numel"] + 2 * r["padding"]


@pytest.mark.slow
def test_stage3_with_the_papers_schedule_moves_exactly_3psi(world2):
    for rank_result in world2:
        r = rank_result["s3_paper_schedule_gpt2"]
        sent = r["comm_elements"]
        assert 2 * r["psi"] <= sent["all_gather"] <= 2 * r["psi"] + 2 * r["padding"], "every unit gathered twice"
        assert r["psi"] <= sent["reduce_scatter"] <= r["psi"] + r["padding"]


STATE_RUNS = [("world2", f"s{stage}_gpt2", stage, "fp32") for stage in (0, 1, 2, 3)] + \
    [("world4", f"s{stage}_gpt2", stage, "fp32") for stage in (1, 2, 3)] + \
    [("world2", f"s{stage}_bf16", stage, "bf16") for stage in (0, 1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("world, name, stage, dtype", STATE_RUNS)
def test_model_state_bytes_per_rank_follow_the_paper(request, world, name, stage, dtype):
    results = request.getfixturevalue(world)
    for rank_result in results:
        r = rank_result[name]
        formula = model_state_bytes(stage, r["psi"], len(results), dtype)
        slack = 16 * r["padding"] + 8 * r["optimizer_tensors"]  # padding elements, Adam's step counters
        for category, expected in formula.items():
            assert abs(r["state_bytes"][category] - expected) <= slack, (category, r["state_bytes"])


def test_paper_figure1_example_7_5b_on_64_gpus():
    """Figure 1: Ψ=7.5B, Nd=64, K=12 gives 120, 31.4, 16.6 and 1.9 GB per device."""
    gb = [sum(model_state_bytes(s, int(7.5e9), 64, "bf16").values()) / 1e9 for s in (0, 1, 2, 3)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.875], abs=0.05)


def test_single_process_collectives_are_local_and_count_nothing():
    ledger = Ledger()
    comm = Communicator(ledger)
    full, part = torch.zeros(4), torch.arange(4.0)
    comm.all_gather_(full, part)
    comm.reduce_scatter_(part, torch.ones(4))
    ledger.close_step()
    assert torch.equal(full, torch.arange(4.0)) and torch.equal(part, torch.ones(4))
    assert ledger.last_step_elements == {}


UNIT = 12_582_912  # elements: a 48 MiB fp32 stage-3 unit, as on the 311M memory workload; divisible by 3


def sizes_and_thresholds(world: int) -> list[tuple[int, int]]:
    """(fp32 elements, Communicator.pieces_above_bytes) of each collective checked: a few elements at gloo's
    threshold and at 0, then the most elements (a multiple of `world`) within the threshold, and one row more."""
    most = world * (GLOO_WHOLE_BYTES // 4 // world)
    return [(12, GLOO_WHOLE_BYTES), (12, 0), (most, GLOO_WHOLE_BYTES), (most + world, GLOO_WHOLE_BYTES)]


def collectives_on_gloo() -> dict:
    """Communicator's all-gather and reduce-scatter beside torch's own single calls on the same inputs, in
    place and not, waited at once or later, as single gloo calls and in per-rank pieces, with the all-gather and
    reduce-scatter launches each path counts; and the peak RSS each adds for one unit-sized collective, its second (in
    a process of the session's world, its heap as earlier work left it, the first reduce-scatter over 3 ranks once
    grew it by 6 MiB)."""
    import torch.distributed as dist

    from hf_zero.runtime.memory import current_rss, peak_rss, reset_peak_rss

    comm, rank, world = Communicator(Ledger()), dist.get_rank(), dist.get_world_size()
    results, launches = {}, {}
    # 12 elements and the most the threshold allows take gloo's single calls, and per-rank pieces with the threshold
    # at 0; one more row of elements, pieces
    for numel, pieces_above in sizes_and_thresholds(world):
        comm.pieces_above_bytes = pieces_above
        n = numel // world
        values = torch.arange(float(numel)) * (rank + 1)
        shard = values[rank * n:(rank + 1) * n].clone()
        expected_gather, expected_reduced = torch.empty(numel), torch.empty(n)
        dist.all_gather_single(expected_gather, shard)
        dist.reduce_scatter_single(expected_reduced, values.clone())
        for async_op in (False, True):
            gathered, in_place = torch.zeros(numel), torch.zeros(numel)
            in_place[rank * n:(rank + 1) * n] = shard
            comm.ledger.close_step()
            works = [comm.all_gather_(gathered, shard, async_op),
                     comm.all_gather_(in_place, in_place[rank * n:(rank + 1) * n], async_op)]
            summed, aliased = torch.empty(n), values.clone()
            works += [comm.reduce_scatter_(summed, values.clone(), async_op),
                      comm.reduce_scatter_(aliased[rank * n:(rank + 1) * n], aliased, async_op)]
            for work in works if async_op else []:
                work.wait()
            comm.ledger.close_step()
            launches[numel, pieces_above] = (comm.ledger.last_step_events["all-gather launches"],
                                             comm.ledger.last_step_events["reduce-scatter launches"])
            results[numel, pieces_above, async_op] = \
                all(torch.equal(t, expected_gather) for t in (gathered, in_place)) and \
                all(torch.equal(t, expected_reduced) for t in (summed, aliased[rank * n:(rank + 1) * n]))
    comm.pieces_above_bytes = GLOO_WHOLE_BYTES
    growth = {}
    output, source = torch.zeros(UNIT), torch.ones(UNIT)
    # Ours first: a temporary torch's calls free raises glibc's mmap threshold to its size, after which one of that
    # size would come from the heap's pages already resident.
    for name, run in [("ours", lambda: comm.all_gather_(output, output[:UNIT // world])),
                      ("ours_reduce", lambda: comm.reduce_scatter_(source[:UNIT // world], source)),
                      ("torch", lambda: dist.all_gather_single(output, output[:UNIT // world].clone())),
                      ("torch_reduce", lambda: dist.reduce_scatter_single(torch.empty(UNIT // world), source))]:
        run()  # once before: what a process sets up once (gloo's buffers, an arena for its thread) is not per call
        dist.barrier()
        reset_peak_rss()
        before = current_rss()
        run()
        growth[name] = peak_rss() - before
    return {"equal": results, "launches": launches, "growth": growth}


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_equal_torchs_and_copy_no_unit_sized_temporary(world):
    from hf_zero.runtime.launch import spawn_gloo

    unit_bytes = UNIT * 4
    for result in spawn_gloo(collectives_on_gloo, world):
        assert all(result["equal"].values()) and len(result["equal"]) == 8, result["equal"]
        # two all-gathers and two reduce-scatters: one call each while small, one per rank each in pieces
        single, pieces, most, more = sizes_and_thresholds(world)
        assert result["launches"] == {single: (2, 2), most: (2, 2), pieces: (2 * world, 2 * world),
                                      more: (2 * world, 2 * world)}
        growth = result["growth"]
        assert growth["torch"] > 0.5 * unit_bytes and growth["torch_reduce"] > 0.5 * unit_bytes  # why we avoid them
        assert growth["ours"] < 0.1 * unit_bytes and growth["ours_reduce"] < 0.1 * unit_bytes


def small_gathers_of_two_dtypes_on_gloo() -> dict:
    """A gather of two tensors of two dtypes (qwZ's int8 values and fp32 scales) below gloo's threshold, waited at
    once and later, beside torch's own all_gather_single of each; and the launches it counted."""
    import torch.distributed as dist

    comm, rank, world = Communicator(Ledger()), dist.get_rank(), dist.get_world_size()
    inputs = [torch.arange(6, dtype=torch.int8) * (rank + 1), torch.arange(3.0) / (rank + 1)]
    expected = [torch.empty(world * t.numel(), dtype=t.dtype) for t in inputs]
    for output, input in zip(expected, inputs):
        dist.all_gather_single(output, input)
    equal, launches = [], []
    for async_op in (False, True):
        outputs = [torch.zeros_like(t) for t in expected]
        comm.ledger.close_step()
        work = comm.all_gather_coalesced_(outputs, inputs, async_op)
        if async_op:
            work.wait()
        comm.ledger.close_step()
        launches.append(comm.ledger.last_step_events["all-gather launches"])
        equal.append(all(torch.equal(o, e) for o, e in zip(outputs, expected)))
    return {"equal": equal, "launches": launches}


def test_a_small_gather_of_two_dtypes_on_gloo_is_one_call_per_tensor_equal_to_torchs():
    """gloo's own grouped all-gather (torch's coalescing manager) returned two dtypes wrong, and the suite's two
    aborts were in runs that used it: on gloo each tensor is its own all-gather call."""
    from hf_zero.runtime.launch import spawn_gloo

    for result in spawn_gloo(small_gathers_of_two_dtypes_on_gloo, 2):
        assert result["equal"] == [True, True]  # (False with the grouped call)
        assert result["launches"] == [2, 2]


def polled_under_a_profiler_in_saved_tensor_hooks(rounds: int) -> list[bool]:
    """Each round all-reduces and all-gathers through the Communicator, polling each handle's is_completed() in a
    tight loop, as the reducer polls its buckets', under a profiler and inside saved-tensor hooks, as a profiled
    stage-3 forward runs (its hooks count the root's saves). Whether each round's sum and gather are right."""
    import torch.distributed as dist

    comm, rank, world = Communicator(Ledger()), dist.get_rank(), dist.get_world_size()
    right = []
    with profile(activities=[ProfilerActivity.CPU]), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for turn in range(rounds):
            summed, gathered = torch.full((1000,), float(rank + turn)), torch.zeros(2 * world)
            for handle in (comm.all_reduce_(summed, async_op=True),
                           comm.all_gather_(gathered, torch.tensor([rank, turn], dtype=torch.float), async_op=True)):
                while not handle.is_completed():
                    pass
                handle.wait()
            expected_gather = torch.tensor([[r, turn] for r in range(world)], dtype=torch.float).flatten()
            right.append(bool((summed == sum(r + turn for r in range(world))).all())
                         and torch.equal(gathered, expected_gather))
    return right


def test_a_collective_polled_under_a_profiler_completes(monkeypatch):
    """torch's Work.is_completed() waits for the work's lock holding the GIL, and under a profiler gloo's thread
    holds that lock while it waits for the GIL, in saved-tensor hooks: polled with it, a rank hangs in the first
    round and its partner's collective times out. sequence_check.has_finished reads the work's future instead."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "20")
    assert spawn_gloo(polled_under_a_profiler_in_saved_tensor_hooks, 2, 5) == [[True] * 5] * 2


def sends_by_hand(op: str, nbytes: int, ranks: list[int]) -> list[tuple[int, int, int]]:
    """(sender, receiver, bytes) of every send the collective makes, step by step: a ring in rank order passes
    one chunk of p per rank and step, p - 1 steps for an all-gather or a reduce-scatter and twice that for an
    all-reduce; an all-to-all sends each rank's part for every other rank straight to it."""
    p, chunk = len(ranks), nbytes // len(ranks)
    if op == "all_to_all":
        return [(a, b, chunk) for a in ranks for b in ranks if a != b]
    steps = (p - 1) * (2 if op == "all_reduce" else 1)
    return [(ranks[i], ranks[(i + 1) % p], chunk) for _ in range(steps) for i in range(p)]


@pytest.mark.parametrize("per_node,world", [(2, 4), (4, 8)])  # 2 nodes x 2, 2 nodes x 4
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_the_ledger_counts_each_ranks_sends_by_where_they_cross_and_each_nodes_volume_as_the_paper(
        op, per_node, world):
    from hf_zero.runtime.ledger import link_bytes

    node = lambda r: r // per_node  # noqa: E731
    nbytes = 8 * 3 * world  # a buffer of 3 fp64 elements per rank
    groups = [list(range(world)),  # the world, as stage 3's
              *[list(range(local, world, per_node)) for local in range(per_node)],  # one rank per node: across
              list(range(per_node))]  # one node
    for ranks in groups:
        sends = sends_by_hand(op, nbytes, ranks)
        crossing = any(node(r) != node(ranks[0]) for r in ranks)
        for node_id in {node(r) for r in ranks}:
            volume = 0
            for me in (r for r in ranks if node(r) == node_id):
                sent, paper = link_bytes(op, nbytes, ranks, me, per_node)
                mine = [(b, n) for a, b, n in sends if a == me]
                assert sent.get("inter-node", 0) == sum(n for b, n in mine if node(b) != node(me)), (ranks, me)
                assert sent.get("intra-node", 0) == sum(n for b, n in mine if node(b) == node(me)), (ranks, me)
                volume += paper
            # The paper: a flat collective's whole buffer crosses each node's boundary once (an all-reduce
            # twice); an all-to-all, each of the node's ranks' whole input.
            ranks_here = sum(node(r) == node_id for r in ranks)
            expected = {"all_to_all": ranks_here * nbytes, "all_reduce": 2 * nbytes}.get(op, nbytes)
            assert volume == (expected if crossing else 0), (ranks, node_id)
    # The example: a ring all-gather over 2 nodes x 2 carries 3/8 of its output per rank across nodes.
    if (op, per_node, world) == ("all_gather", 2, 4):
        assert sum(link_bytes(op, nbytes, groups[0], r, 2)[0].get("inter-node", 0) for r in range(4)) / 4 == \
            nbytes * 3 / 8


def bytes_by_span(ranks_per_node: int) -> dict:
    """4 ranks: a stage-3 step, and a stage-2 step on a tp 2 x dp 2 mesh, with `ranks_per_node` to a node."""
    import hf_zero
    from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh
    from hf_zero.settings.config import ZeroConfigError
    from tests.helpers import batch, make_optimizer, tiny_model

    results = {}
    for name, tp in (("stage3", 1), ("tp2_stage2", 2)):
        model = tiny_model("gpt2-tp" if tp > 1 else "gpt2")
        mesh = None
        if tp > 1:
            mesh = init_mesh(tp)
            apply_tensor_parallel(model, mesh["tp"])
        engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3 if tp == 1 else 2,
                                                                   "ranks_per_node": ranks_per_node}, mesh=mesh)
        if engine.tp_comm is not None:  # the tp group's collectives in a ledger of their own
            engine.tp_comm.ledger = Ledger()
        dp = engine.comm.world_size
        b = {k: v.chunk(dp)[engine.comm.rank] for k, v in batch("gpt2", 0, 8).items()}
        engine.backward(engine(**b).loss)
        engine.step()
        results[name] = {"ops": engine.ledger.last_step_bytes, "spans": engine.ledger.last_step_span_bytes,
                         "paper": engine.ledger.last_step_paper_cross_node_bytes, "report": engine.ledger.report()}
        if engine.tp_comm is not None:
            results[name].update(tp_ops=dict(engine.tp_comm.ledger.comm_bytes),
                                 tp_spans={k: n for k, n in engine.tp_comm.ledger.span_bytes.items() if n})
    try:
        model = tiny_model("gpt2")
        hf_zero.initialize(model, make_optimizer(model), {"ranks_per_node": 3})
        results["refused"] = "no error"
    except ZeroConfigError as error:
        results["refused"] = str(error)
    return results


@pytest.mark.slow
def test_the_ledger_splits_each_steps_bytes_into_intra_node_and_inter_node_by_where_each_rank_sends():
    """4 ranks as 2 nodes x 2 (consecutive ranks share a node, as torchrun places them), and as one node."""
    from hf_zero.runtime.launch import spawn_gloo

    for per_node in (2, 4):
        for rank, r in enumerate(spawn_gloo(bytes_by_span, 4, per_node)):
            # Stage 3's group is the world, a ring 0 -> 1 -> 2 -> 3 -> 0: each rank sends 3/4 of every buffer to
            # the next; on two nodes ranks 1 and 3 send across, and count the whole buffer for their node.
            total = sum(r["stage3"]["ops"].values())
            crossing = "inter-node" if per_node == 2 and rank % 2 else "intra-node"
            assert total > 0 and r["stage3"]["spans"] == {crossing: total * 3 // 4}
            assert r["stage3"]["paper"] == (total if crossing == "inter-node" else 0)
            # tp 2 x dp 2: a dp group is ranks {0, 2} or {1, 3}, on two nodes of two, one node of four; a tp
            # group is ranks {0, 1} or {2, 3}, on one node either way. Rings of two: half of each buffer.
            total = sum(r["tp2_stage2"]["ops"].values())
            crossing = "inter-node" if per_node == 2 else "intra-node"
            assert total > 0 and r["tp2_stage2"]["spans"] == {crossing: total // 2}
            assert r["tp2_stage2"]["paper"] == (total if crossing == "inter-node" else 0)
            tp_total = sum(r["tp2_stage2"]["tp_ops"].values())
            assert tp_total > 0 and r["tp2_stage2"]["tp_spans"] == {"intra-node": tp_total // 2}
            assert f"{crossing} {total / 2 / 2**20:.2f} MiB" in r["tp2_stage2"]["report"]
            assert "ranks_per_node must divide the world size 4 (ranks fill nodes in order); got 3" in r["refused"]


def rank_0_works_alone(seconds: float, fails: bool, limit: float | None = None) -> Any:
    """Rank 0 works `seconds`, then returns what it found or raises, or runs past `limit`; every rank returns what
    reached it."""
    comm = Communicator(Ledger())

    def work() -> dict[str, Any]:
        time.sleep(seconds)
        if fails:
            raise ValueError("no setting fits")
        return {"found_by": comm.rank, "after": seconds}

    try:
        return comm.from_rank_0(work, "planning", LookupError, limit=limit)
    except LookupError as e:
        return str(e)


def test_rank_0s_work_longer_than_the_collective_timeout_reaches_every_rank(monkeypatch):
    """The other ranks wait for rank 0's work (a plan) in collectives that each end long before the timeout, as a
    single all-gather after the work would not: rank 1 would fail in it after 3 s. Its error, or its running past
    its limit, is raised on every rank."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "3")
    assert spawn_gloo(rank_0_works_alone, 2, 5.0, False) == [{"found_by": 0, "after": 5.0}] * 2
    failed = "planning failed on rank 0: ValueError: no setting fits"
    assert spawn_gloo(rank_0_works_alone, 3, 0.0, True) == [failed] * 3
    stopped = "planning failed on rank 0: TimeoutError: took longer than 1 s"
    assert spawn_gloo(rank_0_works_alone, 2, 60.0, False, 1.0) == [stopped] * 2
