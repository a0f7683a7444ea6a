"""A training step's peak of device memory, stages 2-3 beside FSDP2 and plain torch (on an H100 stages 2-3
peaked at 31.5 GiB, FSDP2 at 28.9).

  python -m benchmarks.bench_step_peak
  python -m benchmarks.bench_step_peak --width 1024 --layers 12

On CPU, under hf_zero.runtime.device's simulation of a GPU, `DeviceMemory` counts every tensor storage the ops of a run
create, as `max_memory_allocated` does on a GPU: from before the model is built, so the resident states count too.
What it cannot see is what only the GPU path allocates or holds: buffers kept alive until another stream is done
with them, kernels' workspaces (cuBLAS's, per stream), GPU-only kernels' temporaries, the allocator's rounding. Each
system in a fresh process, in a one-rank gloo group: plain torch (fp32 weights, bf16 autocast, AdamW), FSDP2 (each
block and the root sharded, bf16 parameters, fp32 reduction), hf_zero stages 2 and 3 (bf16, fp32 masters). A GPT-2
of byte vocabulary, `--width` x `--layers`, micro-batch 4 x 128 tokens, two steps: "resident" is what the first step
leaves, "step peak" the second step's peak, both per parameter (16 bytes: the model states of mixed-precision
Adam). Plain torch is the reference: on CPU FSDP2 holds two live fp32 storages per parameter right after
`fully_shard`, which its GPU run may not. On a GPU, `benchmarks/gpu_evidence.py --memory_at_peak` says what is
alive at the peak, by where it was allocated.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEMS = ["torch", "fsdp2", "stage2", "stage3"]
BATCH, SEQ = 4, 128


def step_peak(system: str, width: int, layers: int) -> dict[str, float]:
    """(resident after a step, the next step's peak), in bytes per parameter, for `system` on this one rank."""
    import hf_zero
    import model_zoo
    from hf_zero.testing.simulated_gpu import DeviceMemory

    torch.manual_seed(0)
    with DeviceMemory() as memory:
        model = model_zoo.build("gpt2-tiny", n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                                n_positions=SEQ)
        psi = sum(p.numel() for p in model.parameters())
        if system == "stage2" or system == "stage3":
            engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                                        {"zero_stage": int(system[-1]), "dtype": "bf16"})

            def step(ids: torch.Tensor) -> None:
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
        else:
            if system == "fsdp2":
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for block in model.transformer.h:
                    fully_shard(block, mp_policy=policy)
                fully_shard(model, mp_policy=policy)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step(ids: torch.Tensor) -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=system == "torch"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        step(ids)
        resident = memory.storages.nbytes()
        memory.peak = resident
        step(ids)
    return {"psi": psi, "resident": resident / psi, "step_peak": memory.peak / psi}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    os.environ["HF_ZERO_SIMULATE_ASYNC"] = "early"
    from hf_zero.runtime.launch import spawn_gloo

    rows = {system: spawn_gloo(step_peak, 1, system, args.width, args.layers, start_method="spawn")[0]
            for system in SYSTEMS}
    psi = rows["torch"]["psi"]
    print(f"GPT-2 {args.layers} x {args.width} ({psi / 1e6:.1f}M parameters), micro-batch {BATCH} x {SEQ}, one rank, "
          f"the simulated device's memory in bytes per parameter")
    print("| system | resident after a step | step peak | step peak - plain torch's |")
    print("|---|---|---|---|")
    for system, row in rows.items():
        print(f"| {system} | {row['resident']:.2f} | {row['step_peak']:.2f} "
              f"| {row['step_peak'] - rows['torch']['step_peak']:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
