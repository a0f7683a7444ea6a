"""generate() at stage 3 beside stock generate(): the time of a greedy generation on 2 gloo ranks, each
rank generating its own batch, as the Trainer's predict_with_generate does.

  python -m benchmarks.bench_generate --repeats 3

Models: small T5 (encoder-decoder, whose generate() calls the encoder outside the model's forward) and GPT-2 from
transformers' configs, 4 blocks each. Systems: "stock" (the model alone on each rank, no engine), stage 3 with the
default generation_max_live_parameters (each unit gathered once per generate() call, and no synced_gpus, as
ZeroSeq2SeqTrainer decides when every unit fits), and stage 3 with it at 0 (each unit gathered for every token's
forward with synced_gpus's all-reduce per token). Round-robin, medians; the ratio is to stock.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_zero  # noqa: E402
from hf_zero.runtime.launch import spawn_gloo  # noqa: E402

SYSTEMS = {"stock": None, "stage3": {"zero_stage": 3}, "stage3_per_forward": {"zero_stage": 3,
                                                                            "generation_max_live_parameters": 0}}
BATCH, PROMPT, NEW_TOKENS = 8, 16, 32


def build(kind: str) -> torch.nn.Module:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    if kind == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=4,
                                                   num_heads=4, decoder_start_token_id=0, dropout_rate=0.0))
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def time_generate(kind: str, system: str) -> float:
    model = build(kind)
    config = SYSTEMS[system]
    synced = False
    if config is not None:
        engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        model, synced = engine.module, not engine.params.keeps_every_unit()  # as ZeroSeq2SeqTrainer
    model.eval()
    ids = torch.randint(1, 512, (BATCH, PROMPT), generator=torch.Generator().manual_seed(dist.get_rank()))
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                  synced_gpus=synced)
    model.generate(ids, **kwargs)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    found: dict[str, dict[str, list[float]]] = {kind: {s: [] for s in SYSTEMS} for kind in ("t5", "gpt2")}
    for _ in range(args.repeats):
        for kind, systems in found.items():
            for system, times in systems.items():
                times.append(max(spawn_gloo(time_generate, 2, kind, system, start_method="spawn")))
    medians = {kind: {s: statistics.median(t) for s, t in systems.items()} for kind, systems in found.items()}
    print(json.dumps(medians, indent=1))
    if args.json:
        args.json.write_text(json.dumps(medians, indent=1))
    print(f"\n2 gloo ranks, {BATCH} sequences of {PROMPT} tokens each, {NEW_TOKENS} new tokens, greedy; "
          f"medians of {args.repeats}")
    print("| model | system | generate() (s) | x stock |")
    print("|---|---|---|---|")
    for kind, systems in medians.items():
        for system, seconds in systems.items():
            print(f"| {kind} | {system} | {seconds:.3f} | {seconds / systems['stock']:.2f} |")


if __name__ == "__main__":
    main()
