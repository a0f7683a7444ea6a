"""Planning a training job before renting the machines (`hf-zero plan`): the engine's own code run as any rank of
a world of any size on one CPU (simulate), its memory counted as it allocates (memory), on a timeline that tells
the device's memory from the host's (timeline)."""
