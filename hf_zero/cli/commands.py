"""The `hf-zero` command. Its flags are checked before torch or transformers is imported (3-4 s on a 2-core
machine), so that a misspelt one is said at once; each command imports what it runs once its flags are read."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from hf_zero.runtime.host_memory import use_mmap_for_large_allocations
from hf_zero.settings.config import (
    DTYPES,
    ZeroConfigError,
    did_you_mean,
    offload_conflict,
)
from hf_zero.settings.environment import (
    COLLECTIVE_TIMEOUT_ENV,
    DEFAULT_COLLECTIVE_TIMEOUT,
    check_environment,
    seconds,
)
from hf_zero.settings.flag_names import check_flag_names


class Parser(argparse.ArgumentParser):
    """A bad argument is one line naming it, with the nearest known flag for a misspelt one, rather than the
    usage (which --help prints)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            unknown = message.split(": ", 1)[1].split()[0]
            message += did_you_mean(unknown.split("=")[0], [o for o in self._option_string_actions if o[:2] == "--"])
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def _seconds(value: str) -> float:
    return seconds(value, "the value")


def _restarts(value: str) -> int:
    """argparse type of --max_restarts: a count, 0 or more."""
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"must be a whole number, 0 or more; got {value!r}")
    return int(value)


def _nproc(value: str) -> int:
    """argparse type of --nproc_per_node: a process count of at least 1."""
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {count}")
    return count


LAUNCH_FLAGS = ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port", "--rdzv_backend",
                "--rdzv_endpoint", "--rdzv_id", "--collective_timeout", "--max_restarts")


def _add_launch_arguments(parser: argparse.ArgumentParser, default_nproc: int) -> None:
    """torchrun's options; on several machines, the same command runs on each with its own --node_rank."""
    launch = parser.add_argument_group("launch (torchrun's; for several nodes run the same command on each)")
    launch.add_argument("--nproc_per_node", type=_nproc, default=default_nproc,
                        help=f"processes to start on this node, one per GPU (default {default_nproc})")
    launch.add_argument("--nnodes", type=_nproc, default=1, help="machines taking part (default 1)")
    launch.add_argument("--node_rank", type=int, default=0, help="this machine's index, 0 to nnodes - 1")
    launch.add_argument("--master_addr", help="address of node 0, reachable from every node (default 127.0.0.1 on "
                        "one node; needed with --nnodes above 1 unless --rdzv_endpoint is given)")
    launch.add_argument("--master_port", type=int,
                        help="a free port on node 0 (default: any free port; needed with --master_addr)")
    launch.add_argument("--rdzv_backend", choices=("c10d", "static"),
                        help="torchrun's rendezvous: c10d (the nodes meet at --rdzv_endpoint and get their ranks "
                        "there, as under SLURM or elastic launchers; the default with --rdzv_endpoint) or static "
                        "(--master_addr, --master_port and --node_rank; the default otherwise)")
    launch.add_argument("--rdzv_endpoint", metavar="HOST:PORT", help="where the nodes meet (c10d rendezvous)")
    launch.add_argument("--rdzv_id", help="a job id the nodes of one run share (c10d rendezvous; default hf_zero)")
    launch.add_argument("--max_restarts", type=_typed(_restarts), default=0, metavar="N",
                        help="when a rank dies (killed, out of memory), torchrun starts every rank again, up to N "
                        "times; each restart resumes from the newest complete checkpoint in the output folder "
                        "(default 0)")
    launch.add_argument("--collective_timeout", type=_typed(_seconds),
                        metavar="SECONDS", help=f"how long a rank waits in one collective for the others before it "
                        f"fails, naming the rank that stopped answering (default "
                        f"{DEFAULT_COLLECTIVE_TIMEOUT.total_seconds():.0f}; {COLLECTIVE_TIMEOUT_ENV} also sets it)")


def _check_launch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Refuses a launch the nodes could not agree on; returns the number of processes in all."""
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node_rank must be between 0 and --nnodes - 1 ({args.nnodes - 1}); got {args.node_rank}")
    if args.rdzv_backend is None:
        args.rdzv_backend = "c10d" if args.rdzv_endpoint else "static"
    if args.rdzv_backend == "c10d":
        if not args.rdzv_endpoint:
            parser.error("--rdzv_backend c10d needs --rdzv_endpoint HOST:PORT, where every node meets")
        if args.master_addr or args.master_port:
            parser.error("--master_addr and --master_port are for the static rendezvous; with --rdzv_endpoint the "
                         "nodes meet there: drop them")
    elif args.rdzv_endpoint or args.rdzv_id:
        parser.error("--rdzv_endpoint and --rdzv_id are for the c10d rendezvous: drop --rdzv_backend static")
    elif args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        parser.error("--nnodes above 1 needs --master_addr and --master_port (node 0's address and a free port "
                     "there, the same on every node), or --rdzv_endpoint HOST:PORT")
    return args.nproc_per_node * args.nnodes


# What torchrun sets for each process it starts: which one it is, and how many there are.
LAUNCHER_WORLD = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _forget_launcher_world(prog: str) -> None:
    """For a launch of one process, which runs here without torchrun: the variables torchrun would set for it, left
    over from another launch, are dropped and said to be, as torchrun overrides them for the processes it starts. A
    leftover WORLD_SIZE=2 had the one process wait for a second (a 28-line error about RANK)."""
    stale = [f"{name}={os.environ.pop(name)}" for name in LAUNCHER_WORLD if name in os.environ]
    if stale:
        print(f"{prog}: ignoring {', '.join(stale)} from the environment: this launch is one process, run here "
              f"without torchrun (which sets them for the processes it starts)", file=sys.stderr)


def _without_launch_flags(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCH_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in LAUNCH_FLAGS)):
            kept.append(arg)
    return kept


def _train(argv: list[str]) -> int:
    from hf_zero.cli import train_lm

    parser = Parser(prog="hf-zero train", description=train_lm.__doc__)
    _add_launch_arguments(parser, default_nproc=2)
    train_lm.add_arguments(parser)
    args = parser.parse_args(argv)
    processes = _check_launch(parser, args)
    if args.max_restarts and not args.save_steps:
        parser.error("--max_restarts resumes from the checkpoints that --output_dir and --save_steps write; without "
                     "them each restart would train from the start: give both")
    if processes == 1:
        _forget_launcher_world(parser.prog)
    check_environment()
    train_lm.plan_settings(args, processes, args.nproc_per_node)  # `auto` settings become the plan's choice
    train_lm.check_args(args, processes, args.nproc_per_node)  # bad settings stop here, before any process starts
    use_mmap_for_large_allocations()
    if processes == 1 and not args.max_restarts:  # restarts are torchrun's
        train_lm.main(args)
        return 0
    return _launch_ranks(args, "hf_zero.cli.train_lm", train_lm.concrete_argv(_without_launch_flags(argv), args))


class _RunParser(Parser):
    """`hf-zero run`'s parser: its help ends with the flags hf_zero adds to the script's TrainingArguments, which
    are listed from transformers' parser, so transformers is imported only when the help is asked for."""

    def format_help(self) -> str:
        from hf_zero.hf.arguments import flags_help

        self.epilog = ("the flags hf_zero adds to the script's TrainingArguments (give them after the script; "
                       "--zero_config FILE.json takes them as JSON keys):\n" + flags_help())
        return super().format_help()


def _run(argv: list[str]) -> int:
    from hf_zero.cli import run

    parser = _RunParser(prog="hf-zero run", description=run.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_launch_arguments(parser, default_nproc=1)
    parser.add_argument("script", help="a script that builds TrainingArguments and Trainer from transformers")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    processes = _check_launch(parser, args)
    if processes == 1:
        _forget_launcher_world(parser.prog)
    check_environment()
    if not Path(args.script).is_file():
        parser.error(f"no such script: {args.script}")
    check_flag_names(args.script_args)  # a misspelt --zero_* flag, said before torch and transformers are imported
    use_mmap_for_large_allocations()
    if processes == 1 and not args.max_restarts:  # restarts are torchrun's
        return run.main([args.script, *args.script_args])
    from hf_zero.hf.flags import check_script_flags

    check_script_flags(args.script_args, processes, args.nproc_per_node)  # once, before any process starts
    return _launch_ranks(args, "hf_zero.cli.run", [args.script, *args.script_args])


def _shard_size(value: str) -> int:
    """--max-shard-size: 5GB, 500MB, or a byte count."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(value)
    except ValueError:
        raise ValueError(f"expected a size such as 5GB, 500MB or 1000000; got {value!r}") from None
    if size < 1:
        raise ValueError(f"must be at least 1 byte; got {value!r}")
    return size


def _consolidate(argv: list[str]) -> int:
    from hf_zero.checkpoint import consolidate

    parser = Parser(prog="hf-zero consolidate", description=consolidate.__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="an engine checkpoint, or a ZeroTrainer checkpoint-N folder")
    parser.add_argument("output_dir", help="where to write the transformers folder")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="dtype of the written weights, cast from the fp32 masters (default fp32)")
    parser.add_argument("--max-shard-size", type=_typed(_shard_size), default="5GB",
                        help="largest weight file (default 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace whatever output_dir holds (by default it must be empty, absent or an earlier "
                             "consolidation of the same checkpoint)")
    parser.add_argument("--merge", action="store_true",
                        help="for a checkpoint of a peft model: write the base model with the adapter merged in (by "
                             "default, the adapter folder PeftModel.from_pretrained loads)")
    parser.add_argument("--push-to-hub", metavar="REPO", help="then upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    args = parser.parse_args(argv)
    report = consolidate.consolidate(args.checkpoint_dir, args.output_dir, args.dtype, args.max_shard_size,
                                     overwrite=args.overwrite, merge=args.merge)
    print(f"{args.output_dir}: {report.summary()}")
    if args.push_to_hub:
        print(f"pushed: {consolidate.push_to_hub(args.output_dir, args.push_to_hub, private=args.private or None)}")
    return 0


def _estimate(argv: list[str]) -> int:
    from hf_zero.cli import estimate

    parser = Parser(prog="hf-zero estimate", description=estimate.__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a model_zoo name (python -c 'import model_zoo; print(model_zoo.list())'), or "
                                      "a folder or cached Hub model with a config.json")
    what.add_argument("--params", type=_typed(estimate.parse_count), help="a parameter count: 7.5e9, 7.5B, 350M")
    parser.add_argument("--num_gpus", type=_nproc, required=True, help="data-parallel devices (Nd)")
    parser.add_argument("--zero_stage", type=int, choices=estimate.STAGES, default=3)
    parser.add_argument("--gpu_memory", type=_typed(estimate.parse_bytes), default="32GB",
                        help="memory per device (default 32GB, the paper's V100)")
    parser.add_argument("--offload_optimizer", choices=estimate.OFFLOADS, default="none")
    parser.add_argument("--offload_param", choices=estimate.OFFLOADS, default="none")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reduce_dtype", choices=sorted(DTYPES),
                        help="the engine's reduce_dtype: fp32 or the compute dtype (default)")
    parser.add_argument("--batch_size", type=_nproc, help="micro-batch per device, for activation memory")
    parser.add_argument("--seq_len", type=_nproc, help="sequence length, for activation memory")
    parser.add_argument("--checkpoint_activations", action="store_true")
    parser.add_argument("--hpz_partition_size", type=_nproc, default=1,
                        help="ZeRO++ hpZ at stage 3: devices a secondary partition is spread over (default 1: off)")
    args = parser.parse_args(argv)
    conflict = offload_conflict(args.zero_stage, args.offload_optimizer, args.offload_param, lambda k: f"--{k}")
    if conflict:
        parser.error(conflict)
    if args.reduce_dtype not in (None, "fp32", args.dtype):
        parser.error(f"--reduce_dtype must be fp32 or the compute dtype, {args.dtype} (--dtype); got {args.reduce_dtype}")
    if args.hpz_partition_size > 1 and (args.zero_stage != 3 or args.num_gpus % args.hpz_partition_size):
        parser.error(f"--hpz_partition_size needs --zero_stage 3 and must divide --num_gpus ({args.num_gpus}); got "
                     f"{args.hpz_partition_size} at stage {args.zero_stage}")
    if (args.batch_size is None) != (args.seq_len is None):
        parser.error("--batch_size and --seq_len go together (activation memory needs both)")
    if args.batch_size and not args.model:
        parser.error("--batch_size needs --model: activation memory depends on the layers and hidden size")
    try:
        psi = args.params if args.params else estimate.parameter_count(args.model)
        if args.batch_size:
            estimate.activation_bytes(args.model, 1, 1, False)
    except ValueError as error:
        parser.error(f"--model: {error}")
    setting = estimate.Setting(args.zero_stage, args.num_gpus, args.offload_optimizer, args.offload_param,
                               None if args.reduce_dtype == args.dtype else args.reduce_dtype,
                               args.hpz_partition_size)
    print(estimate.report(psi, setting, args.gpu_memory, args.dtype, args.model, args.batch_size or 0,
                          args.seq_len or 0, args.checkpoint_activations))
    return 0


def _plan(argv: list[str]) -> int:
    from hf_zero.cli import plan

    parser = Parser(prog="hf-zero plan", description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_arguments(parser, _nproc, _typed(_size_in_bytes))
    args = parser.parse_args(argv)
    problem = plan.check(args)
    if problem:
        parser.error(problem)
    try:
        return plan.run(args)
    except ValueError as error:
        parser.error(f"--model: {error}" if "--" not in str(error) else str(error))


def _size_in_bytes(text: str) -> int:
    from hf_zero.cli.estimate import parse_bytes

    return parse_bytes(text)


def _build_ops(argv: list[str]) -> int:
    from hf_zero.ops import build

    parser = Parser(prog="hf-zero build-ops", description=build.__doc__)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    for name in build.KERNELS:
        try:
            module = build.load_extension(name, verbose=args.verbose)
        except RuntimeError as error:
            print(f"hf-zero build-ops: {error}", file=sys.stderr)
            return 1
        print(f"built {name} ({module.isa()}) in {build.build_directory(name)}")
    return 0


def _typed(parse):
    """An argparse type from a parser that raises ValueError with a message."""
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__
    return convert


def _rendezvous_args(launch: argparse.Namespace) -> list[str]:
    """torchrun's rendezvous options for `launch` (checked by _check_launch)."""
    from hf_zero.runtime.launch import free_port

    if launch.rdzv_backend == "c10d":
        return ["--rdzv_backend", "c10d", "--rdzv_endpoint", launch.rdzv_endpoint, "--rdzv_id",
                launch.rdzv_id or "hf_zero"]
    return ["--node_rank", str(launch.node_rank), "--master_addr", launch.master_addr or "127.0.0.1",
            "--master_port", str(launch.master_port or free_port())]


def _launch_ranks(launch: argparse.Namespace, module: str, module_args: list[str]) -> int:
    """Starts this node's processes of `python -m module module_args` through torchrun's agent, forked."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hf_zero.cli.node_ranks import start_node_ranks

    if launch.collective_timeout is not None:  # the ranks read it when they join the process group
        os.environ[COLLECTIVE_TIMEOUT_ENV] = str(launch.collective_timeout)
    try:
        start_node_ranks(["--nnodes", str(launch.nnodes), "--nproc_per_node", str(launch.nproc_per_node),
                          "--max-restarts", str(launch.max_restarts), *_rendezvous_args(launch)], module, module_args)
    except ChildFailedError:  # torchrun's agent has already printed which rank failed and why
        return 1
    return 0


COMMANDS = {
    "train": (_train, "train a small GPT-2 with ZeRO on a local text (the main job)"),
    "run": (_run, "run an unmodified Hugging Face Trainer script with --zero_* flags"),
    "estimate": (_estimate, "memory per device for a model under each ZeRO stage (the paper's accounting)"),
    "plan": (_plan, "dry-run the engine at any world size: memory per rank, traffic per link, the fastest setting "
                    "that fits"),
    "consolidate": (_consolidate, "write a checkpoint's weights as a transformers folder (streaming)"),
    "build-ops": (_build_ops, "compile the C++ kernels (csrc/: CPU Adam, quantization) now instead of on first use"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: hf-zero COMMAND [ARGS]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:12s} {help_text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    try:
        return COMMANDS[command][0](rest)
    except Exception as error:
        # Imported here, and not for a bad flag: checkpoint brings torch and DTensor, which the commands that never read
        # one need not load, and a misspelt flag is said without.
        if not isinstance(error, ZeroConfigError):
            from hf_zero.checkpoint import CheckpointError

            if not isinstance(error, CheckpointError):
                raise
        print(f"hf-zero {command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
