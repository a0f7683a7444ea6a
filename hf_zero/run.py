"""`torchrun -m hf_zero.run SCRIPT.py [args]`: the former module path of hf_zero/cli/run.py, kept for launch
commands that name it."""
import sys
from pathlib import Path

from hf_zero.cli.rank_main import run_rank
from hf_zero.cli.run import main

if __name__ == "__main__":
    run_rank(main, Path(sys.argv[1]).name if len(sys.argv) > 1 else "hf_zero.run")
