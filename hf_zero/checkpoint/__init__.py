"""Checkpoints and weight exports: each rank writes its own partition; any world size and stage can load them.

A checkpoint folder holds one safetensors file per writing rank and one `manifest.json`. Tensors are addressed by
parameter name and element offset (`exp_avg/transformer.h.0.attn.c_attn.weight/4096`), never by flat-buffer
position, so a loader with another world size, bucket size or stage reads only the slices it now owns. Saving is
all-or-nothing, and loading checks everything before it changes any state. With tensor parallelism the checkpoint
loads at any dp size and stage with the same tp size; `hf-zero consolidate` joins the parts.

This layer owns, one concern a module:
  files.py          the error every refusal raises, hashes, opening and checking a checkpoint's files
  manifest.py       what manifest.json holds: built at save, checked whole at load
  folders.py        the all-or-nothing folder: completeness, the save's moves, recovery after a crash, numbered folders
  layout.py         how an engine partitions its model (ShardLayout), read from its parts (PartitionedModel)
  write.py          saving; read.py: loading
  frozen_source.py  frozen weights recorded by the pretrained files they came from instead of stored
  weights.py        a partitioned model's weights gathered whole, and written as save_pretrained writes them
  export.py         transformers weight files written tensor by tensor; consolidate.py: `hf-zero consolidate`

It may import settings, runtime, ops, zero and optim; never the engine, which calls it with its parts.

The names below are those other layers and users import from `hf_zero.checkpoint`; the package's own modules
import from the module that defines a name.
"""
from hf_zero.checkpoint.files import CheckpointError, sha256
from hf_zero.checkpoint.folders import (
    TRAINER_SUBFOLDER,
    is_complete,
    newest_complete,
    numbered_folders,
    readable_folder,
)
from hf_zero.checkpoint.layout import PartitionedModel, ShardLayout, describe_layout, layout_of
from hf_zero.checkpoint.manifest import MANIFEST, read_manifest
from hf_zero.checkpoint.read import load, load_partitioned, read_json_object
from hf_zero.checkpoint.write import save, save_partitioned

__all__ = [
    "CheckpointError", "sha256", "TRAINER_SUBFOLDER", "is_complete", "newest_complete", "numbered_folders",
    "readable_folder", "PartitionedModel", "ShardLayout", "describe_layout", "layout_of", "MANIFEST", "read_manifest",
    "load", "load_partitioned", "read_json_object", "save", "save_partitioned",
]
