"""Stage 3 (P_os+g+p): parameters partitioned.

Between uses each rank holds only its shard of every parameter. The model is cut into units (a
transformer block by default, plus the root for whatever lies outside the blocks); a unit's full
parameters are all-gathered just before its forward and again before its backward, and freed right
after each. While one unit computes, the next ones in execution order are gathered asynchronously:
always the next one, then more up to `prefetch_bucket_size` elements ahead. Parameters smaller than
`param_persistence_threshold` go to one persistent unit that stays gathered and is refreshed by one
all-gather after each step.

Freeing resizes the gathered buffer's storage to zero instead of dropping the tensor, so the views
of it that autograd saved for backward (e.g. a weight's transpose) see the re-gathered values,
and each parameter's `.data` is swapped to an empty tensor so that reading a freed parameter fails
loudly instead of returning stale or uninitialised memory.

ZeRO++ lives here too (settings in config.py, the node groups and qgZ's reduction in zeropp.py): a gather for
a forward or backward may go quantized (qwZ, `_gather_quantized`), and once a forward kept a secondary partition
every later one until the optimizer step comes from inside the node (hpZ, `keep_secondary`); qgZ replaces the
reducer's reduce-scatter (on more than one node).

The package, one concern a file:
    unit.py            Unit: one module's flat buffers, their gather (exact, qwZ, hpZ) and free, its UnitState
    discovery.py       which modules are the units, and the models stage 3 refuses (LayerDrop)
    params.py          Stage3Params, the holder: cutting the model into units, their shards, construction
    schedule.py        the hooks: each unit gathered before its forward and backward, prefetch in the order
                       each pass ran last, the post-backward where its reduction launches
    shared_weights.py  the root freed early in backward, and tied weights' uses split into their buckets
    gradients.py       Stage3Gradients: stage 2's reduce-scatter with a bucket per unit, launched at the
                       unit's post-backward; a tied weight's uses handed in apart
"""
from hf_zero.zero.stage3.discovery import find_unit_modules, units_using_each_param
from hf_zero.zero.stage3.gradients import Stage3Gradients
from hf_zero.zero.stage3.params import PERSISTENT, Stage3Params
from hf_zero.zero.stage3.unit import Unit

__all__ = ["PERSISTENT", "Stage3Gradients", "Stage3Params", "Unit", "find_unit_modules", "units_using_each_param"]
