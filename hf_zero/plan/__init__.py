"""Planning a training job before renting the machines (`hf-zero plan`, and `--zero_stage auto`): the engine's own
code run as any rank of a world of any size on one CPU.

    simulate.py   one rank simulated: torch's fake process group and fake tensors, two training steps
    memory.py     the memory count: every storage by place (device, host) and kind, at the step's peak
    timeline.py   the device layer's timeline for a simulated rank: host memory told from the device's
    models.py     the model a plan is for (a zoo name, a folder, a cached Hub id), built from its config
    planner.py    a setting planned at the ranks that differ, its step time, and the fastest setting that fits
    machine.py    the machine planned for, and the units (no torch: `hf-zero plan` reads its flags without it)

May import hf_zero.settings, hf_zero.runtime and hf_zero.engine (and what the engine imports).
"""
