"""Process groups: a script that builds an engine and exits without destroy_process_group (as every
Trainer script does) has its group destroyed before interpreter finalization, where gloo can abort."""
from __future__ import annotations

import subprocess
import sys

from hf_zero.launch import free_port

SCRIPT = """
import atexit, os
import torch, torch.distributed as dist
# Registered first, so it runs last: after hf_zero's handler, as finalization would.
atexit.register(lambda: print("group alive at the end of exit:", dist.is_initialized(), flush=True))
import hf_zero
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(4, 4)
engine = hf_zero.initialize(model, torch.optim.AdamW(model.parameters()), {{"zero_stage": {stage}}})
engine.backward(engine(torch.ones(2, 4)).sum())
engine.step()
print("trained", flush=True)
"""


def test_a_script_that_never_destroys_its_process_group_has_it_destroyed_at_exit():
    for stage in (2, 3):
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(port=free_port(), stage=stage)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[-2:] == ["trained", "group alive at the end of exit: False"], done.stdout
