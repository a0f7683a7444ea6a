"""ZeRO++ on stage 3 (hf_zero/zero/stage3/, hf_zero/zero/zeropp.py, hf_zero/ops/quantize.py).

qwZ: units are all-gathered as block-quantized int8 with fp32 scales, so the model computes forward and
backward with the dequantized weights while the fp32 masters take the update. The reference is one process
on the global batch doing exactly that by hand: each unit's weights cut into the ranks' chunks, each chunk
quantized and dequantized by the torch reference, the gradient taken there and applied to the exact masters
by torch's AdamW.

hpZ changes where the backward's weights come from, not their values: it must train bitwise as plain stage 3
does. qgZ's reduction is held to the paper's hierarchical all-to-all computed by hand in one process from
every rank's input, and in the engine to the exact gradient within quantization error. 4 ranks stand for
2 nodes x 2 throughout; the ledger's intra-node / inter-node bytes are the measure of each technique."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import hf_zero
from hf_zero.checkpoint.consolidate import consolidate
from hf_zero.ops.quantize import (
    dequantize_reference,
    quantize_reference,
    quantized_bytes,
)
from hf_zero.runtime.comm import SPANS, Communicator, Ledger
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.zero.zeropp import QuantizedReduceScatter
from tests.checkpoint_helpers import SAVE_AT, STOP, new_engine, train, whole_params
from tests.engine.test_engine import FP32_TOL
from tests.helpers import batch, local_part, make_optimizer, named_copy, tiny_model

STEPS, GLOBAL_BATCH, BLOCK, WORLD = 3, 8, 64, 2


def qwz_run(config: dict, single_calls: bool = False) -> dict:
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3, **config})
    for unit in engine.params.units:  # the collectives as NCCL issues them (one grouped call), on gloo, which
        # takes them too; else gloo's per-rank pieces, which it takes for units larger than this test's
        unit.comm.pieces_above_bytes = None if single_calls else 0
    # Each unit's flat buffer: its parameters' places in it, and the chunk each rank owns.
    layout = [{"chunk": flat.buckets[0].chunk_numel, "padded": flat.padded_numel,
               "slices": [(s.name, s.offset, s.numel) for s in flat.slices]}
              for unit in engine.params.units for flat in unit.flats]
    sent = []
    for step in range(STEPS):
        engine.backward(engine(**local_part(batch("gpt2", step, GLOBAL_BATCH), engine.comm.rank, WORLD)).loss)
        engine.step()
        sent.append(engine.ledger.last_step_bytes.get("all_gather", 0))
    with engine.gathered_parameters():
        return {"params": named_copy(model), "layout": layout, "all_gather_bytes": sent}


def quantized_like_the_ranks(model: torch.nn.Module, layout: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter as the ranks compute with it: its unit's buffer cut into chunks, each chunk
    block-quantized to int8 and back."""
    params, out = dict(model.named_parameters()), {}
    for flat in layout:
        buffer = torch.zeros(flat["padded"])
        for name, offset, numel in flat["slices"]:
            buffer[offset:offset + numel] = params[name].detach().reshape(-1)
        seen = torch.cat([dequantize_reference(quantize_reference(chunk, 8, BLOCK))
                          for chunk in buffer.split(flat["chunk"])])
        for name, offset, numel in flat["slices"]:
            out[name] = seen[offset:offset + numel].view(params[name].shape)
    return out


def qwz_by_hand(layout: list[dict]) -> dict[str, torch.Tensor]:
    model = tiny_model("gpt2")
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for name, value in quantized_like_the_ranks(model, layout).items():
                model.get_parameter(name).copy_(value)
        model(**batch("gpt2", step, GLOBAL_BATCH)).loss.backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(masters[name])
        optimizer.step()
        optimizer.zero_grad()
    return named_copy(model)


@pytest.mark.slow
def test_qwz_trains_as_one_process_computing_with_the_ranks_quantized_chunks_and_sends_a_quarter():
    config = {"quantized_weights": True, "quantization_block_size": BLOCK}
    ranks = spawn_gloo(qwz_run, WORLD, config)
    # NCCL's call shapes: each unit's gather one grouped call (gloo's pieces are one broadcast per rank and tensor).
    # With values and scales gathered as two tensors of two dtypes, this was 3.7e-3 off.
    grouped = spawn_gloo(qwz_run, WORLD, config, True)
    plain = spawn_gloo(qwz_run, WORLD, {})
    expected = qwz_by_hand(ranks[0]["layout"])
    for result in ranks + grouped:
        assert max((result["params"][n] - p).abs().max().item() for n, p in expected.items()) < FP32_TOL
    # It is not the unquantized run: the test could not pass with qwZ ignored.
    assert max((plain[0]["params"][n] - p).abs().max().item() for n, p in expected.items()) > 100 * FP32_TOL
    # fp32 weights as int8 plus a 4-byte scale per 64 elements: (1 + 4/64) / 4 of the bytes.
    for quantized, exact in zip(ranks[0]["all_gather_bytes"], plain[0]["all_gather_bytes"]):
        assert quantized == pytest.approx(exact * (1 + 4 / BLOCK) / 4, rel=0.01)


def test_zeropp_settings_are_refused_where_they_have_no_meaning():
    model = tiny_model("gpt2")
    for config, message in [({"zero_stage": 2, "quantized_weights": True}, "quantized_weights quantizes stage 3's"),
                            ({"zero_stage": 2, "hpz_partition_size": 2}, "hpz_partition_size keeps a secondary "
                                                                         "partition of stage 3's"),
                            ({"zero_stage": 1, "quantized_gradients": True}, "quantized_gradients quantizes "
                                                                             "stage 3's gradient"),
                            ({"zero_stage": 3, "hpz_partition_size": 0}, "hpz_partition_size must be a positive"),
                            ({"zero_stage": 3, "hpz_partition_size": 2}, r"hpz_partition_size must divide the "
                                                                         r"ranks per node \(1\)"),
                            ({"zero_stage": 3, "quantized_gradients": True, "quantized_gradients_bits": 2},
                             "quantized_gradients_bits must be 4 or 8"),
                            ({"zero_stage": 3, "quantized_weights": True, "offload_param": "cpu",
                              "offload_optimizer": "cpu"}, "quantized_weights with offload_param cpu is not"),
                            ({"zero_stage": 3, "quantization_block_size": 3}, "quantization_block_size must be a "
                                                                              "positive even integer")]:
        with pytest.raises(hf_zero.ZeroConfigError, match=message):
            hf_zero.initialize(model, make_optimizer(model), config)


# ---- qgZ's reduction, against the hierarchical all-to-all done by hand --------------------------------------
QGZ_CHUNK, QGZ_BLOCK = 37, 16  # a chunk that is no multiple of the block: blocks end where each part ends


def rank_input(rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(world * QGZ_CHUNK, generator=g) * torch.logspace(-3, 1, world * QGZ_CHUNK)


def qgz_collective(layouts: list[tuple[int, int]]) -> dict:
    """QuantizedReduceScatter on this rank's input, for each (ranks per node, bits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for per_node, bits in layouts:
        ledger = Ledger()
        reduce_scatter = QuantizedReduceScatter(Communicator(ledger, None, per_node), bits, QGZ_BLOCK)
        output = torch.empty(QGZ_CHUNK)
        reduce_scatter(output, rank_input(rank, world)).wait()
        out[(per_node, bits)] = {"output": output, "span": dict(ledger.span_bytes),
                                 "node_volume": ledger.paper_cross_node_bytes}
    return out


def round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize_reference(quantize_reference(x, bits, QGZ_BLOCK))


def qgz_by_hand(world: int, per_node: int, bits: int) -> list[torch.Tensor]:
    """The paper's two exchanges in one process: rank (node, local) first sums, over its node's ranks, their
    quantized parts of the chunks whose local index is its own, then sums chunk `rank` over the nodes' sums,
    quantized again; a group of one sends nothing and so quantizes nothing."""
    nodes, c = world // per_node, QGZ_CHUNK
    inputs = [rank_input(r, world).view(nodes, per_node, c) for r in range(world)]
    node_sums = {}
    for node in range(nodes):
        for local in range(per_node):
            parts = [inputs[node * per_node + peer][:, local].reshape(-1) for peer in range(per_node)]
            node_sums[node, local] = sum(round_trip(p, bits) if per_node > 1 else p for p in parts)
    return [sum(round_trip(node_sums[m, r % per_node].view(nodes, c)[r // per_node], bits) if nodes > 1 else
                node_sums[m, r % per_node].view(nodes, c)[r // per_node] for m in range(nodes))
            for r in range(world)]


@pytest.mark.slow
def test_qgz_reduces_as_the_papers_hierarchical_all_to_all_and_sends_a_quantized_fraction_across_nodes():
    world, layouts = 4, [(2, 4), (2, 8), (1, 8)]
    ranks = spawn_gloo(qgz_collective, world, layouts)
    for per_node, bits in layouts:
        expected = qgz_by_hand(world, per_node, bits)
        exact = sum(rank_input(r, world) for r in range(world)).view(world, QGZ_CHUNK)
        nodes = world // per_node
        for r, result in enumerate(ranks):
            got = result[(per_node, bits)]
            torch.testing.assert_close(got["output"], expected[r], rtol=0, atol=1e-6)
            # Quantization moved it, by no more than a few half-steps of the largest block (|x| <= 10 * 4).
            error = (got["output"] - exact[r]).abs().max().item()
            assert 0 < error < 2 * world * 40 / (2 ** (bits - 1) - 1)
            # Inside the node each rank sends its peers their parts of its input, quantized; across nodes it
            # sends the other nodes' ranks of its local index 1/per_node of the bucket's chunks, quantized. The
            # paper counts the across exchange's whole input per rank: the node's ranks together, the bucket.
            part = quantized_bytes(nodes * QGZ_CHUNK, bits, QGZ_BLOCK)
            assert got["span"].get("intra-node", 0) == (per_node - 1) * part
            assert got["span"].get("inter-node", 0) == (nodes - 1) * quantized_bytes(QGZ_CHUNK, bits, QGZ_BLOCK)
            assert got["node_volume"] == nodes * quantized_bytes(QGZ_CHUNK, bits, QGZ_BLOCK)


# ---- the engine with each technique, and all three: 4 ranks as 2 nodes x 2 ---------------------------------
TWO_NODES = {"zero_stage": 3, "ranks_per_node": 2, "quantization_block_size": BLOCK}
TECHNIQUES = {"plain": {}, "qwZ": {"quantized_weights": True}, "hpZ": {"hpz_partition_size": 2},
              "qgZ": {"quantized_gradients": True},
              "all three": {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True}}
SETTINGS = {**TECHNIQUES, "qgZ int8": {"quantized_gradients": True, "quantized_gradients_bits": 8},
            "qgZ offload": {"quantized_gradients": True, "offload_optimizer": "cpu"},
            "qgZ one node": {"quantized_gradients": True, "ranks_per_node": 4}}


def ledger_figures(ledger) -> dict:
    """The last step's bytes on every rank's links, summed over the ranks by span, and node 0's cross-node
    volume as the paper counts it (the sum over its ranks, 0 and 1)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ledger.last_step_span_bytes, ledger.last_step_paper_cross_node_bytes))
    return {"span": {span: sum(sent.get(span, 0) for sent, _ in every) for span in SPANS},
            "node_volume": sum(volume for _, volume in every[:2])}


def node_groups(engine) -> set[int]:
    """The communicators hpZ's secondary partitions and qgZ's node exchange use."""
    groups = {id(u.secondary) for u in engine.params.units if u.secondary is not None}
    qgz = getattr(engine.params.grads.reduce_scatter, "node", None)
    return groups | ({id(qgz)} if qgz is not None else set())


def engine_runs(runs: list[tuple[str, str, str]]) -> dict:
    """(technique, dtype, schedule) for STEPS steps each: the losses, the last step's ledger and the weights.
    "sgd" takes one step of SGD with lr 1, so that the weights moved by exactly the reduced gradient. "probe"
    accumulates 2 micro-batches a step, runs a forward with grad whose loss is thrown away before the step,
    and evaluates (a forward without grad) after it."""
    rank, out = dist.get_rank(), {}
    for technique, dtype, schedule in runs:
        model = tiny_model("gpt2")
        steps, opt = (1, torch.optim.SGD(model.parameters(), lr=1.0)) if schedule == "sgd" else \
            (STEPS, make_optimizer(model))
        micro_batches = 2 if schedule == "probe" else 1
        warnings = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("hf_zero").addHandler(handler)
        try:
            engine = hf_zero.initialize(model, opt, {**TWO_NODES, "dtype": dtype, **SETTINGS[technique],
                                                     "gradient_accumulation_steps": micro_batches})
        finally:
            logging.getLogger("hf_zero").removeHandler(handler)
        losses, evaluated = [], []
        for step in range(steps):
            for micro_batch in range(micro_batches):
                whole = batch("gpt2", step, GLOBAL_BATCH)
                loss = engine(**local_part({k: v.chunk(micro_batches)[micro_batch] for k, v in whole.items()}, rank,
                                           4)).loss
                engine.backward(loss)
                losses.append(loss.item())
                if schedule == "probe" and micro_batch == micro_batches - 1:
                    engine(**local_part(batch("gpt2", 100 + step, GLOBAL_BATCH), rank, 4))  # a probe, no backward
                engine.step()
            if schedule == "probe":
                with torch.no_grad():
                    evaluated.append(engine(**local_part(batch("gpt2", 200 + step, GLOBAL_BATCH), rank, 4)).loss)
        if evaluated:  # every rank's evaluation loss, averaged: the global batch's
            mean = torch.stack(evaluated) / 4
            dist.all_reduce(mean)
            evaluated = mean.tolist()
        ledger = engine.ledger
        figures = ledger_figures(ledger)
        held = None
        if technique == "hpZ" and schedule == "adamw":  # the secondary parts' storage, between forward and backward
            loss = engine(**local_part(batch("gpt2", 0, GLOBAL_BATCH), rank, 4)).loss
            held = sum(t.untyped_storage().nbytes() for u in engine.params.units for t in u.secondary_parts)
            engine.backward(loss)
        out[technique, dtype, schedule] = {
            "losses": losses, "evaluated": evaluated, "params": whole_params(engine), **figures,
            "bytes": ledger.last_step_bytes, "secondary": ledger.last_step_peaks.get("bytes of secondary partitions"),
            "secondary_held": held, "warnings": warnings,
            "reduce_element_size": engine.config.torch_reduce_dtype.itemsize,
            "node_groups": node_groups(engine),
            "units": [(u.persistent, u.is_root, u.nbytes) for u in engine.params.units],
            "flats": [(u.is_root, f.padded_numel, f.buckets[0].chunk_numel) for u in engine.params.units
                      for f in u.flats]}
    return out


@pytest.fixture(scope="module")
def zeropp_engines() -> dict:
    runs = [("plain", "fp32", "adamw"), ("hpZ", "fp32", "adamw"), ("plain", "fp32", "probe"),
            ("hpZ", "fp32", "probe")]
    runs += [(technique, "fp32", "sgd") for technique in ("plain", "qgZ", "qgZ int8", "qgZ offload", "qgZ one node")]
    runs += [(technique, "bf16", "adamw") for technique in TECHNIQUES]
    return spawn_gloo(engine_runs, 4, runs)[0]


def blocks_bytes(run: dict) -> int:
    """The gathered bytes of the units freed after their forward (the blocks; the root stays gathered)."""
    return sum(nbytes for persistent, root, nbytes in run["units"] if not (persistent or root))


def assert_gathers_moved_into_the_node(plain: dict, hpz: dict, gathered: int) -> None:
    """hpZ served all-gathers of `gathered` bytes from the node instead of the world. On the world's ring of
    4 (2 crossing links of 4) each rank sends 3/4 of a buffer, across nodes on half the links: 4 x 3/4 x 1/2 =
    1.5 buffers; in the node's rings of 2 each rank sends 1/2 of it: 2 buffers, all inside the node. In the
    paper's convention node 0's volume loses the whole buffer."""
    assert gathered > 0
    assert plain["node_volume"] - hpz["node_volume"] == gathered
    assert plain["span"]["inter-node"] - hpz["span"]["inter-node"] == gathered * 3 // 2
    assert hpz["span"]["intra-node"] - plain["span"]["intra-node"] == gathered // 2


@pytest.mark.slow
def test_hpz_trains_bitwise_as_plain_stage3_with_the_backward_gathers_inside_the_node(zeropp_engines):
    plain, hpz = zeropp_engines["plain", "fp32", "adamw"], zeropp_engines["hpZ", "fp32", "adamw"]
    assert hpz["losses"] == plain["losses"]
    for name, value in plain["params"].items():
        assert torch.equal(hpz["params"][name], value), name
    # The backward's gathers left the network for the node's links: the same all-gather bytes, moved.
    assert hpz["bytes"] == plain["bytes"]
    assert_gathers_moved_into_the_node(plain, hpz, blocks_bytes(hpz))
    # Each rank held 1/2 of every unit (the root's too, for the next micro-batch's forward).
    assert hpz["secondary"] == hpz["secondary_held"] == (blocks_bytes(hpz) + root_bytes(hpz)) // 2
    assert plain["secondary"] is None


@pytest.mark.slow
def test_hpz_keeps_its_secondary_partition_until_the_step_and_stays_bitwise_with_probes_and_accumulation(
        zeropp_engines):
    """A forward with grad whose backward never comes, before the step, and an evaluation after it: the
    secondary partition kept before a step must not serve after it (the weights changed). Within a step of 2
    micro-batches, only the first forward crosses nodes: as DeepSpeed keeps it, until the optimizer step."""
    plain, hpz = zeropp_engines["plain", "fp32", "probe"], zeropp_engines["hpZ", "fp32", "probe"]
    assert hpz["losses"] == plain["losses"] and hpz["evaluated"] == plain["evaluated"]
    for name, value in plain["params"].items():
        assert torch.equal(hpz["params"][name], value), name
    # Both against one process on the global batch: the evaluations see each step's updated weights.
    expected = probe_by_hand()
    assert max((plain["params"][n] - p).abs().max().item() for n, p in expected["params"].items()) < FP32_TOL
    assert plain["evaluated"] == pytest.approx(expected["evaluated"], rel=1e-5)
    # The last step: the evaluation after the step before and the first micro-batch's forward cross nodes;
    # the second micro-batch, both backwards and the probe gather inside the node. Without accumulation (one
    # forward crossing), the step's cross-node all-gathers are half of that.
    one_forward = zeropp_engines["hpZ", "fp32", "adamw"]
    gathers = {name: run["node_volume"] - run["bytes"]["reduce_scatter"] - run["bytes"]["all_reduce"]
               for name, run in (("probe", hpz), ("one forward", one_forward))}
    assert gathers["probe"] == 2 * gathers["one forward"] == 2 * (blocks_bytes(hpz) + root_bytes(hpz)), gathers


def probe_by_hand() -> dict:
    """The probe schedule in one process: 2 micro-batches of the global batch a step, torch's AdamW, an
    evaluation without grad after each step (the probes, whose backward never comes, change nothing)."""
    model = tiny_model("gpt2")
    optimizer = make_optimizer(model)
    evaluated = []
    for step in range(STEPS):
        for micro_batch in range(2):
            (model(**{k: v.chunk(2)[micro_batch] for k, v in batch("gpt2", step, GLOBAL_BATCH).items()}).loss / 2
             ).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            evaluated.append(model(**batch("gpt2", 200 + step, GLOBAL_BATCH)).loss.item())
    return {"params": named_copy(model), "evaluated": evaluated}


def root_bytes(run: dict) -> int:
    return sum(nbytes for persistent, root, nbytes in run["units"] if root)


def checkpointed_runs() -> dict:
    """Plain and hpZ with transformers' activation checkpointing: each block's forward runs again in backward."""
    out = {}
    for technique in ("plain", "hpZ"):
        model = tiny_model("gpt2")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = hf_zero.initialize(model, make_optimizer(model), {**TWO_NODES, **TECHNIQUES[technique]})
        for step in range(STEPS):
            engine.backward(engine(**local_part(batch("gpt2", step, GLOBAL_BATCH), dist.get_rank(), 4)).loss)
            engine.step()
        out[technique] = {"params": whole_params(engine), **ledger_figures(engine.ledger),
                          "units": [(u.persistent, u.is_root, u.nbytes) for u in engine.params.units]}
    return out


@pytest.mark.slow
def test_hpz_serves_the_recomputation_of_activation_checkpointing_from_the_node_and_stays_bitwise():
    runs = spawn_gloo(checkpointed_runs, 4)[0]
    for name, value in runs["plain"]["params"].items():
        assert torch.equal(runs["hpZ"]["params"][name], value), name
    # Each block's recomputation gathers it (the backward then finds it gathered): from the node under hpZ.
    assert_gathers_moved_into_the_node(runs["plain"], runs["hpZ"], blocks_bytes(runs["hpZ"]))


@pytest.mark.slow
def test_qgz_moves_the_weights_by_the_exact_average_gradient_within_quantization_error(zeropp_engines):
    start = named_copy(tiny_model("gpt2"))
    exact = zeropp_engines["plain", "fp32", "sgd"]["params"]
    step = torch.cat([(start[n] - exact[n]).reshape(-1) for n in start])

    def relative_error(technique: str) -> float:
        moved = zeropp_engines[technique, "fp32", "sgd"]["params"]
        return (torch.cat([(moved[n] - exact[n]).reshape(-1) for n in start]).norm() / step.norm()).item()

    # Rounding to a step of absmax / qmax, twice: about a sixth of the gradient's norm in int4 (gradients are
    # heavy-tailed within a block), and the int8 error smaller by about the ratio of the steps, 127 / 7.
    # Summing instead of averaging would be off by 3; an unquantized reduction by 0.
    int4, int8 = relative_error("qgZ"), relative_error("qgZ int8")
    assert 0 < int8 < int4 < 0.25, (int4, int8)
    assert 8 < int4 / int8 < 40, (int4, int8)
    for technique in ("qgZ", "qgZ int8"):
        sent = zeropp_engines[technique, "fp32", "sgd"]["bytes"]
        assert "reduce_scatter" not in sent and sent["all_to_all"] > 0
    # With the optimizer in host memory the reduced chunk lands there as it would from a reduce-scatter.
    offloaded = zeropp_engines["qgZ offload", "fp32", "sgd"]["params"]
    for name, value in zeropp_engines["qgZ", "fp32", "sgd"]["params"].items():
        assert torch.equal(offloaded[name], value), name


def papers_node_volume(technique: str, run: dict, element_size: int) -> int:
    """Node 0's cross-node bytes in a step, by the paper's table (a forward all-gather, a backward all-gather
    and a gradient reduce-scatter of every parameter, each as the technique sends it) on this model's layout:
    each flat buffer padded to 4 chunks, quantized per chunk in blocks of BLOCK; the root unit stays gathered
    from forward into backward, so its backward all-gather is none; the gradient norm's all-reduce."""
    on, total = SETTINGS[technique], run["bytes"]["all_reduce"]
    for is_root, padded, chunk in run["flats"]:
        gather = 4 * quantized_bytes(chunk, 8, BLOCK) if on.get("quantized_weights") else element_size * padded
        backward = 0 if is_root or on.get("hpz_partition_size") else gather
        reduce = 4 * quantized_bytes(chunk, 4, BLOCK) if on.get("quantized_gradients") else \
            run["reduce_element_size"] * padded
        total += gather + backward + reduce
    return total


@pytest.mark.slow
def test_each_technique_cuts_the_cross_node_volume_by_the_papers_formula_and_trains_as_plain_stage3_in_bf16(
        zeropp_engines):
    runs = {t: zeropp_engines[t, "bf16", "adamw"] for t in TECHNIQUES}
    for technique, run in runs.items():
        assert run["node_volume"] == papers_node_volume(technique, run, 2), technique
    # All three, per parameter in bf16: 2 + 2 + 2 bytes plain; (1 + 4/64) + 0 + (0.5 + 4/64) with all three,
    # less the root's backward all-gather in both.
    assert 0.25 < runs["all three"]["node_volume"] / runs["plain"]["node_volume"] < 0.30
    # hpZ over the whole node and qgZ's node exchange share one group.
    assert len(runs["all three"]["node_groups"]) == 1
    inter = {t: run["span"]["inter-node"] for t, run in runs.items()}  # what crossed, on every rank's links
    for technique in ("qwZ", "hpZ", "qgZ"):  # each cuts the network's bytes on its own
        assert inter["all three"] < inter[technique] < inter["plain"], (technique, inter)
    plain_losses = runs["plain"]["losses"]
    for technique, run in runs.items():
        assert run["losses"][0] == pytest.approx(plain_losses[0], rel=0.01)  # the first forward sees qwZ only
        assert run["losses"][-1] == pytest.approx(plain_losses[-1], rel=0.01), (technique, run["losses"])


@pytest.mark.slow
def test_qgz_on_one_node_reduces_exactly_with_the_plain_reduce_scatter_and_says_so_once(zeropp_engines):
    one_node, exact = zeropp_engines["qgZ one node", "fp32", "sgd"], zeropp_engines["plain", "fp32", "sgd"]
    for name, value in exact["params"].items():
        assert torch.equal(one_node["params"][name], value), name
    assert "all_to_all" not in one_node["bytes"] and one_node["bytes"]["reduce_scatter"] > 0
    assert one_node["span"].get("inter-node", 0) == 0
    said = [w for w in one_node["warnings"] if "quantized_gradients" in w]
    assert said == ["quantized_gradients (ZeRO++ qgZ) is off: all 4 ranks are on one node (ranks_per_node 4), "
                    "where its quantization would lose precision and save no inter-node bytes; the gradients "
                    "are reduced exactly by the plain reduce-scatter"]


# ---- checkpoints: the quantized and secondary copies are transient ----------------------------------------
ALL_THREE = {**TWO_NODES, **TECHNIQUES["all three"]}


def checkpoint_with_zeropp(folder: str) -> dict:
    straight = new_engine(ALL_THREE)
    train(straight, 0, STOP)
    first = new_engine(ALL_THREE)
    train(first, 0, SAVE_AT)
    masters = whole_params(first)  # a read gather: exact, never quantized
    first.save_checkpoint(folder, client_state={"next_step": SAVE_AT})
    resumed = new_engine(ALL_THREE)
    resumed.load_checkpoint(folder)
    train(resumed, SAVE_AT, STOP)
    return {"masters": masters, "straight": whole_params(straight), "resumed": whole_params(resumed)}


def load_elsewhere(folder: str) -> dict:
    engine = new_engine({"zero_stage": 3})
    engine.load_checkpoint(folder)
    return whole_params(engine)


@pytest.mark.slow
def test_checkpoints_with_zeropp_resume_bitwise_consolidate_and_load_on_another_world_size(tmp_path):
    folder = tmp_path / "ckpt"
    run = spawn_gloo(checkpoint_with_zeropp, 4, str(folder))[0]
    for name, value in run["straight"].items():
        assert torch.equal(run["resumed"][name], value), name
    consolidate(folder, tmp_path / "whole", progress=False)
    saved = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert saved and all(torch.equal(t, run["masters"][name]) for name, t in saved.items())
    for name, value in spawn_gloo(load_elsewhere, 2, str(folder))[0].items():
        assert torch.equal(value, run["masters"][name]), name


def eight_ranks_as_two_nodes_of_four() -> dict:
    """Stage 3 with hpZ over each node's 4 ranks, ranks 0-3 and 4-7 the two nodes: what every rank issued on each
    group, and the trained weights."""
    from tests.helpers import Scenario, run_scenarios

    config = {"zero_stage": 3, "ranks_per_node": 4, "hpz_partition_size": 4}
    return run_scenarios([Scenario("hpz 4 of 8", config=config, steps=STEPS, global_batch=GLOBAL_BATCH)])


@pytest.mark.slow
def test_eight_ranks_as_two_nodes_of_four_with_hpz_train_as_one_process():
    from tests.helpers import max_diff, train_single_process

    results = spawn_gloo(eight_ranks_as_two_nodes_of_four, 8)
    expected = train_single_process("gpt2", STEPS, GLOBAL_BATCH)["params"]
    for rank_result in results:
        assert max_diff(rank_result["hpz 4 of 8"]["params"], expected) < 1e-5
