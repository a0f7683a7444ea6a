"""`python without_teardown.py SCRIPT ARGS` runs SCRIPT as `python SCRIPT ARGS` does, then ends the process
without the interpreter's teardown.

For the stock references the tests compare against (the stock Trainer under plain torchrun): their results
are the files they write, and a process that finished its script can still abort in teardown when a gloo
thread outlives the interpreter (pytorch/pytorch#179291: exit code -6 after every file was written, seen in
this suite). hf_zero's own ranks end the same way (hf_zero.runtime.launch.exit_skipping_teardown); the reference's
training is untouched.
"""
import runpy
import sys
from pathlib import Path

from hf_zero.runtime.launch import exit_skipping_teardown

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as `python SCRIPT` puts the script's folder first
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code
    exit_skipping_teardown(code)
