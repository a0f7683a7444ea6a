"""Checkpoint runs for the tests: train, save at step k, load into a fresh engine, continue to step n."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import hf_zero
from hf_zero.checkpoint import MANIFEST, CheckpointError, sha256
from hf_zero.checkpoint import write as checkpoint_write
from tests.helpers import (
    batch,
    local_part,
    make_optimizer,
    max_diff,
    named_copy,
    tiny_model,
)

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
    original = checkpoint_write.save_file

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if rank_world()[0] == failing_rank:
        checkpoint_write.save_file = disk_full
    try:
        engine.save_checkpoint(folder)
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        checkpoint_write.save_file = original
    reloaded = new_engine({"zero_stage": 2})
    reloaded.load_checkpoint(folder)
    return {"error": error, "good": good, "reloaded": whole_params(reloaded),
            "partial_left": Path(folder + ".partial").exists()}


def rehash(folder: Path) -> None:
    """Makes the manifest's sizes and hashes match the shard files as they are now: a crafted checkpoint,
    which the file checks let through."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for shard in manifest["shards"]:
        if (folder / shard["file"]).is_file():
            shard["bytes"], shard["sha256"] = (folder / shard["file"]).stat().st_size, sha256(folder / shard["file"])
    (folder / MANIFEST).write_text(json.dumps(manifest))


def rewrite_shard(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrites a shard file with `change` applied to its tensors, and the manifest's hashes to match."""
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    rehash(path.parent)


def steps_like_a_fresh_engine(engine: hf_zero.ZeroEngine, config: dict[str, Any]) -> bool:
    """Whether `engine` (after a failed load) trains one step exactly as a fresh engine does: its masters,
    optimizer state and counters were left as they were."""
    fresh = new_engine(config)
    train(engine, 0, 1)
    train(fresh, 0, 1)
    return max_diff(whole_params(engine), whole_params(fresh)) == 0 and engine.global_steps == fresh.global_steps


def a_rank_cannot_read_its_shard(folder: str) -> dict[str, Any]:
    """Rank 1's file lacks the last tensor it holds, with the manifest re-hashed to match: the load fails on
    every rank alike, at once, and no rank's engine changes."""
    config = {"zero_stage": 2}
    engine = new_engine(config)
    train(engine, 0, SAVE_AT)
    engine.save_checkpoint(folder)
    if rank_world()[0] == 0:
        rewrite_shard(Path(folder) / "rank00001-of-00002.safetensors", lambda tensors: tensors.pop(sorted(tensors)[-1]))
    dist.barrier()
    loading = new_engine(config)
    try:
        loading.load_checkpoint(folder)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "unchanged": steps_like_a_fresh_engine(loading, config)}


def world2_checkpoint_runs(root: str) -> dict[str, Any]:
    results = {}
    for name, config in [("s0", {"zero_stage": 0}), ("s1", {"zero_stage": 1}), ("s2", {"zero_stage": 2}),
                         ("s3", {"zero_stage": 3}), ("s2_bf16", {"zero_stage": 2, "dtype": "bf16"}),
                         ("s1_fp16", {"zero_stage": 1, "dtype": "fp16"})]:
        results[name] = uninterrupted_and_resumed(config, f"{root}/{name}")
    results["s2_to_s3"] = uninterrupted_and_resumed({"zero_stage": 2}, f"{root}/s2_to_s3", {"zero_stage": 3})
    results["failing_save"] = failing_save(f"{root}/failing", failing_rank=1)
    results["unreadable_shard"] = a_rank_cannot_read_its_shard(f"{root}/unreadable")
    return results


def continue_on_this_world(root: str) -> dict[str, torch.Tensor]:
    return continue_from(f"{root}/s2", {"zero_stage": 2, "reduce_bucket_size": 1000})


PROBE_IDS = torch.arange(2 * 16).reshape(2, 16) % 96  # a fixed input whose logits the exports must reproduce


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same weights in another process: equal up to the order in which threads sum the matmuls."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def logits_of(engine: hf_zero.ZeroEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine(input_ids=PROBE_IDS).logits.float()


def consolidation_runs(root: str) -> dict[str, Any]:
    """Trained 2-rank engines (stage 3 fp32, stage 2 bf16) with their checkpoints, logits and whole
    parameters; the stage-3 one also writes its weights the way ZeroTrainer.save_model does."""
    from hf_zero.zero import stage3

    def frozen_positions_engine(stage: int, zeroed: bool = False) -> hf_zero.ZeroEngine:
        model = tiny_model("gpt2")
        model.transformer.wpe.weight.requires_grad_(False)
        if zeroed:  # then the positions can only come back from the checkpoint
            model.transformer.wpe.weight.data.zero_()
        trainable = [p for p in model.parameters() if p.requires_grad]
        return hf_zero.initialize(model, torch.optim.AdamW(trainable, lr=1e-3), {"zero_stage": stage})

    results = {}
    for name, config in [("s3", {"zero_stage": 3}), ("s2_bf16", {"zero_stage": 2, "dtype": "bf16"}),
                         ("s3_frozen_positions", {"zero_stage": 3}), ("s1_frozen_positions", {"zero_stage": 1})]:
        # A frozen parameter: partitioned at stage 3 and stored by each rank in part; whole at stage 1, stored by
        # rank 0. Each checkpoint is loaded at the other stage into an engine whose positions were zeroed.
        frozen = name.endswith("_frozen_positions")
        engine = frozen_positions_engine(config["zero_stage"]) if frozen else new_engine(config)
        train(engine, 0, SAVE_AT)
        engine.save_checkpoint(f"{root}/{name}")
        results[name] = {"logits": logits_of(engine), "params": whole_params(engine)}
        if frozen:
            engine.save_weights(f"{root}/{name}_saved_model", write=rank_world()[0] == 0)
            loading = frozen_positions_engine(4 - config["zero_stage"], zeroed=True)
            loading.load_checkpoint(f"{root}/{name}")
            results[name] |= {"loaded_logits": logits_of(loading), "loaded_params": whole_params(loading)}
    # How many non-persistent units are gathered at once while the weights are written.
    engine_s3 = new_engine({"zero_stage": 3})
    train(engine_s3, 0, SAVE_AT)
    gathered_at_once = []
    gather = stage3.Unit.gather

    def counting_gather(unit):
        gather(unit)
        gathered_at_once.append(sum(u.gathered and not u.persistent for u in engine_s3.params.units))

    stage3.Unit.gather = counting_gather
    try:
        engine_s3.save_weights(f"{root}/s3_saved_model", write=rank_world()[0] == 0, max_shard_size="20KB")
    finally:
        stage3.Unit.gather = gather
    results["s3_saved_model"] = {"logits": logits_of(engine_s3), "gathered_at_once": gathered_at_once,
                                 "units": len(engine_s3.params.units)}
    return results


LARGE_GPT2 = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, n_positions=128)  # 92M parameters, 366 MB fp32


def save_large_checkpoint(folder: str) -> int:
    """A stage-3 checkpoint of a 92M-parameter GPT-2 from 2 ranks (masters only: no step taken)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**LARGE_GPT2))
    engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {"zero_stage": 3})
    engine.save_checkpoint(folder)
    return max(s.numel for flats in engine.params.flats_by_group() for flat in flats for s in flat.slices)


def world4_checkpoint_runs(root: str) -> dict[str, Any]:
    """On 4 ranks: exact resume per stage, a save failing on rank 3, and a stage-3 checkpoint's logits."""
    results = {name: uninterrupted_and_resumed(config, f"{root}/{name}")
               for name, config in [("s1", {"zero_stage": 1}), ("s2", {"zero_stage": 2}), ("s3", {"zero_stage": 3})]}
    results["failing_save"] = failing_save(f"{root}/failing", failing_rank=3)
    engine = new_engine({"zero_stage": 3})
    engine.load_checkpoint(f"{root}/s3")
    results["s3_logits"] = logits_of(engine)
    return results


def crash_during_save(folder: str) -> None:
    """Run as a script: saves a checkpoint, trains on, then dies (os._exit) halfway through the next save."""
    import os

    engine = new_engine({"zero_stage": 1})
    train(engine, 0, SAVE_AT)
    engine.save_checkpoint(folder)
    train(engine, SAVE_AT, STOP)
    write = checkpoint_write.save_file

    def write_then_die(tensors, filename, *args, **kwargs):
        write(tensors, filename, *args, **kwargs)
        os._exit(17)

    checkpoint_write.save_file = write_then_die
    engine.save_checkpoint(folder)
