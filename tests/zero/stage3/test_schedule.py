"""Stage 3's schedule (hf_zero/zero/stage3/schedule.py) whatever the model does: every rank issues one sequence
of collectives when some ranks skip part of a unit (a mixture of experts, a conditional branch), prefetch follows
the order of the step being run, and units recomputed by activation checkpointing that wraps a whole unit's
__call__ (the recomputation in backward runs the unit's forward hooks again) are gathered once more each."""
from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from tests.helpers import VOCAB, named_copy, sgd_steps, tiny_model

WIDTH, BATCH = 16, 8


class Block(nn.Module):
    """A block with an expert that a micro-batch may skip (a token routed elsewhere, a branch not taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, expert: str) -> torch.Tensor:
        """`expert`: "use" it, "skip" it (not run: no gradient), or "mute" it (run and weighted by zero: a
        gradient of zeros)."""
        h = torch.tanh(self.inner(x))
        if expert == "skip":
            return h
        return h + (0.0 if expert == "mute" else 1.0) * self.expert(h)


class Branchy(nn.Module):
    """Blocks (the stage-3 units) run in the order asked for, each skipping its expert when asked; `tied` makes
    the head read the first block's inner weight too (a weight two units use)."""

    def __init__(self, blocks: int, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, WIDTH)
        if tied:
            self.head.weight = self.blocks[0].inner.weight

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = (), mute: tuple[int, ...] = (),
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        for i in order if order is not None else range(len(self.blocks)):
            x = self.blocks[i](x, expert="skip" if i in skip else "mute" if i in mute else "use")
        return self.head(x).pow(2).mean()


def inputs(step: int, rank: int, world: int) -> torch.Tensor:
    whole = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(100 + step))
    return whole.chunk(world)[rank]


def train(plan: dict) -> dict:
    """`plan["steps"][s][r]`: what rank r's forward does at step s (the blocks whose expert it skips, and the
    blocks' order). In one process (no process group): the mean of every rank's loss on its part, the
    gradient ZeRO's average of the ranks' gradients must equal. Returns each step's losses and the weights."""
    model = Branchy(plan["blocks"], plan.get("tied", False))
    # SGD, not Adam: Adam would scale qwZ's and qgZ's quantization noise in a tiny gradient up to lr. "fused":
    # torch's fused AdamW, with which the engine lets the device decide the step (docs/device.md); betas 0, so that
    # an expert's step count (its chunk's in a shard, its own in one process: docs/zero.md, Limits) does not
    # matter, and a large eps, so that a tiny gradient is not scaled up to lr.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.0, 0.0), eps=1e-3, weight_decay=0.1,
                                  fused=True) if plan.get("fused") else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = plan["steps"]
    world = len(steps[0])
    if not torch.distributed.is_initialized():
        losses = []
        for s, per_rank in enumerate(steps):
            rank_losses = [model(inputs(s, r, world), **per_rank[r]) for r in range(world)]
            torch.stack(rank_losses).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append([loss.item() for loss in rank_losses])
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    engine = hf_zero.initialize(model, optimizer, {"param_persistence_threshold": 0, **plan["config"]})
    rank = engine.comm.rank
    losses, gathers, prefetched, most_gathered = [], [], [], []
    for s, per_rank in enumerate(steps):
        loss = engine(inputs(s, rank, world), **per_rank[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        gathers.append(engine.ledger.last_step_events.get("unit all-gathers", 0))
        prefetched.append(engine.ledger.last_step_events.get("units prefetched", 0))
        most_gathered.append(engine.ledger.last_step_peaks.get("units gathered", 0))
    with engine.gathered_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "gathers": gathers, "prefetched": prefetched,
            "most_gathered": most_gathered}


def assert_trains_as_one_process(plan: dict, world: int, tolerance: float = 1e-5) -> list[dict]:
    """Every step's loss on each rank and the final weights, against one process."""
    expected = train(plan)
    results = spawn_gloo(train, world, plan)
    for rank, result in enumerate(results):
        for s, step_losses in enumerate(expected["losses"]):
            assert abs(result["losses"][s] - step_losses[rank]) < tolerance, (plan["config"], s, rank)
        diff = max((result["params"][n] - expected["params"][n]).abs().max().item() for n in expected["params"])
        assert diff < tolerance, (plan["config"], diff)
    return results


BLOCKS = 3
CONFIGS = {  # stage 1 reduces as stage 2 does (reducer.py's one launch order): tests/zero/test_reducer.py has it
    "stage2": {"zero_stage": 2, "reduce_bucket_size": 200},
    "stage3": {"zero_stage": 3},
    "stage3_hpz": {"zero_stage": 3, "ranks_per_node": 2, "hpz_partition_size": 2},
    # Each rank a node of its own, so that qgZ's all-to-all reduction is on.
    "stage3_qwz_qgz": {"zero_stage": 3, "ranks_per_node": 1, "quantized_weights": True, "quantized_gradients": True,
                       "quantization_block_size": 16},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("skipped", [1, 2])  # block 0's expert: its unit's gradients are the last of backward
def test_an_expert_one_rank_skips_trains_as_one_process(config, skipped):
    """Rank 0 skips the expert of one block, rank 1 uses every expert: the unit's reduction must not wait for a
    gradient rank 0 never computes, or rank 0's collectives pair with other ones of rank 1 (a hang). With qwZ
    and qgZ, whose int8 weights and gradients are within their quantization error of one process only, the run
    is also the same, bit for bit, as one where rank 0 runs the expert and weights it by zero (a gradient of
    zeros, which a skipped expert must stand for)."""
    plan = {"blocks": BLOCKS, "steps": [[{"skip": (skipped,)}, {}] for _ in range(3)], "config": CONFIGS[config]}
    quantized = "qwz" in config
    skipping = assert_trains_as_one_process(plan, 2, 2e-3 if quantized else 1e-5)
    if quantized:
        muted = spawn_gloo(train, 2, plan | {"steps": [[{"mute": (skipped,)}, {}] for _ in range(3)]})
        for skipped_run, muted_run in zip(skipping, muted):
            assert skipped_run["losses"] == muted_run["losses"]
            assert all(torch.equal(skipped_run["params"][n], muted_run["params"][n]) for n in muted_run["params"])


ORDERS = {"forward": (0, 1, 2, 3), "reversed": (3, 2, 1, 0)}
ORDER_OF_STEP = ["forward", "forward", "reversed", "reversed", "forward", "forward"]


@pytest.mark.parametrize("prefetch_bucket_size", [0, 50_000_000])
def test_prefetch_follows_the_order_of_the_step_being_run(prefetch_bucket_size):
    """Four blocks run forward for two steps, reversed for two, forward again: every step gathers each unit
    once for its forward and once for its backward, and holds as many gathered at once, as the same model whose
    order never changes (an order recorded once and kept gathers the reversed steps' units again, 9 gathers a
    step becoming 15, and holds all of them at once); and a step that repeats the order of the one before
    prefetches as much as the static model does."""
    config = {"zero_stage": 3, "prefetch_bucket_size": prefetch_bucket_size}
    static = spawn_gloo(train, 2, {"blocks": 4, "config": config,
                                   "steps": [[{"order": ORDERS["forward"]}] * 2 for _ in ORDER_OF_STEP]})
    plan = {"blocks": 4, "config": config, "steps": [[{"order": ORDERS[name]}] * 2 for name in ORDER_OF_STEP]}
    flipping = assert_trains_as_one_process(plan, 2)
    for static_run, flipping_run in zip(static, flipping):
        assert static_run["gathers"] == [2 * 4 + 1] * len(ORDER_OF_STEP)
        assert flipping_run["gathers"] == static_run["gathers"]
        assert flipping_run["most_gathered"] == static_run["most_gathered"]
        # A step in the order of the one before prefetches as much as the static model's: the order was learned
        # again (the flipping steps themselves stop prefetching where they leave the last step's order).
        again = [s for s in range(1, len(ORDER_OF_STEP)) if ORDER_OF_STEP[s] == ORDER_OF_STEP[s - 1]]
        assert [flipping_run["prefetched"][s] for s in again] == [static_run["prefetched"][s] for s in again]
        assert all(static_run["prefetched"][s] > 0 for s in again)


def random_plan(seed: int, world: int) -> dict:
    """A model of 2-5 blocks, maybe with a weight the head shares with a block, trained for 4 steps: each step
    runs the blocks in an order of its own (the same on every rank), each rank skipping experts of its own."""
    draw = random.Random(seed)
    blocks = draw.randint(2, 5)
    steps = []
    for _ in range(4):
        order = tuple(draw.sample(range(blocks), blocks))
        steps.append([{"order": order, "skip": tuple(b for b in range(blocks) if draw.random() < 0.4)}
                      for _ in range(world)])
    config = draw.choice([{"zero_stage": 2, "reduce_bucket_size": 300}, {"zero_stage": 3},
                          {"zero_stage": 3, "prefetch_bucket_size": 0},
                          {"zero_stage": 3, "ranks_per_node": 2, "hpz_partition_size": 2}])
    return {"blocks": blocks, "tied": draw.random() < 0.5, "steps": steps, "config": config}


SEEDS = os.environ.get("HF_ZERO_TEST_SEEDS", "0,1")  # more in a run of its own: HF_ZERO_TEST_SEEDS=0-99


def seeds() -> list[int]:
    if "-" in SEEDS:
        first, last = SEEDS.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(seed) for seed in SEEDS.split(",")]


@pytest.mark.parametrize("seed", seeds())
def test_models_whose_ranks_skip_and_reorder_at_random_train_as_one_process(seed):
    assert_trains_as_one_process(random_plan(seed, 4), 4)


def switch_transformers() -> nn.Module:
    """transformers' SwitchTransformers (one module per expert, each token routed to its top expert), tiny, every
    feed-forward a mixture of 4 experts, no jitter or dropout so that runs are deterministic."""
    from transformers import (
        SwitchTransformersConfig,
        SwitchTransformersForConditionalGeneration,
    )

    torch.manual_seed(0)
    config = SwitchTransformersConfig(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                      num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=64,
                                      encoder_sparse_step=1, decoder_sparse_step=1, router_jitter_noise=0.0,
                                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return SwitchTransformersForConditionalGeneration(config)


def seq2seq_batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    whole = {"input_ids": torch.randint(2, VOCAB, (4, 5), generator=g),
             "labels": torch.randint(2, VOCAB, (4, 5), generator=g)}
    return {k: v.chunk(world)[rank] for k, v in whole.items()}


def idle_experts(outputs: Any) -> set[tuple[str, int, int]]:
    """The (stack, layer, expert) that no token was routed to (top-1 of the router's logits; no capacity drops)."""
    idle = set()
    for stack in ("encoder", "decoder"):
        for layer, logits in enumerate(getattr(outputs, f"{stack}_router_logits")):
            chosen = set(logits.argmax(-1).flatten().tolist())
            idle |= {(stack, layer, expert) for expert in range(logits.shape[-1]) if expert not in chosen}
    return idle


def train_switch(config: dict | None) -> dict:
    """3 SGD steps with the router's z-loss and load-balancing loss in the loss: in one process (config None) the
    mean of both ranks' losses on their halves, else at `config` on 2 ranks. Also returns, per step, which
    experts got no token (per rank, or per rank's half in one process)."""
    model = switch_transformers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ranks = [0, 1] if config is None else None
    if config is not None:
        model = hf_zero.initialize(model, optimizer, config)
        ranks = [model.comm.rank]
    losses, idle = [], []
    for step in range(3):
        outputs = [model(**seq2seq_batch(step, r, 2), output_router_logits=True) for r in ranks]
        idle.append([idle_experts(o) for o in outputs])
        loss = torch.stack([o.loss for o in outputs]).mean()
        if config is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.backward(loss)
            model.step()
        losses.append([o.loss.item() for o in outputs])
    if config is None:
        return {"losses": losses, "idle": idle, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    with model.gathered_parameters():
        params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "idle": idle, "params": params}


@pytest.fixture(scope="module")
def switch_one_process() -> dict:
    return train_switch(None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_switch_transformers_whose_ranks_leave_different_experts_idle_trains_as_one_process(stage, switch_one_process):
    expected = switch_one_process
    # The first layer backward reaches that has an idle expert differs between the ranks at some step: a
    # reduction waiting for the idle expert's gradient launched at the end of backward on one rank and during
    # backward on the other, among different all-gathers (a hang).
    backward_order = [("decoder", 1), ("decoder", 0), ("encoder", 1), ("encoder", 0), None]
    first_idle = [[next(at for at in backward_order if at is None or any(i[:2] == at for i in rank_idle))
                   for rank_idle in step_idle] for step_idle in expected["idle"]]
    assert any(first[0] != first[1] for first in first_idle)
    for rank, result in enumerate(spawn_gloo(train_switch, 2, {"zero_stage": stage})):
        assert result["idle"] == [[step_idle[rank]] for step_idle in expected["idle"]]
        assert all(abs(result["losses"][s][0] - expected["losses"][s][rank]) < 1e-5 for s in range(3))
        assert max((result["params"][n] - expected["params"][n]).abs().max().item() for n in expected["params"]) < 1e-5


def bart(layerdrop: float) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop, dropout=0.0, attention_dropout=0.0))


def train_bart_with_layer_drop(stage: int) -> list[float]:
    """4 steps of BART with LayerDrop 0.5 (each rank drawing its own layers to skip)."""
    model = bart(0.5)
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": stage})
    torch.manual_seed(engine.comm.rank)
    losses = []
    for step in range(4):
        loss = engine(**seq2seq_batch(step, engine.comm.rank, 2)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_layer_drop_is_refused_at_stage3_naming_the_settings_and_trains_at_stage2():
    model = bart(0.5)
    refused = (r"LayerDrop \(decoder_layerdrop=0.5, encoder_layerdrop=0.5\).*config.decoder_layerdrop = 0 and "
               r"config.encoder_layerdrop = 0.*--zero_stage 2")
    with pytest.raises(ValueError, match=refused):
        hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3})
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses in spawn_gloo(train_bart_with_layer_drop, 2, 2))


CHECKPOINTED_STEPS, CHECKPOINTED_WIDTH = 3, 32


class Checkpointed(nn.Module):
    """Four blocks (stage-3 units), each run through torch.utils.checkpoint by the model itself."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        width = CHECKPOINTED_WIDTH
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(CHECKPOINTED_WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if self.mode == "none" else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x).pow(2).mean()


def checkpointed_batch(step: int) -> torch.Tensor:
    """Requires grad, so that reentrant checkpointing (which needs an input that does) trains every block."""
    return torch.randn(8, CHECKPOINTED_WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()


def run_checkpointed(mode: str) -> dict:
    model = Checkpointed(mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if not torch.distributed.is_initialized():  # the reference: one process, whole batch
        for step in range(CHECKPOINTED_STEPS):
            model(checkpointed_batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "param_persistence_threshold": 0})
    rank = engine.comm.rank
    with set_checkpoint_early_stop(False):  # recompute the whole block, as FSDP2 documents the hazard with
        for step in range(CHECKPOINTED_STEPS):
            engine.backward(engine(checkpointed_batch(step).detach()[rank * 4:(rank + 1) * 4].requires_grad_()))
            engine.step()
    gathered = engine.ledger.last_step_elements.get("all_gather", 0)
    with engine.gathered_parameters():
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "all_gather": gathered}


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_stage3_units_recomputed_by_checkpointing_train_as_one_process_with_two_gathers_each(mode):
    expected = run_checkpointed(mode)
    first_block = "blocks.0.0.weight"  # trained: the recomputation's gradients reach the first block
    assert (expected[first_block] - Checkpointed(mode).state_dict()[first_block]).abs().max() > 1e-4
    plain = spawn_gloo(run_checkpointed, 2, "none")[0]
    for result in spawn_gloo(run_checkpointed, 2, mode):
        assert max((result["params"][n] - expected[n]).abs().max().item() for n in expected) < 1e-6
        assert result["all_gather"] == plain["all_gather"]  # once for forward, once for backward, per unit


def train_deep(prefetch_bucket_size: int) -> dict:
    """2 steps of the 8-block GPT-2 (sgd_steps)."""
    model = tiny_model("gpt2-deep")
    engine = sgd_steps(model, 2, {"prefetch_bucket_size": prefetch_bucket_size})
    if engine is None:
        return named_copy(model)
    ledger = engine.ledger
    with engine.gathered_parameters():
        return {"params": named_copy(model), "gathers": ledger.last_step_events["unit all-gathers"],
                "most_gathered": ledger.last_step_peaks["units gathered"]}


@pytest.mark.parametrize("prefetch_bucket_size, most_gathered", [(1, 3), (50_000_000, 9)])
def test_the_next_unit_is_prefetched_even_when_it_exceeds_the_prefetch_budget(prefetch_bucket_size, most_gathered):
    """With a budget smaller than any unit, the root (kept through forward), the running block and the next
    one are gathered at once; with the default budget every block of this small model is."""
    expected = train_deep(0)
    for result in spawn_gloo(train_deep, 2, prefetch_bucket_size):
        assert max((result["params"][n] - expected[n]).abs().max().item() for n in expected) < 1e-6
        assert result["most_gathered"] == most_gathered
        assert result["gathers"] == 2 * 8 + 1  # each block for forward and backward, the root once


def test_with_a_fused_optimizer_an_expert_no_rank_uses_is_left_as_it_was():
    """Both ranks skip block 1's expert at step 1, rank 0 alone block 2's at step 2 (fused AdamW, which the device
    skips on its own): the ranks that left a parameter unused read the ranks' flags back, the others know without
    reading that none went unused everywhere; the expert no rank used stays as torch leaves a parameter without a
    gradient (weight decay would move it), the one rank 1 used steps with the ranks' average."""
    steps = [[{}, {}], [{"skip": (1,)}, {"skip": (1,)}], [{"skip": (2,)}, {}], [{}, {}]]
    assert_trains_as_one_process({"blocks": BLOCKS, "steps": steps, "config": CONFIGS["stage3"], "fused": True}, 2)


@pytest.mark.parametrize("order", [(0, 1, 2, 1), (0, 1, 0, 2)])
def test_a_block_run_twice_in_a_forward_reduces_once_both_uses_backward_is_done(order):
    """A block runs twice in a forward (a layer two positions share, as ALBERT's): its gradients come from both
    uses, so its reduction waits for the second post-backward, the first use's; or, when the first use reads the
    model's inputs (nothing requires grad there to mark its end), for the end of backward. Rank 0 also skips the
    block's expert at one step."""
    steps = [[{"order": order, "skip": (order[-1],) if s == 1 else ()}, {"order": order}] for s in range(3)]
    assert_trains_as_one_process({"blocks": 3, "steps": steps, "config": {"zero_stage": 3}}, 2)


def switch_examples(count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(2, VOCAB, (5,), generator=g),
             "labels": torch.randint(2, VOCAB, (5,), generator=g)} for _ in range(count)]


def with_router_losses(features: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The default collator, asking the model for its router's z-loss and load-balancing loss too."""
    from transformers import default_data_collator

    return {**default_data_collator(features), "output_router_logits": True}


def trainers_on_switch_transformers(stages: list[int]) -> dict[str | int, dict[str, list[float]]]:
    """6 steps of transformers' Seq2SeqTrainer (DDP, finding the experts a rank left unused; under "stock") and of
    ZeroSeq2SeqTrainer at each of `stages` (under the stage): their logged losses and gradient norms. SGD with
    clipping."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_zero import ZeroSeq2SeqTrainer
    from training_args import ZeroSeq2SeqTrainingArguments

    results = {}
    for name in ["stock", *stages]:
        with tempfile.TemporaryDirectory() as output_dir:
            common = dict(output_dir=output_dir, per_device_train_batch_size=2, max_steps=6, learning_rate=1e-2,
                          optim="sgd", max_grad_norm=1.0, logging_steps=1, save_strategy="no", use_cpu=True,
                          report_to=[], seed=0, disable_tqdm=True)
            if name == "stock":
                # SwitchTransformers' loss ignores num_items_in_batch: with token averaging on, stock would multiply
                # each rank's mean loss by the number of ranks, where hf_zero trains as one process would
                # (docs/trainer.md). Off, stock DDP averages the ranks' means: on these equal-length examples,
                # one process's loss.
                args = Seq2SeqTrainingArguments(ddp_find_unused_parameters=True, average_tokens_across_devices=False,
                                                **common)
                trainer_class = Seq2SeqTrainer
            else:
                args, trainer_class = ZeroSeq2SeqTrainingArguments(zero_stage=name, **common), ZeroSeq2SeqTrainer
            trainer = trainer_class(model=switch_transformers(), args=args, train_dataset=switch_examples(24),
                                    data_collator=with_router_losses)
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            results[name] = {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}
    return results


def test_the_trainer_fine_tunes_switch_transformers_at_stages_1_to_3_as_stock_ddp_does():
    """Stock DDP is the reference here, not one process on the global batch: the router's losses are each rank's
    own (its tokens' load balance), as under any data parallelism. SGD, not Adam: with Adam an expert that first
    gets a gradient at a later step is stepped with the bias correction of its chunk's step count, not its own
    (docs/zero.md, Limits)."""
    for result in spawn_gloo(trainers_on_switch_transformers, 2, [1, 2, 3]):
        stock = result["stock"]
        for stage in (1, 2, 3):
            zero = result[stage]
            assert len(zero["losses"]) == 6
            assert zero["losses"] == pytest.approx(stock["losses"], rel=1e-6, abs=1e-6), stage
            assert zero["grad_norms"] == pytest.approx(stock["grad_norms"], rel=1e-6, abs=1e-6), stage


# Where the ranks part. At the first step no order is known, and rank 0 gathers block 2 where rank 1 gathers block
# 1. Later, rank 0's forward still gathers block 1 (prefetched in the order of the step before) and the ranks part
# at the reduction of block 1's gradients, which rank 0 never reaches.
PARTING = {
    0: r"rank 0: all_gather .* for the forward gather of unit 'blocks.2'; "
       r"rank 1: all_gather .* for the forward gather of unit 'blocks.1'",
    2: r"rank 0: reduce_scatter .* for the reduction of the gradients of the root unit; "
       r"rank 1: reduce_scatter .* for the reduction of the gradients of unit 'blocks.1'",
}


@pytest.mark.parametrize("skipping_step", sorted(PARTING))
def test_a_unit_one_rank_skips_at_any_step_stops_every_rank_naming_the_units(skipping_step):
    """Rank 0 runs blocks 0 and 2 at `skipping_step`, rank 1 every block: the units themselves differ (as an expert
    made a unit of its own would), which no schedule can pair. Every rank stops at the first collective where they
    part (hf_zero.runtime.comm's sequence check), naming it on each rank, instead of hanging or mixing the blocks."""
    every_block = [{"order": (0, 1, 2)}, {"order": (0, 1, 2)}]
    plan = {"blocks": 3, "steps": [every_block] * skipping_step + [[{"order": (0, 2)}, {"order": (0, 1, 2)}]],
            "config": {"zero_stage": 3}}
    with pytest.raises(Exception, match=rf"the ranks issued different collectives as collective #\d+ of their group "
                                        rf"of 2 \({PARTING[skipping_step]}\).*--zero_unit_module_classes"):
        spawn_gloo(train, 2, plan)


def rank_0_generates_alone() -> None:
    """What a script that generates samples on the main process only does: rank 0 calls generate() without
    synced_gpus while rank 1 goes on with other work (longer than the timeout, so that rank 0 is the one that
    fails first and says why)."""
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3})
    if torch.distributed.get_rank() == 0:
        engine.module.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    else:
        time.sleep(60)


def test_generate_on_one_rank_at_stage3_fails_within_seconds_naming_synced_gpus(monkeypatch):
    """Every forward at stage 3 gathers from every rank, so rank 0 alone waits for partners that never come: a
    failure within the collective timeout (5 s here) that says what to do, instead of a silent hang."""
    monkeypatch.setenv("HF_ZERO_COLLECTIVE_TIMEOUT", "5")
    with pytest.raises(Exception, match=r"rank 0: .* for the forward gather of .* did not complete: .*At ZeRO stage 3 "
                                        r"every rank must run each forward: generate\(\) on some ranks only \(rank 0, "
                                        r"say\) needs synced_gpus=True"):
        spawn_gloo(rank_0_generates_alone, 2)


def generate_at_stage3(limit: int | None, max_new_tokens: int = 6) -> dict[str, Any]:
    """Greedy generation of a tiny GPT-2 at stage 3 (`limit`: generation_max_live_parameters, None: the default),
    beside the same model's stock generate(): the tokens, the unit all-gathers it took, the units (and elements)
    gathered at most, and what stays gathered after."""
    stock = tiny_model("gpt2")
    prompt = torch.tensor([[1, 2, 3, 4]])
    expected = stock.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    model = tiny_model("gpt2")
    config = {"zero_stage": 3} if limit is None else {"zero_stage": 3, "generation_max_live_parameters": limit}
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    ledger = engine.ledger
    ledger.close_step()
    blocks = [u for u in engine.params.units if not u.is_root and not u.persistent]
    tokens = engine.module.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return {"same_tokens": torch.equal(tokens, expected), "gathers": ledger.events["unit all-gathers"],
            "blocks": len(blocks), "block_numel": blocks[0].numel,
            "peak_bytes": ledger.peaks["bytes of gathered units"], "block_bytes": blocks[0].nbytes,
            "root_bytes": next(u.nbytes for u in engine.params.units if u.is_root),
            "left_gathered": ledger.held["units gathered"]}


def test_generate_gathers_each_unit_once_per_call_within_its_live_parameter_limit():
    """Generate() runs a forward per token; at stage 3 each unit is gathered once per call and kept
    until it returns, as FSDP2 without resharding after forward, so long as the units kept stay within
    generation_max_live_parameters; beyond, units are gathered per forward again. The tokens are stock's."""
    tokens = 6
    kept = generate_at_stage3(None, tokens)
    per_forward = generate_at_stage3(0, tokens)
    one_block = generate_at_stage3(kept["block_numel"], tokens)
    for run in (kept, per_forward, one_block):
        assert run["same_tokens"] and run["left_gathered"] == 0
    blocks = kept["blocks"]
    assert kept["gathers"] == blocks + 1  # each block once, and the root
    assert per_forward["gathers"] == tokens * blocks + 1  # every block for every token's forward
    assert one_block["gathers"] == 1 + (tokens * (blocks - 1) + 1)  # the first block stays; the rest come again
    # The limit holds: at most the root, the kept block and the block in use (with the one prefetched) at once.
    assert one_block["peak_bytes"] <= one_block["root_bytes"] + 3 * one_block["block_bytes"]


@pytest.mark.parametrize("memory_left, kept_blocks", [(10**12, 2), (0, 0), ("one block", 1)])
def test_left_unset_the_live_parameter_limit_is_half_the_memory_the_rank_has_left(monkeypatch, memory_left,
                                                                                  kept_blocks):
    """Without generation_max_live_parameters, generate() keeps units gathered within half of what memory_left says
    the rank has (on a GPU the free memory after the step's peak, on a CPU the host's available memory per local
    rank): every unit where that is plenty, none where nothing is left, one where it holds one block."""
    block_bytes = generate_at_stage3(0)["block_bytes"]
    left = 2 * block_bytes + block_bytes // 2 if memory_left == "one block" else memory_left
    monkeypatch.setattr("hf_zero.runtime.memory.memory_left", lambda device, ranks: (left, "the test's figure"))
    run, blocks, tokens = generate_at_stage3(None), generate_at_stage3(0)["blocks"], 6
    assert run["same_tokens"] and run["left_gathered"] == 0
    # The root once, each kept block once, every other block for each token's forward.
    assert run["gathers"] == 1 + kept_blocks + tokens * (blocks - kept_blocks)


def generate_with_memory_of_rank(block_bytes: int) -> int:
    """Rank 0 has plenty of memory left, rank 1 room for one block (memory_left patched): the unit all-gathers of
    one generate() under the limit left to the engine."""
    from unittest import mock

    left = 10**12 if torch.distributed.get_rank() == 0 else 2 * block_bytes + block_bytes // 2
    with mock.patch("hf_zero.runtime.memory.memory_left", lambda device, ranks: (left, "the test's figure")):
        return generate_at_stage3(None)["gathers"]


def test_ranks_with_different_memory_left_keep_the_same_units_the_smallest_budgets():
    """Each kept unit is a gather fewer, so ranks that kept different units would issue different collectives: the
    limit left to the engine is the smallest rank's on every rank (one block here, on both)."""
    reference = generate_at_stage3(0)
    blocks, tokens = reference["blocks"], 6
    for gathers in spawn_gloo(generate_with_memory_of_rank, 2, reference["block_bytes"]):
        assert gathers == 1 + 1 + tokens * (blocks - 1)


def generate_own_prompt(limit: int) -> bool:
    """Each rank generates from a prompt of its own, twice, then runs a forward: whether its tokens are stock's. With
    every unit kept (ZeroSeq2SeqTrainer's case for leaving synced_gpus off) each rank goes its own way, its only
    collectives the first forward's gathers; else with synced_gpus the ranks run forwards together until all are
    done."""
    rank = torch.distributed.get_rank()
    prompt = torch.tensor([[1, 2, 3, 4, 5][: 2 + rank]])
    stock = tiny_model("gpt2")
    expected = stock.generate(prompt, max_new_tokens=5 + 3 * rank, do_sample=False, pad_token_id=0)
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                {"zero_stage": 3, "generation_max_live_parameters": limit})
    synced = not engine.params.keeps_every_unit()
    same = []
    for _ in range(2):
        tokens = engine.module.generate(prompt, max_new_tokens=5 + 3 * rank, do_sample=False, pad_token_id=0,
                                        synced_gpus=synced)
        same.append(torch.equal(tokens, expected))
    loss = engine(input_ids=prompt, labels=prompt).loss  # a forward after, as the Trainer's evaluation runs one
    return all(same) and torch.allclose(loss, stock(input_ids=prompt, labels=prompt).loss)


@pytest.mark.parametrize("limit", [0, 1_000_000_000])
def test_ranks_generating_different_lengths_stay_in_step_whatever_they_keep(limit):
    assert spawn_gloo(generate_own_prompt, 2, limit) == [True, True]
