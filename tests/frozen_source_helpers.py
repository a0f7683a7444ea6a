"""LoRA engines on a base loaded from a pretrained folder, for tests/checkpoint/test_frozen_source.py (importable by spawned ranks)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import GPT2LMHeadModel

import hf_zero
from tests.checkpoint_helpers import SAVE_AT, STOP, rank_world, train, whole_params
from tests.helpers import tiny_model


def save_base(folder: Path) -> Path:
    """A tiny GPT-2 written by save_pretrained: the pretrained folder a LoRA run loads its base from."""
    tiny_model("gpt2").save_pretrained(folder)
    return folder


def put_in_hub_cache(folder: Path, cache: Path, repo_id: str, commit: str) -> Path:
    """`folder`'s files as huggingface_hub caches a download of `repo_id` at `commit` on its default branch (blobs
    named by SHA-256, the snapshot's files linking to them, refs/main naming the commit); the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in sorted(folder.iterdir()):
        blob = blobs / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def lora_engine(config: dict[str, Any], base: Path | str | None, zeroed: bool = False) -> hf_zero.ZeroEngine:
    """LoRA (r 4) on c_attn of the base loaded from `base` (or, with None, built from its config), its adapter
    initialised alike every time. `zeroed`: the base's weights zeroed after loading, so that only a checkpoint can
    give them back."""
    model = GPT2LMHeadModel.from_pretrained(base) if base is not None else tiny_model("gpt2")
    if zeroed:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    trained = [p for p in model.parameters() if p.requires_grad]
    return hf_zero.initialize(model, torch.optim.AdamW(trained, lr=1e-2), {"reduce_bucket_size": 3000, **config})


def frozen_whole(engine: hf_zero.ZeroEngine) -> dict[str, torch.Tensor]:
    """The frozen weights, whole, named as in the base's safetensors file (peft's prefix and base_layer dropped)."""
    return {n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in whole_params(engine).items()
            if "lora_" not in n}


def read_base(base: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def lora_resume(config: dict[str, Any], base: Path | str, folder: str) -> dict[str, Any]:
    """A LoRA engine on `base` trained straight to STOP, against one trained to SAVE_AT, saved in `folder` and resumed
    into a fresh engine whose base was zeroed, trained on to STOP: both runs' parameters, and the frozen weights the
    resume loaded."""
    straight = lora_engine(config, base)
    train(straight, 0, STOP)
    first = lora_engine(config, base)
    train(first, 0, SAVE_AT)
    first.save_checkpoint(folder)
    resumed = lora_engine(config, base, zeroed=True)
    resumed.load_checkpoint(folder)
    loaded_frozen = frozen_whole(resumed)
    train(resumed, SAVE_AT, STOP)
    return {"straight": whole_params(straight), "resumed": whole_params(resumed), "loaded_frozen": loaded_frozen}


def resume_runs(root: str, base: str) -> dict[str, Any]:
    """On this world: `lora_resume` at stages 1 and 3; the stage-3 checkpoint is kept for loading elsewhere."""
    results = {}
    for stage in (1, 3):
        folder = f"{root}/stage{stage}-world{rank_world()[1]}"
        results[stage] = {**lora_resume({"zero_stage": stage}, Path(base), folder), "folder": folder}
    return results


def continue_lora(folder: str, base: str, config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint saved elsewhere, loaded into an engine whose base was zeroed, trained on to STOP."""
    engine = lora_engine(config, Path(base), zeroed=True)
    engine.load_checkpoint(folder)
    loaded_frozen = frozen_whole(engine)
    train(engine, SAVE_AT, STOP)
    return {"loaded_frozen": loaded_frozen, "params": whole_params(engine)}


def lora_trainer(base: Path, out: Path, max_steps: int, zero: dict[str, Any] | None, resume: bool = False) -> Any:
    """A LoRA run of the Trainer on the base from `base`, checkpointing every 2 steps: ZeroTrainer with the
    engine settings `zero`, or with None the stock Trainer (no hf_zero)."""
    from transformers import Trainer, TrainingArguments

    from hf_zero import ZeroTrainer
    from tests.trainer_helpers import lm_examples
    from training_args import ZeroTrainingArguments

    torch.manual_seed(1)
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    settings = dict(output_dir=str(out), use_cpu=True, report_to=[], max_steps=max_steps, save_strategy="steps",
                    save_steps=2, per_device_train_batch_size=4, disable_tqdm=True, learning_rate=1e-2)
    if zero is None:
        trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=lm_examples(16, seed=1))
    else:
        trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(**settings, **zero),
                              train_dataset=lm_examples(16, seed=1))
    trainer.train(resume_from_checkpoint=True if resume else None)
    return trainer


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def hub_lora_resumes(cache: str, repo_id: str, root: str) -> bool:
    """On this world, offline, with the Hub cache `cache` holding `repo_id`: `lora_resume` at stage 3 on that base,
    whether the resumed run's parameters are the straight run's."""
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_CACHE, huggingface_hub.constants.HF_HUB_OFFLINE = cache, True
    os.environ["HF_HUB_OFFLINE"] = "1"
    run = lora_resume({"zero_stage": 3}, repo_id, f"{root}/ckpt")
    return all(torch.equal(p, run["straight"][n]) for n, p in run["resumed"].items())
