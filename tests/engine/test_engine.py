"""The engine trains exactly as data parallelism does, at every stage, on 1, 2 and 4 gloo ranks."""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import transformers

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.settings.config import ZeroConfigError
from hf_zero.settings.environment import SIMULATION_MODES
from hf_zero.zero.reducer import MAX_IN_FLIGHT
from tests.conftest import CLIP, UNDER_SIMULATION
from tests.helpers import (
    batch,
    hf_zero_messages,
    make_optimizer,
    max_diff,
    named_copy,
    tiny_model,
    train_single_process,
)

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def single_process():
    """Single-process references, computed once per (model, recipe)."""
    cache = {}

    def get(kind="gpt2", dtype=torch.float32, global_batch=8, steps=5, micro_batches=1, clip=0.0, fused=False):
        key = (kind, dtype, global_batch, steps, micro_batches, clip, fused)
        if key not in cache:
            cache[key] = train_single_process(kind, steps, global_batch, dtype, micro_batches, clip, fused)
        return cache[key]
    return get


PARITY_RUNS = [("world2", stage) for stage in (0, 1, 2, 3)] + [("world4", stage) for stage in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("world, stage", PARITY_RUNS)
def test_stage_matches_single_process_and_ddp(request, single_process, kind, world, stage):
    ref = single_process(kind)["params"]
    for rank_result in request.getfixturevalue(world):
        ours = rank_result[f"s{stage}_{kind}"]["params"]
        assert max_diff(ours, ref) < FP32_TOL
        assert max_diff(ours, rank_result[f"ddp_{kind}"]["params"]) < FP32_TOL


@pytest.mark.parametrize("mode", SIMULATION_MODES)
@pytest.mark.parametrize("name", UNDER_SIMULATION)
def test_every_stage_trains_bitwise_alike_when_asynchronous_work_runs_late_or_early(world2, name, mode):
    """Under hf_zero.runtime.device's simulation every copy, reduction and collective runs as late as a GPU may run it
    (its outputs NaN until waited on), or as early: a missing wait, or work that counts on another not having
    run yet, changes the weights. ZeRO++ (hpZ, qwZ), offload and gradient accumulation included."""
    for rank_result in world2:
        assert max_diff(rank_result[f"{name}_{mode}"]["params"], rank_result[name]["params"]) == 0
        assert max_diff(rank_result[f"{name}_{mode}"]["masters"], rank_result[name]["masters"]) == 0


@pytest.mark.slow
def test_stage0_is_bitwise_ddp(world2):
    for rank_result in world2:
        assert max_diff(rank_result["s0_gpt2"]["params"], rank_result["ddp_gpt2"]["params"]) == 0.0


@pytest.mark.slow
def test_stage3_with_persistent_params_and_no_prefetch_matches(world2, single_process):
    for rank_result in world2:
        assert max_diff(rank_result["s3_persistent_gpt2"]["params"], single_process()["params"]) < FP32_TOL


@pytest.mark.slow
def test_stage3_with_the_papers_root_schedule_matches(world2, single_process):
    for rank_result in world2:
        assert max_diff(rank_result["s3_paper_schedule_gpt2"]["params"], single_process()["params"]) < FP32_TOL


@pytest.mark.slow
def test_stage2_without_overlap_matches(world2, single_process):
    for rank_result in world2:
        assert max_diff(rank_result["s2_no_overlap_gpt2"]["params"], single_process()["params"]) < FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_bucket_buffers_stay_bounded_whatever_the_model_depth(world2, single_process, stage):
    """C_B on an 8-block model: the buckets in flight plus two filling (a parameter may straddle two) of
    the main group, and the small no-decay group (biases and norms of every block, so open through
    backward): a few buckets, not a whole gradient. Training still matches."""
    for rank_result in world2:
        r = rank_result[f"s{stage}_deep"]
        bound = (MAX_IN_FLIGHT + 2) * r["largest_bucket_bytes"] + r["smaller_groups_bytes"]
        assert 0 < r["peak_buffer_bytes"] <= bound
        assert r["peak_buffer_bytes"] < 0.5 * 4 * r["psi"], "less than half of a full fp32 gradient"
        assert max_diff(r["params"], single_process("gpt2-deep", steps=2)["params"]) < FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_on_one_shard_skips_the_step_on_every_rank(world2, stage):
    for rank_result in world2:
        r = rank_result[f"s{stage}_fp16_overflow"]
        assert r["skipped"] == [0, 1, 1], "exactly the poisoned step 1 is skipped"
        assert r["scales"] == [2.0**16, 2.0**15, 2.0**15], "the dynamic scale halves once"
        assert max_diff(r["before_poison"], r["after_poison"]) == 0.0, "skipped step leaves parameters as they were"
        assert math.isinf(r["norms"][1]) or math.isnan(r["norms"][1])
        assert math.isfinite(r["norms"][2])
    finals = [rank_result[f"s{stage}_fp16_overflow"]["params"] for rank_result in world2]
    assert max_diff(finals[0], finals[1]) == 0.0, "ranks stay in step"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_four_accumulated_micro_batches_equal_one_step_on_the_concatenated_batch(world2, single_process, stage):
    ref = single_process(global_batch=16, steps=3)["params"]
    for rank_result in world2:
        assert max_diff(rank_result[f"s{stage}_ga4"]["params"], ref) < FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage, fused", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_global_norm_clipping_matches_torch_clip_grad_norm(world2, single_process, stage, fused):
    """Fused: the device computes the clipping coefficient and the host reads each step's norm afterwards (stage 1
    takes stage 2's path there)."""
    ref = single_process(clip=CLIP, fused=fused)
    assert min(ref["norms"]) < CLIP < max(ref["norms"]), "the test must clip some steps and leave others"
    for rank_result in world2:
        r = rank_result[f"s{stage}_clip{'_fused' if fused else ''}"]
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-4)
        assert max_diff(r["params"], ref["params"]) < FP32_TOL


def test_with_a_fused_optimizer_a_non_finite_step_is_skipped_on_the_device_and_counted_once_read(caplog):
    """torch's fused AdamW: the host queues the step without reading the norm, and the device skips a step whose
    gradients are not finite, leaving weights, moments and step counts as they were. The host learns the outcome
    when it reads it (last_step_skipped, skipped_steps, global_grad_norm) or at the next step, and
    max_skipped_steps_in_a_row stops training at the next step, where every rank stops alike (not at a read, which
    one rank alone may make)."""
    import logging

    from hf_zero.engine import NonFiniteGradientsError

    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model, fused=True),
                                {"zero_stage": 2, "max_skipped_steps_in_a_row": 2})

    def step(poisoned: bool, number: int) -> None:
        loss = engine(**batch("gpt2", number, 4)).loss
        engine.backward(loss * float("nan") if poisoned else loss)
        engine.step()

    def states() -> dict[str, torch.Tensor]:
        return {f"{id(p)}.{k}": v.clone() for p, state in engine.optimizer.state.items() for k, v in state.items()}

    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        step(False, 0)
        assert not engine.last_step_skipped and math.isfinite(engine.global_grad_norm)
        weights, before = named_copy(model), states()
        step(True, 1)
        assert hf_zero_messages(caplog.records) == []  # not read yet
        assert engine.last_step_skipped and engine.skipped_steps == 1 and math.isnan(engine.global_grad_norm)
        assert max_diff(named_copy(model), weights) == 0.0
        after = states()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        step(True, 2)  # the second in a row
        assert engine.skipped_steps == 2  # read: counted, the limit reached, and the next step stops
        with pytest.raises(NonFiniteGradientsError, match=r"2 optimizer steps in a row were skipped"):
            step(False, 3)
        assert max_diff(named_copy(model), weights) == 0.0
        # The limit reached at a run's last step: training ends with check_skipped_steps, which every rank calls.
        model = tiny_model("gpt2")
        engine = hf_zero.initialize(model, make_optimizer(model, fused=True),
                                    {"zero_stage": 2, "max_skipped_steps_in_a_row": 1})
        step(True, 4)
        with pytest.raises(NonFiniteGradientsError, match=r"1 optimizer steps in a row were skipped"):
            engine.check_skipped_steps()
        engine.check_skipped_steps()  # raised once
    warnings = hf_zero_messages(caplog.records)
    assert len(warnings) == 3 and all("the gradients are not finite" in w for w in warnings)


def mlp_steps(stage: int | None, optimizer_of: Callable[[torch.nn.Module], torch.optim.Optimizer]
              ) -> dict[str, torch.Tensor]:
    """3 steps of an MLP with the optimizer `optimizer_of` makes for it: on `stage` over the process group, each rank
    on its part of the batch, or (`stage` None) in one process on the global batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = optimizer_of(model)
    inputs = [torch.randn(8, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    if stage is None:
        for x in inputs:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return named_copy(model)
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": stage})
    for x in inputs:
        engine.backward(engine(x.chunk(engine.comm.world_size)[engine.comm.rank]).square().mean())
        engine.step()
    with engine.gathered_parameters():
        return named_copy(model)


def with_an_empty_param_group(stage: int | None, empty_first: bool) -> dict[str, torch.Tensor]:
    """AdamW with an empty param group before or after the one with weight decay (the Trainer's no-decay group under
    LoRA)."""
    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
        empty = {"params": [], "weight_decay": 0.0}
        return torch.optim.AdamW([empty, *groups] if empty_first else [*groups, empty], lr=1e-2)
    return mlp_steps(stage, adamw)


def empty_group_runs() -> dict[tuple[int, bool], dict[str, torch.Tensor]]:
    """Stage 1 as the stages that keep flat buffers per param group (0-2), stage 3 as the one that keeps units."""
    return {(stage, first): with_an_empty_param_group(stage, first) for stage in (1, 3) for first in (True, False)}


@pytest.mark.slow
def test_an_empty_param_group_anywhere_trains_as_torch_does_in_one_process():
    """torch's optimizers take an empty param group, so the engine does; the others keep their own
    hyper-parameters (a misplaced weight decay would show)."""
    runs = spawn_gloo(empty_group_runs, 2)[0]
    expected = {first: with_an_empty_param_group(None, first) for first in (True, False)}
    for (stage, first), weights in runs.items():
        assert max_diff(weights, expected[first]) < FP32_TOL, (stage, first)


def lion(model: torch.nn.Module) -> torch.optim.Optimizer:
    """lion-pytorch's Lion, an optimizer of another library as users bring one (decoupled weight decay: a setting it
    keeps outside its param groups)."""
    from lion_pytorch import Lion

    return Lion(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)


def lion_runs() -> dict[int, dict[str, torch.Tensor]]:
    return {stage: mlp_steps(stage, lion) for stage in (1, 2, 3)}


@pytest.mark.slow
def test_an_optimizer_of_another_library_trains_as_in_one_process():
    """lion-pytorch's Lion steps the engine's shards at stages 1-3 as it steps the whole model in one process: the
    engine keeps the user's own optimizer, its class and what it holds outside its param groups."""
    runs = spawn_gloo(lion_runs, 2)[0]
    expected = mlp_steps(None, lion)
    for stage, weights in runs.items():
        assert max_diff(weights, expected) < FP32_TOL, stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_1_without_process_group_matches_plain_training(stage):
    ref = train_single_process("gpt2", steps=3, global_batch=4)["params"]
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": stage, "reduce_bucket_size": 3000})
    for step in range(3):
        b = batch("gpt2", step, 4)
        engine.backward(engine(**b).loss)
        engine.step()
    with engine.gathered_parameters():
        assert max_diff(named_copy(model), ref) < 1e-6


def test_stage3_eval_forward_with_and_without_grad_matches_the_unpartitioned_model():
    reference = tiny_model("gpt2").eval()
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3}).eval()
    b = batch("gpt2", 0, 4)
    expected = reference(**b).logits
    with torch.no_grad():
        assert torch.allclose(engine(**b).logits, expected, atol=1e-6)
    out = engine(**b)  # with grad, never back-propagated: units must still be freed
    assert torch.allclose(out.logits, expected, atol=1e-6)
    assert all(p.numel() == 0 for p in model.transformer.h.parameters()), "blocks are freed after forward"


def test_loss_backward_outside_the_engine_is_refused():
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
    with pytest.raises(RuntimeError, match="engine.backward"):
        engine(**batch("gpt2", 0, 2)).loss.backward()


@pytest.mark.parametrize("own, model_on", [("cuda:0", "cuda:1"), ("cpu", "cuda:0"), ("cuda:1", "cuda:1")])
def test_a_model_on_another_accelerator_than_the_process_computes_on_is_refused(monkeypatch, own, model_on):
    """A torchrun script that does model.to(f"cuda:{LOCAL_RANK}") without torch.cuda.set_device: the engine's
    collectives and streams would all go to GPU 0. The check reads only where the parameters are, so
    a stand-in parameter carries the device here, on a machine without one."""
    from types import SimpleNamespace

    from hf_zero.engine import setup as engine_setup

    class OnAnAccelerator(torch.nn.Module):
        def parameters(self, recurse=True):
            return iter([SimpleNamespace(device=torch.device(model_on), is_meta=False)])

    monkeypatch.setattr(engine_setup, "compute_device", lambda: torch.device(own))
    if own == model_on:
        engine_setup.check_model(OnAnAccelerator(), None)  # its own accelerator: accepted
        return
    with pytest.raises(ZeroConfigError, match=rf"the model is on {model_on} but this process computes on {own}: "
                                              r"call torch.cuda.set_device\(local_rank\)"):
        engine_setup.check_model(OnAnAccelerator(), None)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moving_the_model_after_initialize_is_refused_instead_of_training_stale_buffers(stage):
    """model.to('cpu:0') copies every parameter; the engine would go on stepping buffers the model no longer reads."""
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": stage})
    model.to(torch.device("cpu", 0))
    with pytest.raises(RuntimeError, match=r"no longer live in the engine's flat buffers: model.to\(...\)"):
        engine.backward(engine(**batch("gpt2", 0, 4)).loss)


def test_non_finite_gradients_skip_the_step_in_plain_words_and_training_stops_after_the_limit(caplog):
    """fp32: a NaN loss skips the step (no loss-scale wording: there is no loss scale), a finite step resets
    the count, and max_skipped_steps_in_a_row skipped steps in a row stop training with an error."""
    import logging

    from hf_zero.engine import NonFiniteGradientsError

    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "max_skipped_steps_in_a_row": 3})

    def step(poisoned: bool, number: int) -> None:
        loss = engine(**batch("gpt2", number, 4)).loss
        engine.backward(loss * float("nan") if poisoned else loss)
        engine.step()

    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        for number, poisoned in enumerate([True, True, False, True, True]):
            step(poisoned, number)
        assert engine.skipped_steps == 4
        before = named_copy(model)
        with pytest.raises(NonFiniteGradientsError, match=r"3 optimizer steps in a row were skipped because the "
                                                          r"gradients were not finite.*max_skipped_steps_in_a_row"):
            step(True, 5)
    assert max_diff(named_copy(model), before) == 0.0
    warnings = hf_zero_messages(caplog.records)
    assert len(warnings) == 5
    assert all("the gradients are not finite" in w and "loss scale" not in w for w in warnings)


def test_what_each_rank_holds_is_logged_after_the_first_step_not_before_it(caplog):
    """Before the first step no gradient or optimizer state exists yet: a report then would read zeros."""
    import logging

    model = tiny_model("gpt2")
    with caplog.at_level(logging.INFO, logger="hf_zero"):
        engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2})
        assert not [r for r in caplog.records if " holds " in r.getMessage()]
        for step in range(2):
            engine.backward(engine(**batch("gpt2", step, 4)).loss)
            engine.step()
    reports = [r.getMessage() for r in caplog.records if " holds " in r.getMessage()]
    assert len(reports) == 1, "once, after the first step"
    assert "gradients 0.00 MiB" not in reports[0] and "optimizer_states 0.00 MiB" not in reports[0], reports[0]


def test_in_bf16_buffers_have_the_dtypes_transformers_builds_them_with():
    """RoPE's inv_freq is a non-persistent buffer the module computes in fp32 and casts where it uses it;
    rounded to bf16 it would move every rotary angle. The reference is the model transformers builds in bf16."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "dtype": "bf16"})
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in reference.named_buffers()}
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def test_a_parameter_no_rank_used_is_refused_where_the_step_cannot_leave_it_untouched(tmp_path):
    """torch's optimizers skip a parameter without a gradient; NVMe states are stepped tile by tile over the
    whole shard and cannot skip its elements yet, so the engine says which parameter and what to do."""
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()),
                                {"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)})
    engine.backward(model["used"](torch.randn(2, 4)).sum())
    with pytest.raises(ValueError, match=r"no rank computed a gradient for unused.bias, unused.weight .*"
                                         r"offload_optimizer nvme cannot do yet. Set requires_grad=False"):
        engine.step()
