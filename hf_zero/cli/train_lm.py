"""The main job: train a small byte-level GPT-2 with ZeRO on a local text, printing loss and the ledger.

Default text: Python's own documentation topics (`pydoc_data.topics`, ~465k characters, ships with
CPython), so the job runs offline on any machine. Run under torchrun, or through `hf-zero train`,
which starts the processes itself.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import psutil
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import model_zoo
from hf_zero.checkpoint import is_complete, numbered_folders
from hf_zero.engine import ZeroEngine, initialize
from hf_zero.plan.planner import check_against_plan
from hf_zero.runtime.comm import Communicator
from hf_zero.runtime.device import compute_device
from hf_zero.runtime.launch import init_distributed
from hf_zero.runtime.memory import measured_peak, memory_left, model_state_bytes, start_measuring
from hf_zero.runtime.tensor_parallel import apply_tensor_parallel, init_mesh
from hf_zero.settings.config import (
    AUTO,
    PLANNED,
    ZeroConfig,
    ZeroConfigError,
    check_compile_backend,
    check_tp_within_a_node,
    engine_settings_for_a_plan,
    offloads_to_check,
    plan_conflict,
    to_check_before_a_plan,
)
from hf_zero.settings.config import add_arguments as add_engine_arguments
from hf_zero.settings.environment import processes_per_node, restarts_so_far

if TYPE_CHECKING:
    from hf_zero.cli.rank_main import Ending

logger = logging.getLogger("hf_zero.cli.train_lm")
# The engine settings the job takes as options, declared (help, choices, defaults) in hf_zero.settings.config.
ENGINE_SETTINGS = ["zero_stage", "dtype", "gradient_accumulation_steps", "reduce_bucket_size", "offload_optimizer",
                   "offload_param", "nvme_path", "partition_activations", "cpu_checkpointing", "quantized_weights",
                   "hpz_partition_size", "quantized_gradients", "quantized_gradients_bits", "quantization_block_size",
                   "ranks_per_node", "compile", "compile_backend", "compile_mode"]


def load_text(path: str | None) -> bytes:
    if path:
        return Path(path).read_bytes()
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """Endless random windows of seq_len bytes; each rank draws its own with its own seed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-demo", choices=model_zoo.list())
    p.add_argument("--text", default=None, help="a local text file (default: pydoc_data.topics)")
    # The demo model (3.3M) is below the engine's default bucket, so stage 2 would keep one bucket as large
    # as the model: a smaller one keeps a few.
    add_engine_arguments(p, ENGINE_SETTINGS, defaults={"reduce_bucket_size": 500_000}, planned=PLANNED)
    p.add_argument("--batch_size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--tensor_parallel_size", type=int, default=1,
                   help="split each block over this many consecutive ranks (must divide the process count)")
    p.add_argument("--tensor_parallel_across_nodes", action="store_true",
                   help="let a tensor-parallel group span nodes (refused otherwise: its all-reduces cross the network)")
    p.add_argument("--dropout", type=float, default=None,
                   help="GPT-2's residual, embedding and attention dropout (default: the zoo config's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--max_minutes", type=float, default=3.0, help="stop after this much training time")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=None,
                   help="where checkpoints go (step-N folders); after a restart (--max_restarts) training resumes "
                   "from the newest complete one there")
    p.add_argument("--save_steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--save_total_limit", type=int, default=None, help="keep only the newest N checkpoints")
    p.add_argument("--planned_peak", type=int, default=None, help="bytes a rank's step was planned to take at its "
                   "peak (set by --zero_stage auto): the second step is checked against it, and a measured peak "
                   "more than 10%% above it is reported")


def plan_settings(args: argparse.Namespace, processes: int, per_node: int) -> None:
    """Replaces each `auto` among PLANNED by the fastest setting that fits this machine (`hf-zero plan` for the job's
    model, sequence, micro-batch and processes), printing the candidates and why each lost; sets --planned_peak."""
    asked = [key for key in PLANNED if getattr(args, key) == AUTO]
    if not asked:
        return
    conflict = plan_conflict(args.tensor_parallel_size, f"--{asked[0]}")
    if conflict:
        raise ZeroConfigError(conflict)
    # Every other flag is checked first, with the planned ones (and the NVMe folder) as a plan leaves them to be
    # checked at.
    settings = engine_config(args)
    nvme_folder, stages = to_check_before_a_plan(settings, asked, option_of)
    checked_at = {key: settings.get(key) for key in (*asked, "nvme_path")}
    check_args(argparse.Namespace(**{**vars(args), **checked_at}), processes, per_node)
    from hf_zero.cli.plan import report
    from hf_zero.plan.machine import Machine
    from hf_zero.plan.planner import choose
    from hf_zero.plan.simulate import Job

    device_bytes, where = memory_left(compute_device(), per_node)
    host_bytes = psutil.virtual_memory().available
    nvme_bytes = shutil.disk_usage(args.nvme_path).free if args.nvme_path else 0  # the node's ranks share it
    # The engine's other settings (gradient clipping, buckets, qwZ, ...) as the processes will have them.
    job = Job(args.model, processes // per_node, per_node, args.dtype, args.seq_len, device_bytes,
              engine_settings=json.dumps(engine_settings_for_a_plan(engine_config(args))))
    fixed = {key: getattr(args, key) for key in PLANNED if key not in asked}
    if compute_device().type == "cpu":  # the device's memory is the host's: offloading to it frees nothing
        fixed |= offloads_to_check(settings, asked)
    if "zero_stage" in asked and stages != (0, 1, 2, 3):
        fixed["zero_stage"] = stages[0] if len(stages) == 1 else stages
    fixed |= {"micro_batch": args.batch_size, "gradient_checkpointing": False,
              "hpz_partition_size": args.hpz_partition_size}
    logger.info(f"planning {', '.join('--' + key for key in asked)} for {processes} process(es), "
                f"{device_bytes / 1e9:.3g} GB each ({where}) ...")
    machine = Machine(device_bytes, host_bytes, nvme_capacity=nvme_bytes)
    chosen, candidates = choose(job, machine, fixed, say=logger.info)
    print(report(job, machine, chosen, candidates), flush=True)
    if chosen is None:
        raise ZeroConfigError(f"--{asked[0]} auto: no setting fits {device_bytes / 1e9:.3g} GB a process; give a "
                              f"smaller --batch_size or --seq_len, or more processes")
    for key in asked:
        setattr(args, key, getattr(chosen.setting, key))
    if nvme_folder and "nvme" not in (args.offload_optimizer, args.offload_param):
        logger.info(f"the plan offloads nothing to NVMe: --nvme_path {nvme_folder} is not used")
        args.nvme_path = ""  # none, and said so to the processes (`concrete_argv`)
    # On a CPU the device's memory and the host's are one.
    args.planned_peak = max(r.measured_peak(compute_device().type == "cpu") for r in chosen.ranks)


def concrete_argv(argv: list[str], args: argparse.Namespace) -> list[str]:
    """`argv` with what the plan chose for each PLANNED setting, and --planned_peak, for the processes to start with:
    appended, since the last of a repeated option is the one argparse keeps."""
    if args.planned_peak is None:
        return argv
    unused_nvme = ["--nvme_path", ""] if args.nvme_path == "" else []  # the plan offloads nothing there
    return argv + [arg for key in PLANNED for arg in (f"--{key}", str(getattr(args, key)))] + unused_nvme + \
        ["--planned_peak", str(args.planned_peak)]


def engine_config(args: argparse.Namespace) -> dict[str, object]:
    return {"gradient_clipping": 1.0, **{name: getattr(args, name) for name in ENGINE_SETTINGS}}


def option_of(key: str) -> str:
    """How hf-zero train's messages name an engine setting: by its option."""
    return f"--{key}"


def check_args(args: argparse.Namespace, processes: int, per_node: int) -> None:
    """Refuses bad settings before any work (`hf-zero train` calls it before starting the processes)."""
    for flag in ("batch_size", "seq_len", "max_steps", "log_every"):
        if getattr(args, flag) < 1:
            raise ZeroConfigError(f"--{flag} must be at least 1; got {getattr(args, flag)}")
    for flag in ("max_minutes", "lr"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) > 0):
            raise ZeroConfigError(f"--{flag} must be a positive number; got {getattr(args, flag)}")
    if args.save_steps < 0 or (args.save_steps and not args.output_dir):
        raise ZeroConfigError(f"--save_steps must be 0 or more, and above 0 needs --output_dir; got {args.save_steps}"
                              f"{'' if args.output_dir else ' without --output_dir'}")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise ZeroConfigError(f"--save_total_limit must be at least 1; got {args.save_total_limit}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ZeroConfigError(f"--dropout must be in [0, 1); got {args.dropout}")
    _check_text(args)
    config = ZeroConfig(**engine_config(args))
    config.validate(option_of)
    config.check_topology(processes, per_node, option_of)
    check_compile_backend(config, option_of)
    if args.tensor_parallel_size < 1 or processes % args.tensor_parallel_size:
        raise ZeroConfigError(f"--tensor_parallel_size must divide the number of processes ({processes}); "
                              f"got {args.tensor_parallel_size}")
    check_tp_within_a_node(args.tensor_parallel_size, per_node, args.tensor_parallel_across_nodes)
    if args.dropout is not None and model_zoo.entry(args.model).family != "gpt2":
        raise ZeroConfigError(f"--dropout sets GPT-2's dropout; {args.model} is not a GPT-2 model")
    _check_activations_fit(args, per_node)


def _check_activations_fit(args: argparse.Namespace, per_node: int) -> None:
    """Refuses a micro-batch whose activations cannot fit in the memory the ranks of this node share (the GPU's, or
    the host's on CPU), by hf_zero.cli.estimate's count: 12·hidden bytes per token and layer, a lower bound (no
    attention scores, no logits), so that nothing that fits is refused. A billion sequences were OOM-killed 35 s
    after launch instead."""
    from hf_zero.cli.estimate import activation_bytes

    per_sequence = activation_bytes(args.model, 1, args.seq_len, False, args.dtype) / args.tensor_parallel_size
    if torch.cuda.is_available():
        memory, where = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:
        memory = psutil.virtual_memory().available // per_node
        where = f"the host memory available to each of the {per_node} ranks on this node"
    fits = int(memory // per_sequence)  # the largest batch accepted, named by the refusal (it said "below" it)
    if args.batch_size > fits:
        use = f"a --batch_size of at most {fits}, or a shorter --seq_len" if fits else "a shorter --seq_len"
        raise ZeroConfigError(f"--batch_size {args.batch_size} of --seq_len {args.seq_len} needs at least "
                              f"{per_sequence * args.batch_size / 2**30:,.1f} GiB of activations per rank for "
                              f"{args.model} ({args.dtype}), more than {where}, {memory / 2**30:,.1f} GiB: use "
                              f"{use}")


TRAIN_FRACTION = 0.95  # of the text; the rest validates


def _check_text(args: argparse.Namespace) -> None:
    """The text must be readable and hold a window of --seq_len + 1 bytes in its validation part."""
    if args.text is not None and not (Path(args.text).is_file() and os.access(args.text, os.R_OK)):
        raise ZeroConfigError(f"--text {args.text}: no readable file there")
    size = len(load_text(None)) if args.text is None else Path(args.text).stat().st_size
    validation = size - int(TRAIN_FRACTION * size)
    if args.seq_len + 1 >= validation:
        raise ZeroConfigError(f"--text {args.text or '(pydoc topics)'} holds {size} bytes; its last 5% ({validation} "
                              f"bytes) validate, which needs more than --seq_len + 1 ({args.seq_len + 1}): give a "
                              f"longer text or a shorter --seq_len")


def split_text(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The text as bytes: the first 95% to train on, the rest to validate (`_check_text` made sure both hold
    a window)."""
    data = torch.frombuffer(bytearray(load_text(args.text)), dtype=torch.uint8).long()
    split = int(TRAIN_FRACTION * len(data))
    return data[:split], data[split:]


def build_engine(args: argparse.Namespace, rank: int, world: int
                 ) -> tuple[ZeroEngine, torch.optim.lr_scheduler.LRScheduler, int]:
    """The zoo model (tensor-parallel when asked), AdamW with decay on matrices only and a warm-up plus
    cosine schedule, in the engine; returns the engine, the schedule and this rank's data-parallel rank."""
    torch.manual_seed(args.seed)
    dropout = {} if args.dropout is None else {f"{part}_pdrop": args.dropout for part in ("resid", "embd", "attn")}
    model = model_zoo.build(args.model, n_positions=max(args.seq_len, 128), **dropout).to(compute_device())
    model.config.use_cache = False  # training keeps no KV cache (and compiled blocks share one graph)
    psi = sum(p.numel() for p in model.parameters())
    mesh, dp_rank, dp = None, rank, world
    if args.tensor_parallel_size > 1:
        mesh = init_mesh(args.tensor_parallel_size, args.tensor_parallel_across_nodes)
        apply_tensor_parallel(model, mesh["tp"])
        dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.max_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.max_steps))))
    engine = initialize(model, optimizer, engine_config(args), mesh=mesh)
    if rank == 0:
        formula = sum(model_state_bytes(args.zero_stage, psi, dp, args.dtype).values()) / 2**20
        logger.info(f"{args.model}: {psi:,} parameters, ZeRO stage {args.zero_stage}, {dp} data-parallel "
                    f"rank(s) x tp {args.tensor_parallel_size}, {args.dtype}; paper's model-state formula "
                    f"(without tp): {formula:.1f} MiB per rank")
    return engine, schedule, dp_rank


def checkpoints(output_dir: str) -> list[Path]:
    """The complete step-N checkpoints in `output_dir`, oldest first."""
    return [folder for folder in numbered_folders(output_dir, "step") if is_complete(folder)]


def resume(args: argparse.Namespace, engine: ZeroEngine, schedule: torch.optim.lr_scheduler.LRScheduler,
           rank: int) -> int:
    """After torchrun started the ranks again (--max_restarts), loads the newest complete checkpoint in --output_dir,
    its schedule and random state; returns the step it was saved after (0: none, training starts over)."""
    if restarts_so_far() == 0 or not args.output_dir:
        return 0
    saved = checkpoints(args.output_dir)
    if not saved:
        if rank == 0:
            logger.warning(f"restart {restarts_so_far()}: no complete checkpoint in {args.output_dir}; training from "
                           f"the start")
        return 0
    client_state = engine.load_checkpoint(saved[-1])
    schedule.load_state_dict(client_state["schedule"])
    rng = {device: torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8)
           for device, state in client_state["rng_state"].items()}
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    if rank == 0:
        logger.warning(f"restart {restarts_so_far()}: resuming from {saved[-1]} (step {client_state['step']}), the "
                       f"newest complete checkpoint in {args.output_dir}")
    return client_state["step"]


def save(args: argparse.Namespace, engine: ZeroEngine, schedule: torch.optim.lr_scheduler.LRScheduler,
         step: int, rank: int) -> None:
    """A checkpoint after `step` steps (the schedule and torch's random states in its client state), then the oldest
    beyond --save_total_limit removed: only once every rank's save is complete (save_checkpoint returns then)."""
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    rng_state = {device: base64.b64encode(state.numpy().tobytes()).decode("ascii") for device, state in rng.items()}
    engine.save_checkpoint(Path(args.output_dir, f"step-{step}"),
                           client_state={"step": step, "schedule": schedule.state_dict(), "rng_state": rng_state})
    if rank == 0 and args.save_total_limit is not None:
        for old in checkpoints(args.output_dir)[:-args.save_total_limit]:
            shutil.rmtree(old)


def train(args: argparse.Namespace, engine: ZeroEngine, schedule: torch.optim.lr_scheduler.LRScheduler,
          stream: Iterator[torch.Tensor], rank: int, first_step: int = 0, baseline: int = 0
          ) -> tuple[list[float], float]:
    """Steps from `first_step` until --max_steps or --max_minutes, saving every --save_steps; returns each step's
    loss and the seconds spent. With --planned_peak, the second step's peak (above `baseline`) is checked against
    the plan."""
    start, losses = time.monotonic(), []
    budget = 60 * args.max_minutes
    # Counts steps towards whichever limit comes first: the total is the steps the time budget allows at the
    # speed so far, so the bar and its ETA end when training does. Closed also when a step fails, so that the
    # error is printed on a line of its own.
    with tqdm(total=args.max_steps, initial=first_step, desc=f"train ({args.max_minutes:g} min budget)", unit="step",
              disable=rank != 0) as bar:
        for step in range(first_step, args.max_steps):
            for _ in range(args.gradient_accumulation_steps):
                x = next(stream).to(compute_device())
                loss = engine(input_ids=x[:, :-1], labels=x[:, :-1]).loss
                engine.backward(loss)
                engine.step()
            schedule.step()
            losses.append(loss.item())
            if args.planned_peak and step == first_step + 1:
                check_against_plan(args.planned_peak, measured_peak(compute_device(), baseline), rank, logger,
                                   by_rss=compute_device().type == "cpu")
            if args.save_steps and (step + 1) % args.save_steps == 0:
                save(args, engine, schedule, step + 1, rank)
            elapsed = time.monotonic() - start
            done = step + 1 - first_step
            bar.total = min(args.max_steps, max(step + 1, first_step + math.ceil(done * budget / elapsed)))
            bar.update(1)
            if (step + 1) % args.log_every == 0 and rank == 0:
                bar.write(f"step {step + 1}: loss {sum(losses[-args.log_every:]) / args.log_every:.3f} "
                          f"grad_norm {engine.global_grad_norm:.3f} lr {schedule.get_last_lr()[0]:.2e}")
            if _out_of_time(elapsed > budget, engine.world_comm):
                bar.total = step + 1
                break
    engine.check_skipped_steps()  # the last steps' outcome, where the device decided it
    return losses, time.monotonic() - start


def _out_of_time(on_this_rank: bool, comm: Communicator) -> bool:
    """Rank 0's clock decides for every rank: clocks that disagree at the limit would stop some ranks a step
    before the others, which then wait in a collective forever."""
    decision = torch.tensor([on_this_rank], dtype=torch.uint8, device=comm.device)
    comm.broadcast_(decision)
    return bool(decision.item())


@torch.no_grad()
def validation_loss(args: argparse.Namespace, engine: ZeroEngine, val: torch.Tensor) -> float:
    engine.eval()
    val_stream = batches(val, args.batch_size, args.seq_len + 1, seed=12345)
    return sum(engine(input_ids=(x := next(val_stream).to(compute_device()))[:, :-1], labels=x[:, :-1]).loss.item()
               for _ in range(10)) / 10


def main(args: argparse.Namespace) -> dict[str, float]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    owns_process_group = not dist.is_initialized()
    init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_args(args, world, processes_per_node(world))
    train_text, val_text = split_text(args)
    baseline = start_measuring(compute_device())
    engine, schedule, dp_rank = build_engine(args, rank, world)
    first_step = resume(args, engine, schedule, rank)
    # The ranks of a tp group compute one batch together, so they draw the same windows; a resumed run skips the
    # windows the steps before it drew.
    stream = batches(train_text, args.batch_size, args.seq_len + 1, seed=args.seed * 1000 + dp_rank)
    for _ in range(first_step * args.gradient_accumulation_steps):
        next(stream)
    losses, elapsed = train(args, engine, schedule, stream, rank, first_step, baseline)
    val_loss = validation_loss(args, engine, val_text)
    # Every rank reports what it holds and sends, in rank order.
    for r in range(world):
        if r == rank:
            logger.info(engine.ledger.report(rank))
        if world > 1:
            dist.barrier()
    steps = len(losses)
    losses = losses or [math.nan]  # resumed from a checkpoint of the last step: nothing left to train
    summary = {"steps": steps, "seconds_per_step": elapsed / len(losses),
               "first_loss": losses[0], "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
               "val_loss": val_loss}
    if rank == 0:
        logger.info(f"{steps} steps in {elapsed:.0f} s ({summary['seconds_per_step']:.3f} s/step): "
                    f"loss {summary['first_loss']:.3f} -> {summary['final_train_loss']:.3f}, "
                    f"validation loss {val_loss:.3f} ({val_loss / math.log(2):.2f} bits per byte)")
    if owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    return summary


def _rank_main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    main(parser.parse_args())


# What `hf-zero train`'s fork server imports once for its ranks (hf_zero.cli.node_ranks.start_node_ranks): this module's
# imports, torch, transformers' models and the engine.
RANK_IMPORTS = ("hf_zero.cli.train_lm",)


def start_rank(end: Ending | None = None) -> None:
    """What a rank runs (forked by `hf-zero train`; `-m hf_zero.cli.train_lm` under torchrun, or the former
    `-m hf_zero.train_lm`). `end` ends it with its exit code: by default without the interpreter's teardown."""
    from hf_zero.runtime.host_memory import start_up_frozen

    # This module's imports ran with the collector on (as torchrun's __main__, or in the fork server): frozen from
    # here on.
    with start_up_frozen():
        from hf_zero.cli.rank_main import run_rank
    run_rank(_rank_main, "hf-zero train", end)


if __name__ == "__main__":
    start_rank()
