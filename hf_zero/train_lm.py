"""`torchrun -m hf_zero.train_lm [options]`: the former module path of hf_zero/cli/train_lm.py, kept for launch
commands that name it."""
from hf_zero.cli.rank_main import run_rank
from hf_zero.cli.train_lm import _rank_main

if __name__ == "__main__":
    run_rank(_rank_main, "hf-zero train")
