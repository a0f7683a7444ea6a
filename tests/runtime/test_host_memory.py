"""Host memory (hf_zero/runtime/host_memory.py): the heap a rank's backward frees goes back to the system (measured in
the resident memory of a fresh process) when trim_host_heap asks for it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hf_zero
from hf_zero import ZeroConfigError
from hf_zero.runtime.host_memory import HeapTrimmer
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.settings.config import ZeroConfig
from tests.helpers import batch as lm_batch
from tests.helpers import tiny_model

FREED_MIB = 64

FREE_SMALL_BLOCKS = f"""
import json, torch
from hf_zero.runtime.host_memory import HeapTrimmer
from hf_zero.runtime.memory import current_rss
trim = HeapTrimmer()
trim()
blocks = [torch.ones(16 * 1024) for _ in range(2 * {FREED_MIB} * 16)]  # 64 KiB each: glibc's heap, not mmap
held = current_rss()
del blocks[::2]  # every other one: each freed block lies between live ones, out of reach of glibc's own trimming
freed = current_rss()
trim()
print(json.dumps({{"held": held, "freed": freed, "trimmed": current_rss()}}))
"""


def test_the_heap_trimmer_gives_freed_small_blocks_back_to_the_system():
    """64 MiB of small blocks freed between live ones stay resident (glibc keeps them for reuse); the trimmer gives
    them back."""
    rss = json.loads(subprocess.run([sys.executable, "-c", FREE_SMALL_BLOCKS], check=True, capture_output=True,
                                    text=True).stdout)
    mib = {k: v / 2**20 for k, v in rss.items()}
    print(mib)
    assert mib["held"] - mib["freed"] < 0.1 * FREED_MIB
    assert mib["freed"] - mib["trimmed"] > 0.9 * FREED_MIB


def test_trim_host_heap_is_refused_below_stage_3():
    with pytest.raises(ZeroConfigError, match="trim_host_heap gives back the heap stage 3's backward frees"):
        ZeroConfig(zero_stage=2, trim_host_heap=True).validate()


def trims_during_one_backward(trim_host_heap: bool) -> int:
    """How often the stage-3 engine asks the heap trimmer during a backward of a tiny GPT-2."""
    calls = []
    HeapTrimmer.__call__ = lambda self: calls.append(1)
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                {"zero_stage": 3, "trim_host_heap": trim_host_heap})
    engine.backward(engine(**lm_batch("gpt2", 0, 2)).loss)
    return len(calls)


def test_stage3_asks_the_trimmer_at_each_units_backward_gather_only_when_set():
    assert spawn_gloo(trims_during_one_backward, 1, True)[0] == 3  # the root and 2 blocks
    assert spawn_gloo(trims_during_one_backward, 1, False)[0] == 0


FROZEN_WHILE_IMPORTING = """
import gc, json
from hf_zero.runtime.host_memory import start_up_frozen
gc.disable() if {disabled} else None
full_collections = []
gc.callbacks.append(lambda phase, info: full_collections.append(1) if phase == "start" and info["generation"] == 2
                    else None)
before = gc.get_freeze_count()
with start_up_frozen():
    enabled_inside = gc.isenabled()
    import email.mime.multipart, xml.dom.minidom
    import torch
walked = {{id(o) for o in gc.get_objects()}}
print(json.dumps({{"enabled_inside": enabled_inside, "enabled_after": gc.isenabled(),
                   "collections_inside": len(full_collections), "frozen": gc.get_freeze_count() - before,
                   "walked": [id(f) in walked for f in (xml.dom.minidom.parseString, torch.nn.Module.__init__)]}}))
"""


@pytest.mark.parametrize("disabled", [False, True])
def test_start_up_imports_are_frozen_out_of_the_collector_which_is_left_as_it_was(disabled):
    """Inside start_up_frozen the collector is off, so the imports trigger no full collection (torch alone would
    several); after it, their objects are frozen (gc.get_objects, the collector's generations, no longer holds
    them) and the collector is on again, unless the process had it off."""
    run = subprocess.run([sys.executable, "-c", FROZEN_WHILE_IMPORTING.format(disabled=disabled)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    said = json.loads(run.stdout)
    assert said["enabled_inside"] is False and said["enabled_after"] is not disabled
    assert said["collections_inside"] == 0 and said["frozen"] > 100_000, said
    assert said["walked"] == [False, False], said
