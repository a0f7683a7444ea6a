"""Shared test models, data and references.

Spawning gloo ranks costs seconds (each rank imports torch and transformers), so one spawn runs
many scenarios: `run_scenarios` trains each one in the same process group and returns what the
tests assert on. The references (single process, DDP) are computed from the same seed and data.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging

import hf_zero
from hf_zero.settings.environment import SIMULATE_ENV
from hf_zero.testing.simulated_gpu import install, uninstall

hf_logging.set_verbosity_error()
VOCAB, SEQ = 96, 16


def hf_zero_messages(records: list[logging.LogRecord]) -> list[str]:
    """What hf_zero itself logged, among everything a test captured (transformers logs too)."""
    return [r.getMessage() for r in records if r.name.split(".")[0] == "hf_zero"]


def tiny_model(kind: str) -> nn.Module:
    """Tiny GPT-2, BERT or Llama from transformers with dropout off, so that runs are deterministic.
    "-tp" kinds have 4 attention heads, so that tensor parallelism of 2 and 4 can split them (Llama: 8 heads sharing
    4 key-value heads, whose plan is transformers' own base_model_tp_plan)."""
    torch.manual_seed(0)
    if kind == "llama-tp":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=8,
                                            num_key_value_heads=4, intermediate_size=64, vocab_size=VOCAB,
                                            max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                            pad_token_id=0))
    heads = 4 if kind.endswith("-tp") else 2
    if kind.startswith("gpt2"):
        cfg = GPT2Config(n_layer=8 if kind == "gpt2-deep" else 2, n_embd=32, n_head=heads, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=heads, intermediate_size=64,
                     vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=3)
    return BertForSequenceClassification(cfg)


# How many tensors each converted model holds (its state dict, a tied weight once) and how many stock save_pretrained
# writes of it: transformers converts their checkpoints while loading and reverts the conversions when saving.
CONVERTED_TENSORS = {"mixtral": (21, 41), "qwen2_moe": (35, 55), "lara_mini": (33, 30)}


def tiny_converted_model(kind: str) -> nn.Module:
    """A tiny causal LM of a type transformers converts while loading, of vocabulary VOCAB:
    - "mixtral": experts stored one tensor per expert and projection (`block_sparse_moe.experts.0.w1.weight`),
      merged into one 3-D `mlp.experts.gate_up_proj` (w1 and w3) and `down_proj` (w2) per layer;
    - "qwen2_moe": the same merge of `mlp.experts.0.gate_proj.weight`, `up_proj` and `down_proj`;
    - "lara_mini": the other way round, one stored `linear_attn.in_proj.weight` split into four projections (saving
      concatenates them again), and `linear_attn.out_norm` renamed `norm`; its embeddings tied to its head."""
    import transformers as tf

    torch.manual_seed(0)
    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=32, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **sizes))
    if kind == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                        shared_expert_intermediate_size=48, **sizes))
    if kind == "lara_mini":
        return tf.LaraMiniForCausalLM(tf.LaraMiniConfig(
            layer_types=["linear_attention", "full_attention"], head_dim=8, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24,
            shared_expert_intermediate_size=24, num_experts=4, **sizes))
    raise ValueError(f"no tiny converted model {kind!r}; there are {', '.join(CONVERTED_TENSORS)}")


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder's safetensors file or shards."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    return {name: t for file in files for name, t in load_file(folder / file).items()}


def assert_saved_as_stock_saves(ours: Path, stock: Path) -> None:
    """The same tensor names, dtypes, shapes and bits, split into the same files."""
    mine, theirs = saved_tensors(ours), saved_tensors(stock)
    assert mine.keys() == theirs.keys(), (f"{ours} holds {len(mine)} tensors, stock's {len(theirs)}; only in "
                                          f"ours: {sorted(mine.keys() - theirs.keys())[:3]}, only in stock's: "
                                          f"{sorted(theirs.keys() - mine.keys())[:3]}")
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), f"{ours}: {name}"
    if (stock / "model.safetensors.index.json").is_file():
        assert json.loads((ours / "model.safetensors.index.json").read_text())["weight_map"] == \
            json.loads((stock / "model.safetensors.index.json").read_text())["weight_map"], f"{ours}: files"


def batch(kind: str, step: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    if kind.startswith(("gpt2", "llama")) or kind in CONVERTED_TENSORS:
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "labels": torch.randint(0, 3, (size,), generator=g)}


def local_part(b: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(world)[rank] for k, v in b.items()}


def make_optimizer(model: nn.Module, lr: float = 1e-3, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW with the usual two groups: decay for matrices, no decay for biases and norms. `fused`: torch's fused
    kernel, which the engine lets skip a non-finite step on the device (the host then does not wait for the norm)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, fused=fused or None)


def named_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32 (a tensor-parallel DTensor is gathered: every rank must call it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def assert_weights_round_the_masters(weights: dict[str, torch.Tensor], masters: dict[str, torch.Tensor],
                                     dtype: torch.dtype) -> None:
    """Each compute-dtype weight is its fp32 master rounded, within one ulp of the compute dtype (the host
    kernel and ATen may break a tie differently; nothing more may differ)."""
    for name, master in masters.items():
        rounded = master.to(dtype)
        ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"), dtype=dtype)) - rounded.abs()).float()
        assert torch.all((weights[name].float() - rounded.float()).abs() <= ulp), name


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def train_single_process(kind: str, steps: int, global_batch: int, dtype: torch.dtype = torch.float32,
                         micro_batches: int = 1, clip: float = 0.0, fused: bool = False) -> dict[str, Any]:
    """The reference: one process, the whole global batch, torch's own AdamW (and clip_grad_norm_).
    For bf16/fp16 it is the textbook recipe: compute-dtype model, fp32 master copy stepped by AdamW."""
    model = tiny_model(kind)
    return _train_plain(model, kind, steps, global_batch, dtype, 0, 1, micro_batches, clip, fused)


def train_ddp(kind: str, steps: int, global_batch: int, dtype: torch.dtype = torch.float32) -> dict:
    """The same recipe under torch's DistributedDataParallel (run inside a process group)."""
    model = tiny_model(kind)
    return _train_plain(model, kind, steps, global_batch, dtype, dist.get_rank(), dist.get_world_size())


def _train_plain(model, kind, steps, global_batch, dtype, rank, world, micro_batches=1, clip=0.0, fused=False):
    masters = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, fused=fused)
    if dtype != torch.float32:
        # Re-target the optimizer at fp32 masters and compute in `dtype`.
        by_id = {id(p): m for p, m in zip(model.parameters(), masters)}
        for group in optimizer.param_groups:
            group["params"] = [by_id[id(p)] for p in group["params"]]
        model.to(dtype)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    norms = []
    for step in range(steps):
        b = local_part(batch(kind, step, global_batch), rank, world)
        for mb in range(micro_batches):
            part = {k: v.chunk(micro_batches)[mb] for k, v in b.items()}
            (net(**part).loss / micro_batches).backward()
        if dtype != torch.float32:
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float()
        if clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
    return {"params": named_copy(model), "norms": norms}


@dataclass
class Scenario:
    name: str
    kind: str = "gpt2"
    config: dict[str, Any] = field(default_factory=dict)
    steps: int = 5
    global_batch: int = 8
    poison_step: int | None = None  # fp16: rank 1 makes one element owned by rank 0 inf at this step
    simulate: str | None = None  # run under hf_zero.runtime.device's simulation of a GPU ("late" or "early")
    fused: bool = False  # torch's fused AdamW (make_optimizer)


def run_scenarios(scenarios: list[Scenario]) -> dict[str, dict[str, Any]]:
    """Runs inside a process group: trains each scenario with hf_zero (or DDP when its name starts with
    'ddp'), returning final parameters, the ledger and per-step bookkeeping."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for sc in scenarios:
        if sc.name.startswith("ddp"):
            dtype = hf_zero.ZeroConfig(**sc.config).torch_dtype
            results[sc.name] = train_ddp(sc.kind, sc.steps, sc.global_batch, dtype)
            continue
        with simulated(sc.simulate):
            results[sc.name] = train_scenario(sc, rank, world)
    return results


@contextlib.contextmanager
def simulated(mode: str | None) -> Iterator[None]:
    """Asynchronous work inside runs as hf_zero.runtime.device's simulation `mode` has it (None: as the CPU runs it)."""
    with pytest.MonkeyPatch.context() as patch:
        if mode is None:
            patch.delenv(SIMULATE_ENV, raising=False)
        else:
            patch.setenv(SIMULATE_ENV, mode)
            install()  # the stream checker ("late") from here on, not from the first device work
        try:
            yield
        finally:
            uninstall()


@contextlib.contextmanager
def communicators_in_pieces_above(nbytes: int | None) -> Iterator[None]:
    """Every Communicator made inside issues its collectives in per-rank pieces above `nbytes` (0: at every size,
    gloo's path for large units; None: never, NCCL's single calls, which gloo takes too), whatever its backend."""
    from hf_zero.runtime.comm import Communicator

    with pytest.MonkeyPatch.context() as patch:
        init = Communicator.__init__

        def init_with_pieces(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.pieces_above_bytes = nbytes
        patch.setattr(Communicator, "__init__", init_with_pieces)
        yield


def train_scenario(sc: Scenario, rank: int, world: int) -> dict[str, Any]:
    """One hf_zero scenario of `run_scenarios`."""
    model = tiny_model(sc.kind)
    psi = sum(p.numel() for p in model.parameters())
    engine = hf_zero.initialize(model, make_optimizer(model, fused=sc.fused), sc.config)
    ga = engine.gradient_accumulation_steps
    record: dict[str, Any] = {"scales": [], "norms": [], "skipped": []}
    for step in range(sc.steps):
        hook = None
        if sc.poison_step == step and rank == 1:
            flat = engine.params.flats[0]
            target = flat.slices[0].param  # its element 0 sits in rank 0's chunk of bucket 0
            hook = target.register_hook(lambda g: g.index_put((torch.tensor([0]),) * g.dim(),
                                                              torch.tensor(float("inf"), dtype=g.dtype)))
        if sc.poison_step == step:
            with engine.gathered_parameters():
                record["before_poison"] = named_copy(model)
        b = local_part(batch(sc.kind, step, sc.global_batch), rank, world)
        for mb in range(ga):
            part = {k: v.chunk(ga)[mb] for k, v in b.items()}
            engine.backward(engine(**part).loss)
            engine.step()
        if hook is not None:
            hook.remove()
        record["scales"].append(engine.scaler.scale)
        record["norms"].append(engine.global_grad_norm)
        record["skipped"].append(engine.skipped_steps)
        if sc.poison_step == step:
            with engine.gathered_parameters():
                record["after_poison"] = named_copy(model)
    with engine.gathered_parameters():
        record["params"] = named_copy(model)
    record["masters"] = engine.gathered_masters()
    record["comm_elements"] = engine.ledger.last_step_elements
    record["events"] = engine.ledger.last_step_events
    record["peaks"] = engine.ledger.last_step_peaks
    record["state_bytes"] = engine.ledger.state_bytes
    flats = engine.params.flats
    record["padding"] = sum(f.padded_numel - f.numel for f in flats)
    record["psi"] = psi
    record["peak_buffer_bytes"] = getattr(engine.params.grads, "peak_buffer_bytes", 0)
    element = flats[0].data.element_size()
    group_bytes = sorted(sum(t.numel() for t in g["params"]) * world * element for g in engine.optimizer.param_groups)
    record["smaller_groups_bytes"] = sum(group_bytes[:-1])
    record["bucket_numels"] = [b.numel for f in flats for b in f.buckets]
    record["largest_bucket_bytes"] = max(b.numel for f in flats for b in f.buckets) * element
    record["root_numel"] = sum(f.numel for u in getattr(engine.params, "units", []) if u.is_root for f in u.flats)
    record["optimizer_tensors"] = sum(len(s) for s in engine.optimizer.state.values())
    return record


# The configurations whose GPU path tests/test_gpu.py checks against plain torch on CUDA, with each stream delayed,
# and tests/testing/test_simulated_gpu.py checks under the stream checker on CPU: every stage, and ZeRO-Offload's modes.
GPU_PATH_CONFIGS = [{"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
                    {"zero_stage": 2, "offload_optimizer": "cpu"},
                    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
                    {"zero_stage": 2, "offload_optimizer": "cpu", "delayed_param_update": True,
                     "delayed_param_update_warmup": 100}]


def config_id(config: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in config.items())


def sgd_steps(model: nn.Module, steps: int, config: dict) -> hf_zero.ZeroEngine | None:
    """`steps` SGD steps on the global batches of 8: in one process (returns None), or at stage 3 with `config`,
    each of 2 ranks on its half (returns the engine). SGD with momentum, not Adam: GPT-2's key bias gets a
    gradient of rounding noise only, which Adam would scale up to lr."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not torch.distributed.is_initialized():
        for step in range(steps):
            model(**batch("gpt2", step, 8)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return None
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "param_persistence_threshold": 0, **config})
    for step in range(steps):
        engine.backward(engine(**local_part(batch("gpt2", step, 8), engine.comm.rank, 2)).loss)
        engine.step()
    return engine
