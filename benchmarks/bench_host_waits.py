"""How often a training step makes the host wait for the device (stages 2-3 against FSDP2 on one GPU).

  python -m benchmarks.bench_host_waits
  python -m benchmarks.bench_host_waits --ranks 2

A host that reads back a value the device computed (`.item()`, `.tolist()`, `torch.unique`'s size, a copy from
pageable memory) waits for the device's whole queue, and from then on feeds the device from behind. Plain torch and
FSDP2 read nothing back in a step. This counts, per step, what the host waits on, under hf_zero.runtime.device's
simulation of a GPU with its stream checker (`StreamChecker.host_waits`), on CPU: a stream's whole queue (a
read-back), or an event recorded in an earlier step (on a GPU long passed: the host does not stall). GPT-2 (the
zoo's tiny one), bf16 with fp32 masters, gradient clipping at 1.0, the third step of each run, each system on
`--ranks` gloo ranks in fresh processes. Plain torch (fused AdamW, clip_grad_norm_) runs on one rank only, the
reference. On a GPU, benchmarks/gpu_evidence.py counts the implicit synchronisations torch reports.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SYSTEMS = {"plain torch": None, **{f"stage {stage}, AdamW {kind}": (stage, kind == "fused")
                                   for stage in (1, 2, 3) for kind in ("for-loop", "fused")}}
STEPS, MEASURED = 3, 2


def host_waits(system: str) -> dict[str, int]:
    """The host's waits during step MEASURED of `system` on this rank: read-backs (a stream's whole queue) and waits
    on events from earlier steps."""
    import hf_zero
    from hf_zero.testing import simulated_gpu, stream_checker
    from tests.helpers import batch, local_part, make_optimizer, tiny_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model("gpt2")
    setting = SYSTEMS[system]
    simulated_gpu.install()  # the stream checker from here on, whatever the system
    if setting is None:
        masters = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(masters, lr=1e-3, fused=True)
        model.to(torch.bfloat16)

        def step(b: dict[str, torch.Tensor]) -> None:
            model(**b).loss.backward()
            for p, m in zip(model.parameters(), masters):
                m.grad = p.grad.float()
            torch.nn.utils.clip_grad_norm_(masters, 1.0)
            optimizer.step()
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
    else:
        stage, fused = setting
        engine = hf_zero.initialize(model, make_optimizer(model, fused=fused),
                                    {"zero_stage": stage, "dtype": "bf16", "gradient_clipping": 1.0})

        def step(b: dict[str, torch.Tensor]) -> None:
            engine.backward(engine(**b).loss)
            engine.step()
    checker = stream_checker.checker
    # Who read back: torch's for-loop Adam reads its step counts (`.item()`), which on a GPU are host tensors (not
    # fused, not capturable), so only on CPU are they the simulated device's memory: counted apart.
    by_the_optimizer, wait_stream = [], checker.wait_stream

    def attributed_wait_stream(waiting: str, waited: str) -> None:
        if waiting == simulated_gpu.HOST and waited != simulated_gpu.HOST:
            by_the_optimizer.append(any("torch/optim/" in frame.filename for frame in traceback.extract_stack()))
        wait_stream(waiting, waited)

    checker.wait_stream = attributed_wait_stream
    for number in range(STEPS):
        if number == MEASURED:
            before = checker.record(simulated_gpu.COMPUTE)
            checker.host_waits.clear()
            by_the_optimizer.clear()
        step(local_part(batch("gpt2", number, 8), rank, world))
        if number == MEASURED:
            waits = list(checker.host_waits)
    simulated_gpu.uninstall()
    return {"read-backs": by_the_optimizer.count(False), "optimizer step counts": by_the_optimizer.count(True),
            "earlier events": sum(not isinstance(w, str) and w <= before for w in waits),
            "this step's events": sum(not isinstance(w, str) and w > before for w in waits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    os.environ["HF_ZERO_SIMULATE_ASYNC"] = "late"
    from hf_zero.runtime.launch import spawn_gloo

    print(f"Host waits in one training step, {args.ranks} rank(s), under the stream checker (the most of any rank)")
    print("| system | read-backs (the device's whole queue) | on this step's events | on earlier steps' events "
          "| for-loop AdamW's step counts (host memory on a GPU) |")
    print("|---|---|---|---|---|")
    for system in SYSTEMS:
        if SYSTEMS[system] is None and args.ranks > 1:
            continue
        per_rank = spawn_gloo(host_waits, args.ranks, system, start_method="spawn")
        most = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        row = [most["read-backs"], most["this step's events"], most["earlier events"], most["optimizer step counts"]]
        print(f"| {system} | " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
