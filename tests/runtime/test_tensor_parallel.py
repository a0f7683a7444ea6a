"""Tensor parallelism (DTensor, hf_zero/runtime/tensor_parallel.py) with ZeRO-DP over the "dp" dimension of the
same mesh, with and without ZeRO-R's partitioned and CPU activation checkpointing: on 4 gloo ranks as
tp 2 x dp 2 and as tp 4, training equals one process on the global batch. Engine checkpoints of
tensor-parallel runs resume exactly, continue on another dp size and stage, and consolidate whole."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers import BertForSequenceClassification, GPT2LMHeadModel

import hf_zero
from hf_zero.checkpoint import CheckpointError
from hf_zero.checkpoint.consolidate import consolidate
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh
from tests.checkpoint_helpers import whole_params
from tests.conftest import SMALL_BUCKETS
from tests.engine.test_engine import FP32_TOL
from tests.helpers import (
    batch,
    make_optimizer,
    max_diff,
    tiny_model,
    train_single_process,
)

STEPS, GLOBAL_BATCH, CLIP = 5, 8, 0.5
CHECKPOINTING = {"none": {}, "pa": {"partition_activations": True},
                 "pa_cpu": {"partition_activations": True, "cpu_checkpointing": True}}
SCENARIOS = [(kind, stage, mode) for kind in ("gpt2-tp", "bert-tp") for stage in (0, 1, 2, 3)
             for mode in (CHECKPOINTING if kind == "gpt2-tp" else ("none", "pa_cpu"))] + \
            [("llama-tp", stage, "none") for stage in (1, 3)]  # through transformers' base_model_tp_plan
# tp 4 leaves a dp of 1: each stage's partitioning over dp is tp 2 x dp 2's to check (and tests/engine's, on 1, 2
# and 4 ranks). tp 4 checks the four-way split: GPT-2's at the stage that keeps whole parameters and the one that
# gathers them, with each activation checkpointing; BERT's; Llama's through its plan.
TP4_SCENARIOS = [s for s in SCENARIOS if (s[0] == "gpt2-tp" and s[1] in (0, 3)) or (s[0] == "bert-tp" and s[1] == 2)
                 or s[0] == "llama-tp"]
MESHES = [(2, s) for s in SCENARIOS] + [(4, s) for s in TP4_SCENARIOS]


def tp_model(kind: str, tp: int) -> tuple[torch.nn.Module, object]:
    model = tiny_model(kind)
    mesh = init_mesh(tp)
    apply_tensor_parallel(model, mesh["tp"])
    return model, mesh


def tp_engine(kind: str, tp: int, config: dict) -> hf_zero.ZeroEngine:
    model, mesh = tp_model(kind, tp)
    model.train()
    return hf_zero.initialize(model, make_optimizer(model), {"gradient_clipping": CLIP, **SMALL_BUCKETS, **config},
                              mesh=mesh)


def train_steps(engine: hf_zero.ZeroEngine, kind: str, start: int, stop: int) -> list[float]:
    """Steps [start, stop) on the global batches, each dp rank taking its part; returns the gradient norms."""
    dp_rank, dp = engine.comm.rank, engine.comm.world_size
    norms = []
    for step in range(start, stop):
        b = {k: v.chunk(dp)[dp_rank] for k, v in batch(kind, step, GLOBAL_BATCH).items()}
        engine.backward(engine(**b).loss)
        engine.step()
        norms.append(engine.global_grad_norm)
    return norms


def train_tp(tp: int) -> dict[tuple, dict]:
    """Every scenario of this mesh (MESHES): final whole parameters and the gradient norms."""
    results = {}
    for kind, stage, mode in (s for mesh, s in MESHES if mesh == tp):
        engine = tp_engine(kind, tp, {"zero_stage": stage, **CHECKPOINTING[mode]})
        norms = train_steps(engine, kind, 0, STEPS)
        results[(kind, stage, mode)] = {"params": whole_params(engine), "norms": norms}
        if kind == "llama-tp":
            results[(kind, stage, mode)]["tp"] = tp
            with engine.gathered_parameters():
                results[(kind, stage, mode)]["split"] = {
                    name: (tuple(p.to_local().shape), p.placements) for name, p in engine.module.named_parameters()
                    if isinstance(p, DTensor)}
    return results


@pytest.fixture(scope="module")
def tp_runs(request) -> list[dict]:
    """On 4 ranks, tp `request.param` (2: tp 2 x dp 2; 4: tp 4)."""
    return spawn_gloo(train_tp, 4, request.param)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    return {kind: train_single_process(kind, STEPS, GLOBAL_BATCH, clip=CLIP) for kind in ("gpt2-tp", "bert-tp",
                                                                                           "llama-tp")}


@pytest.mark.slow
@pytest.mark.parametrize("tp_runs, kind, stage, mode", [(tp, *s) for tp, s in MESHES], indirect=["tp_runs"],
                         scope="module",  # one spawned world per mesh, shared by its scenarios
                         ids=[f"{'tp2_dp2' if tp == 2 else 'tp4'}-{k}-s{st}-{m}" for tp, (k, st, m) in MESHES])
def test_tp_x_zero_dp_matches_single_process(tp_runs, references, kind, stage, mode):
    """Llama through its config's base_model_tp_plan: every Linear the plan names is split (`split` records each
    rank's local shapes), so the parity is tensor parallelism's, not dp over replicated copies."""
    reference = references[kind]
    for rank_result in tp_runs:
        run = rank_result[(kind, stage, mode)]
        assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert max_diff(run["params"], reference["params"]) <= FP32_TOL
        if kind == "llama-tp":  # column-wise: split on the output features, row-wise: on the input features
            for layer in (0, 1):
                for module, whole, dim in [("self_attn.q_proj", (32, 32), 0), ("self_attn.k_proj", (16, 32), 0),
                                           ("self_attn.v_proj", (16, 32), 0), ("self_attn.o_proj", (32, 32), 1),
                                           ("mlp.gate_proj", (64, 32), 0), ("mlp.up_proj", (64, 32), 0),
                                           ("mlp.down_proj", (32, 64), 1)]:
                    local = list(whole)
                    local[dim] //= run["tp"]
                    assert run["split"][f"model.layers.{layer}.{module}.weight"] == (tuple(local), (Shard(dim),))


def refusals(root: str) -> dict[str, str]:
    """What bad tensor-parallel input raises, on 2 ranks."""
    messages = {}
    mesh = init_mesh(2)
    odd = tiny_model("gpt2")
    odd.config.n_head = 3
    packed, one_kv_head = tiny_model("llama-tp"), tiny_model("llama-tp")
    packed.config.base_model_tp_plan = {**packed.config.base_model_tp_plan, "layers.*.mlp.up_proj": "packed_colwise"}
    one_kv_head.config.num_key_value_heads = 1
    for name, attempt in {
        "world": lambda: init_mesh(3),
        "heads": lambda: apply_tensor_parallel(odd, mesh["tp"]),
        "plan_style": lambda: apply_tensor_parallel(packed, mesh["tp"]),
        "kv_heads": lambda: apply_tensor_parallel(one_kv_head, mesh["tp"]),
        "model": lambda: apply_tensor_parallel(torch.nn.Linear(2, 2), mesh["tp"]),
        "mesh_dims": lambda: hf_zero.initialize(*_model_and_optimizer(), mesh=init_mesh(2)["tp"]),
        "zeropp_mesh": _zeropp_on_a_mesh,
    }.items():
        try:
            attempt()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    tp2 = tp_engine("gpt2-tp", 2, {"zero_stage": 2})
    tp2.save_checkpoint(f"{root}/tp2")
    model = tiny_model("gpt2-tp")
    dp2 = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
    model, mesh = tp_model("gpt2-tp", 2)
    model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)
    try:
        hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2}, mesh=mesh)
        messages["frozen_in_optimizer"] = "no error"
    except ValueError as error:
        messages["frozen_in_optimizer"] = str(error)
    for name, attempt in {"tp_size": lambda: dp2.load_checkpoint(f"{root}/tp2")}.items():
        try:
            attempt()
            messages[name] = "no error"
        except CheckpointError as error:
            messages[name] = str(error)
    dist.barrier()
    return messages


def _model_and_optimizer():
    model = tiny_model("gpt2")
    return model, make_optimizer(model)


def _zeropp_on_a_mesh() -> None:
    model, mesh = tp_model("gpt2-tp", 2)
    hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3, "quantized_gradients": True,
                                                      "hpz_partition_size": 2}, mesh=mesh)


def test_bad_tensor_parallel_input_is_refused_with_what_to_do(tmp_path):
    messages = spawn_gloo(refusals, 2, str(tmp_path))[0]
    assert "tensor_parallel_size must divide the world size 2; got 3" in messages["world"]
    assert "tensor_parallel_size 2 must divide the model's attention heads (3)" in messages["heads"]
    assert ("plans for transformers' GPT-2 and BERT models and for models whose config has a base_model_tp_plan "
            "(Llama, Qwen2, Mistral, ...); got Linear (model_type None)" in messages["model"])
    assert ("LlamaForCausalLM's base_model_tp_plan uses 'packed_colwise'; hf_zero applies 'colwise' and 'rowwise' "
            "layers only" in messages["plan_style"])
    assert "tensor_parallel_size 2 must divide the model's key-value heads (1)" in messages["kv_heads"]
    assert "mesh must have the dimensions ('dp', 'tp')" in messages["mesh_dims"]
    assert ("hpz_partition_size and quantized_gradients with a data-parallel group smaller than the world (a "
            "tensor-parallel mesh) is not supported yet" in messages["zeropp_mesh"])
    assert ("was saved with tensor_parallel_size 2 and this engine runs 1: load it with tensor_parallel_size 2"
            in messages["tp_size"])
    assert ("parameter transformer.h.0.mlp.c_fc.weight is in an optimizer param group but does not require grad"
            in messages["frozen_in_optimizer"])


# ---- checkpoints ---------------------------------------------------------------------------------
SAVE_AT = 3
SAVED = [("gpt2-tp", 2), ("gpt2-tp", 3), ("bert-tp", 1)]


def checkpoint_runs(root: str) -> dict[str, dict]:
    """tp 2 x dp 2: 2 x SAVE_AT steps straight, against saving at SAVE_AT and resuming in a fresh engine;
    with the whole parameters at the save point."""
    results = {}
    for kind, stage in SAVED:
        name = f"{kind}-s{stage}"
        straight = tp_engine(kind, 2, {"zero_stage": stage})
        train_steps(straight, kind, 0, 2 * SAVE_AT)
        first = tp_engine(kind, 2, {"zero_stage": stage})
        train_steps(first, kind, 0, SAVE_AT)
        first.save_checkpoint(f"{root}/{name}", client_state={"next_step": SAVE_AT})
        resumed = tp_engine(kind, 2, {"zero_stage": stage})
        train_steps(resumed, kind, resumed.load_checkpoint(f"{root}/{name}")["next_step"], 2 * SAVE_AT)
        results[name] = {"straight": whole_params(straight), "resumed": whole_params(resumed),
                         "at_save": whole_params(first)}
    return results


def continue_on_tp2_dp1(root: str) -> dict[str, torch.Tensor]:
    """The tp 2 x dp 2 stage-2 checkpoint, continued on 2 ranks (tp 2 x dp 1) at stage 3."""
    engine = tp_engine("gpt2-tp", 2, {"zero_stage": 3})
    train_steps(engine, "gpt2-tp", engine.load_checkpoint(f"{root}/gpt2-tp-s2")["next_step"], 2 * SAVE_AT)
    return whole_params(engine)


@pytest.fixture(scope="module")
def saved_tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return root, spawn_gloo(checkpoint_runs, 4, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", SAVED, ids=[f"{k}-s{s}" for k, s in SAVED])
def test_a_tensor_parallel_checkpoint_resumes_bitwise_as_the_uninterrupted_run(saved_tp, kind, stage):
    for rank_result in saved_tp[1]:
        run = rank_result[f"{kind}-s{stage}"]
        for name, param in run["straight"].items():
            assert torch.equal(param, run["resumed"][name]), f"{name} differs after resuming"


@pytest.mark.slow
def test_a_tp2_dp2_checkpoint_continues_the_same_trajectory_on_tp2_dp1_at_stage3(saved_tp):
    root, results = saved_tp
    continued = spawn_gloo(continue_on_tp2_dp1, 2, str(root))
    for rank_result in continued:
        assert max_diff(rank_result, results[0]["gpt2-tp-s2"]["straight"]) <= FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind, stage", [("gpt2-tp", 2), ("bert-tp", 1)])
def test_a_tensor_parallel_checkpoint_consolidates_to_the_whole_weights(saved_tp, tmp_path, kind, stage):
    """hf-zero consolidate joins the tp parts (GPT-2's strided Q|K|V, BERT's row and column splits) into
    the tensors DTensor.full_tensor() gave at the save point."""
    root, results = saved_tp
    consolidate(root / f"{kind}-s{stage}", tmp_path, progress=False)
    model_class = GPT2LMHeadModel if kind.startswith("gpt2") else BertForSequenceClassification
    loaded = model_class.from_pretrained(tmp_path)
    expected = results[0][f"{kind}-s{stage}"]["at_save"]
    assert {n for n, _ in loaded.named_parameters()} == set(expected)
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), f"{name} was not reassembled"


# Frozen and split over tp: a column-parallel weight, and a fused Q|K|V weight (strided) with its bias.
FROZEN_SPLIT = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight",
                "transformer.h.1.attn.c_attn.bias"]


def frozen_tp_engine(stage: int) -> hf_zero.ZeroEngine:
    model, mesh = tp_model("gpt2-tp", 2)
    for name in FROZEN_SPLIT:
        model.get_parameter(name).requires_grad_(False)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return hf_zero.initialize(model, torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1),
                              {"zero_stage": stage, "gradient_clipping": CLIP, **SMALL_BUCKETS}, mesh=mesh)


def frozen_split_runs(root: str) -> dict[int, dict]:
    """tp 2 x dp 2 with split frozen parameters: straight through, and saved then resumed in an engine whose
    frozen parameters were zeroed first (so they can only come back from the checkpoint)."""
    results = {}
    for stage in (2, 3):
        straight = frozen_tp_engine(stage)
        train_steps(straight, "gpt2-tp", 0, 2 * SAVE_AT)
        first = frozen_tp_engine(stage)
        train_steps(first, "gpt2-tp", 0, SAVE_AT)
        first.save_checkpoint(f"{root}/s{stage}")
        resumed = frozen_tp_engine(stage)
        with torch.no_grad():
            for name in FROZEN_SPLIT:
                resumed.module.get_parameter(name).zero_()
        resumed.load_checkpoint(f"{root}/s{stage}")
        train_steps(resumed, "gpt2-tp", SAVE_AT, 2 * SAVE_AT)
        results[stage] = {"straight": whole_params(straight), "resumed": whole_params(resumed),
                          "at_save": whole_params(first)}
    return results


@pytest.mark.slow
def test_frozen_split_parameters_are_checkpointed_whole_resume_bitwise_and_consolidate(tmp_path):
    results = spawn_gloo(frozen_split_runs, 4, str(tmp_path))
    for stage in (2, 3):
        for rank_result in results:
            run = rank_result[stage]
            assert any(run["at_save"][n].abs().sum() > 0 for n in FROZEN_SPLIT)
            for name, param in run["straight"].items():
                assert torch.equal(param, run["resumed"][name]), f"stage {stage}: {name} differs after resuming"
        consolidate(tmp_path / f"s{stage}", tmp_path / f"whole{stage}", progress=False)
        loaded = dict(GPT2LMHeadModel.from_pretrained(tmp_path / f"whole{stage}").named_parameters())
        for name, param in results[0][stage]["at_save"].items():
            assert torch.equal(loaded[name], param), f"stage {stage}: {name} was not stored whole"


def train_tp2_with_nvme_states(root: str) -> dict:
    """tp 2 on one node: both tp ranks are data-parallel rank 0 and write their own NVMe states."""
    engine = tp_engine("gpt2-tp", 2, {"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": root})
    train_steps(engine, "gpt2-tp", 0, 3)
    return {"params": whole_params(engine), "folders": sorted(os.listdir(root)), "dp_rank": engine.comm.rank}


def test_tensor_parallel_ranks_of_one_data_parallel_rank_keep_their_own_nvme_folders(tmp_path):
    """Keyed by the data-parallel rank, both tp ranks would use (and clear at start) the same folder."""
    results = spawn_gloo(train_tp2_with_nvme_states, 2, str(tmp_path))
    reference = train_single_process("gpt2-tp", 3, GLOBAL_BATCH, clip=CLIP)
    for result in results:
        assert result["dp_rank"] == 0 and result["folders"] == ["rank00000", "rank00001"]
        assert max((result["params"][n] - p).abs().max().item() for n, p in reference["params"].items()) < FP32_TOL
