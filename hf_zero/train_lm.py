"""`torchrun -m hf_zero.train_lm [options]`: the former module path of hf_zero/cli/train_lm.py, kept for launch
commands that name it."""
from hf_zero.cli.train_lm import start_rank

if __name__ == "__main__":
    start_rank()
