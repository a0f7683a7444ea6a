"""Checkpoint runs for the tests: train, save at step k, load into a fresh engine, continue to step n."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hf_zero
from hf_zero import checkpoint
from tests.helpers import batch, local_part, make_optimizer, named_copy, tiny_model

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks, so every world size sees the same global batches
SAVE_AT, STOP = 3, 6


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def new_engine(config: dict[str, Any], kind: str = "gpt2") -> hf_zero.ZeroEngine:
    model = tiny_model(kind)
    return hf_zero.initialize(model, make_optimizer(model), {"reduce_bucket_size": 3000, **config})


def train(engine: hf_zero.ZeroEngine, start: int, stop: int, kind: str = "gpt2") -> None:
    rank, world = rank_world()
    for step in range(start, stop):
        engine.backward(engine(**local_part(batch(kind, step, GLOBAL_BATCH), rank, world)).loss)
        engine.step()


def whole_params(engine: hf_zero.ZeroEngine) -> dict[str, torch.Tensor]:
    with engine.gathered_parameters():
        return named_copy(engine.module)


def uninterrupted_and_resumed(config: dict[str, Any], folder: str, load_config: dict[str, Any] | None = None
                              ) -> dict[str, Any]:
    """Params after STOP steps straight through, and after saving at SAVE_AT and resuming in a fresh engine."""
    straight = new_engine(config)
    train(straight, 0, STOP)
    first = new_engine(config)
    train(first, 0, SAVE_AT)
    first.save_checkpoint(folder, client_state={"next_step": SAVE_AT})
    resumed = new_engine(load_config or config)
    client_state = resumed.load_checkpoint(folder)
    train(resumed, client_state["next_step"], STOP)
    return {"straight": whole_params(straight), "resumed": whole_params(resumed),
            "steps": (straight.global_steps, resumed.global_steps),
            "scales": (straight.scaler.scale, resumed.scaler.scale)}


def continue_from(folder: str, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Loads a checkpoint saved elsewhere (another world size or stage) and trains to STOP."""
    engine = new_engine(config)
    engine.load_checkpoint(folder)
    train(engine, SAVE_AT, STOP)
    return whole_params(engine)


def failing_save(folder: str, failing_rank: int) -> dict[str, Any]:
    """Saves a good checkpoint, then saves over it with `failing_rank` unable to write its shard."""
    engine = new_engine({"zero_stage": 2})
    train(engine, 0, SAVE_AT)
    engine.save_checkpoint(folder)
    good = whole_params(engine)
    train(engine, SAVE_AT, STOP)
    original = checkpoint.save_file

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if rank_world()[0] == failing_rank:
        checkpoint.save_file = disk_full
    try:
        engine.save_checkpoint(folder)
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    finally:
        checkpoint.save_file = original
    reloaded = new_engine({"zero_stage": 2})
    reloaded.load_checkpoint(folder)
    return {"error": error, "good": good, "reloaded": whole_params(reloaded),
            "partial_left": Path(folder + ".partial").exists()}


def world2_checkpoint_runs(root: str) -> dict[str, Any]:
    results = {}
    for name, config in [("s0", {"zero_stage": 0}), ("s1", {"zero_stage": 1}), ("s2", {"zero_stage": 2}),
                         ("s3", {"zero_stage": 3}), ("s2_bf16", {"zero_stage": 2, "dtype": "bf16"}),
                         ("s1_fp16", {"zero_stage": 1, "dtype": "fp16"})]:
        results[name] = uninterrupted_and_resumed(config, f"{root}/{name}")
    results["s2_to_s3"] = uninterrupted_and_resumed({"zero_stage": 2}, f"{root}/s2_to_s3", {"zero_stage": 3})
    results["failing_save"] = failing_save(f"{root}/failing", failing_rank=1)
    return results


def continue_on_this_world(root: str) -> dict[str, torch.Tensor]:
    return continue_from(f"{root}/s2", {"zero_stage": 2, "reduce_bucket_size": 1000})
