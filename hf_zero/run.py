"""`torchrun -m hf_zero.run SCRIPT.py [args]`: the former module path of hf_zero/cli/run.py, kept for launch
commands that name it."""
from hf_zero.cli.run import main, start_rank

__all__ = ["main"]

if __name__ == "__main__":
    start_rank()
