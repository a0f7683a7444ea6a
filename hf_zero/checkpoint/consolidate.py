"""`hf-zero consolidate`: a sharded engine checkpoint into a folder `from_pretrained` loads.

It streams: one parameter at a time is read from the rank files that hold its pieces (only those
slices, files opened for that parameter alone), cast, and copied into its place in the output files
(hf_zero/checkpoint/export.py). Peak memory is a few times the largest parameter (measured: about 4x, see
docs/checkpoints.md), whatever the model's size or `--max-shard-size`; zero_to_fp32-style tools build
the whole state dict first.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch
from tqdm.auto import tqdm

from hf_zero.checkpoint import frozen_source
from hf_zero.checkpoint.export import (
    SavedLayout,
    ShardedWeightsWriter,
    meta_like,
)
from hf_zero.checkpoint.files import CheckpointError, inside, open_shard, sha256
from hf_zero.checkpoint.folders import TRAINER_SUBFOLDER, is_complete, readable_folder
from hf_zero.checkpoint.layout import tp_part_name
from hf_zero.checkpoint.manifest import (
    MANIFEST,
    module_state_file,
    read_manifest,
    stored_entry,
    tp_size,
    tp_split,
    whole_shape,
)
from hf_zero.checkpoint.read import check_shard_files, read_json_object, read_range
from hf_zero.runtime.dtypes import TORCH_DTYPES
from hf_zero.runtime.memory import peak_rss, reset_peak_rss
from hf_zero.runtime.tensor_parallel import join_parts
from hf_zero.settings.config import DTYPES


def find_engine_checkpoint(folder: str | os.PathLike) -> Path:
    """The folder holding manifest.json: `folder` itself, or the engine part of a Trainer checkpoint."""
    folder = Path(folder)
    for candidate in (folder, folder / TRAINER_SUBFOLDER):
        found = readable_folder(candidate)
        if is_complete(found):
            return found
    raise CheckpointError(
        f"{folder} is not an hf_zero checkpoint: neither it nor {folder / TRAINER_SUBFOLDER} holds a "
        f"{MANIFEST} (engine.save_checkpoint or a ZeroTrainer checkpoint-N folder)")


@dataclass
class ConsolidationReport:
    files: list[str]  # names written under the output folder
    weight_bytes: int  # the model's weights as written
    rss_before: int  # resident memory when the weights started to be read
    peak_rss: int  # peak resident memory while the weights were read and written

    def summary(self) -> str:
        mib = 2 ** 20
        return (f"wrote {len(self.files)} files ({self.weight_bytes / mib:.1f} MiB of weights); resident memory "
                f"peaked at {self.peak_rss / mib:.0f} MiB, {(self.peak_rss - self.rss_before) / mib:.0f} MiB above "
                f"the {self.rss_before / mib:.0f} MiB before the weights were read")


def consolidate(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, dtype: str = "fp32",
                max_shard_size: int | str = "5GB", progress: bool = True, overwrite: bool = False,
                merge: bool = False) -> ConsolidationReport:
    """Writes the checkpoint's weights (fp32 masters, cast to `dtype`), config, generation config and
    tokenizer as a transformers folder. `output_dir` must be empty, absent or an earlier consolidation of
    the same checkpoint; with `overwrite`, whatever it holds is replaced. Nothing in it changes until
    every file is written.
    A checkpoint of a peft model (its adapter_config.json beside the manifest) gives its adapter folder, which
    PeftModel.from_pretrained loads onto the base model; with `merge`, the base model with the adapter merged in
    (peft's merge_and_unload), which from_pretrained loads alone."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    source = find_engine_checkpoint(checkpoint_dir)
    manifest, index = read_manifest(source)
    output = Path(output_dir)
    adapter = (source / ADAPTER_CONFIG).is_file()
    if merge and not adapter:
        raise CheckpointError(f"--merge merges a peft adapter into its base model, and {source} holds no "
                              f"{ADAPTER_CONFIG}: it is a whole model's checkpoint; drop --merge")
    # The checkpoint by its folder's name, not its path: the record is uploaded with the weights, and a local
    # path says who ran it where.
    named = source.name if source.parent == Path(checkpoint_dir).parent else f"{source.parent.name}/{source.name}"
    provenance = {"checkpoint": named,
                  "manifest_sha256": sha256(source / MANIFEST),
                  "step": manifest.get("global_steps"), "dtype": dtype}
    _check_output_folder(Path(checkpoint_dir), source, output, provenance, overwrite)
    check_shard_files(manifest["shards"], source)
    if "frozen_source" in manifest and (merge or not adapter):  # the adapter alone reads no frozen weight
        frozen_source.check_source_files(manifest["frozen_source"])
    config_path, config = _model_config(source)
    if adapter:
        return _consolidate_adapter(source, manifest, index, output, dtype, merge, {**provenance, "merged": merge},
                                    progress, config_path, config)
    out_dtype = DTYPES[dtype]
    with open_shard(source, module_state_file(manifest)) as rank0:
        stored = set(rank0.keys())
        missing = [key for _, key in manifest["weights"] if key.startswith("module/") and key not in stored]
        if missing:
            raise CheckpointError(f"{source / module_state_file(manifest)} has no tensor "
                                  f"{missing[0]!r}, which the manifest lists")
        module_meta = {key: (rank0.get_slice(key).get_shape(), rank0.get_slice(key).get_dtype())
                       for _, key in manifest["weights"] if key.startswith("module/")}
    planned = {}
    for name, key in manifest["weights"]:
        if key.startswith("master/"):
            planned[name] = meta_like(whole_shape(manifest, key[len("master/"):]), out_dtype)
        elif key.startswith("frozen/"):
            planned[name] = meta_like(manifest["frozen"][key[len("frozen/"):]]["shape"], out_dtype)
        else:
            shape, stored_dtype = module_meta[key]
            stored = TORCH_DTYPES[stored_dtype]
            planned[name] = meta_like(shape, out_dtype if stored.is_floating_point else stored)
    model = _model_on_meta(config_path, config)
    if "frozen_source" in manifest:
        frozen_source.check_keys(manifest["frozen_source"], model, manifest["frozen"])
    layout = SavedLayout(model, planned)
    rss_before = psutil.Process().memory_info().rss
    reset_peak_rss()

    def write(staging: Path) -> list[str]:
        writer = ShardedWeightsWriter(staging, layout.saved, max_shard_size)
        try:
            for name, key in tqdm(manifest["weights"], desc="Consolidating", unit="tensor", disable=not progress):
                for saved_name, tensor in layout.convert({name: _read_tensor(source, manifest, index, key)}):
                    writer.write(saved_name, tensor)
            layout.check_complete()
            written = writer.close()
        except BaseException:
            writer.abort()
            raise
        return written + _copy_model_files(source, config, staging, dtype)

    written = _write_staged(output, provenance, write)
    weight_bytes = sum(t.numel() * t.element_size() for t in layout.saved.values())
    return ConsolidationReport(written, weight_bytes, rss_before, peak_rss())


def _write_staged(output: Path, provenance: dict, write: Callable[[Path], list[str]]) -> list[str]:
    """`write(staging)` fills a staging folder inside `output` and names its files; the provenance record
    follows, and all of them replace what `output` held only once every one is written."""
    created = [folder for folder in (output, *output.parents) if not folder.exists()]
    staging, moved = None, False
    try:
        staging = _staging_folder(output)
        written = write(staging)
        (staging / PROVENANCE).write_text(json.dumps({**provenance, "files": written}, indent=1) + "\n")
        _move_into_place(staging, output)
        moved = True
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not moved:
            for folder in created:  # a failed consolidation leaves no folder it made behind (deepest first)
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return [*written, PROVENANCE]


ADAPTER_CONFIG = "adapter_config.json"  # peft's, written into the checkpoint of a peft model


def _consolidate_adapter(source: Path, manifest: dict, index: dict, output: Path, dtype: str, merge: bool,
                         provenance: dict, progress: bool, config_path: Path, config_json: dict) -> ConsolidationReport:
    """The peft model is built on meta from the checkpoint's config and adapter config, given the checkpoint's
    tensors (the adapter's alone, or with `merge` every tensor: the whole model in memory, as peft merges), and
    written by peft (the adapter) or by transformers (the merged model): the files each library loads. Side files
    that cannot build it, or build one whose tensors are not the checkpoint's, are refused before anything is read."""
    import transformers
    from peft import PeftConfig, get_peft_model

    base_class = _base_model_class(config_path, config_json)
    adapter_path = source / ADAPTER_CONFIG
    read_json_object(inside(source, ADAPTER_CONFIG))
    try:
        config = transformers.AutoConfig.from_pretrained(source)
        adapter_config = PeftConfig.from_pretrained(source)
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise CheckpointError(f"{config_path} and {adapter_path} do not describe a model transformers "
                              f"{transformers.__version__} and peft can build: "
                              f"{str(error).strip().splitlines()[0]}") from None
    if merge and adapter_config.is_prompt_learning:
        raise CheckpointError(f"--merge: a {adapter_config.peft_type} adapter adds virtual tokens rather "
                              f"than changing weights, so it has nothing to merge; drop --merge to write "
                              f"the adapter folder")
    with torch.device("meta"):  # the base model: no memory until the checkpoint's tensors are assigned
        base = base_class._from_config(config)
    # The adapter's modules and tensors (prompt tokens), where peft puts them.
    model = get_peft_model(base, adapter_config)
    if merge and "frozen_source" in manifest:
        frozen_source.check_keys(manifest["frozen_source"], model, manifest["frozen"])
    trained = {key for _, key in manifest["weights"] if key.startswith("master/")}
    wanted = [(name, key) for name, key in manifest["weights"] if merge or key in trained]
    _check_adapter_shapes(model, manifest, wanted, adapter_path)
    rss_before = psutil.Process().memory_info().rss
    reset_peak_rss()
    out_dtype = DTYPES[dtype]
    state = {name: _cast(_read_tensor(source, manifest, index, key), out_dtype)
             for name, key in tqdm(wanted, desc="Reading", unit="tensor", disable=not progress)}
    model.load_state_dict(state, strict=False, assign=True)
    model.get_base_model().tie_weights()  # a tied weight is stored once: its other names take the loaded tensor

    def write(staging: Path) -> list[str]:
        (model.merge_and_unload() if merge else model).save_pretrained(staging)
        _copy_tokenizer(_model_file_folders(source), staging)
        return sorted(p.name for p in staging.iterdir())

    written = _write_staged(output, provenance, write)
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return ConsolidationReport(written, weight_bytes, rss_before, peak_rss())


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


# Written last into a consolidated folder: which checkpoint it came from and the files it wrote, so that
# consolidating the same checkpoint again may replace them and nothing else is ever replaced unasked.
PROVENANCE = "hf_zero_consolidation.json"
# Inside the output folder while consolidating: the new files, then the replaced ones until they are removed.
STAGING_PREFIX = ".hf_zero_consolidating-"


def _check_output_folder(given: Path, source: Path, output: Path, provenance: dict, overwrite: bool) -> None:
    out = output.resolve()
    for folder in {given.resolve(), source.resolve()}:
        if out == folder or folder in out.parents or out in folder.parents:
            raise CheckpointError(
                f"output folder {output} is the checkpoint {given}, inside it, or holds it: writing there would "
                f"replace checkpoint files; choose another output folder")
    if output.exists() and not output.is_dir():
        raise CheckpointError(f"output folder {output} exists and is not a folder")
    present = sorted(p.name for p in output.iterdir() if not p.name.startswith(STAGING_PREFIX)) \
        if output.is_dir() else []
    if not present or overwrite:
        return
    earlier = _read_provenance(output)
    if earlier is not None and earlier.get("manifest_sha256") == provenance["manifest_sha256"] \
            and set(present) <= {*earlier.get("files", []), PROVENANCE}:
        return  # an earlier consolidation of this same checkpoint, and nothing added to it
    what = "a consolidation of another checkpoint" if earlier is not None else "files of its own"
    listed = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
    raise CheckpointError(
        f"output folder {output} is not empty and holds {what} ({listed}); choose an empty folder, or pass "
        f"--overwrite to replace everything in it")


def _read_provenance(folder: Path) -> dict | None:
    try:
        return json.loads((folder / PROVENANCE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _staging_folder(output: Path) -> Path:
    """A new folder inside `output` (created if needed), so the final moves stay on its file system."""
    try:
        output.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=output, prefix=STAGING_PREFIX))
    except OSError as e:
        raise CheckpointError(f"cannot write to output folder {output}: {e.strerror}") from None


def _move_into_place(staging: Path, output: Path) -> None:
    """Moves every file `output` held aside, the staged ones in, then removes the ones moved aside and any
    staging folder an interrupted consolidation left."""
    replaced = Path(tempfile.mkdtemp(dir=output, prefix=STAGING_PREFIX))
    for entry in output.iterdir():
        if not entry.name.startswith(STAGING_PREFIX):
            entry.rename(replaced / entry.name)
    for entry in staging.iterdir():
        entry.rename(output / entry.name)
    for entry in output.iterdir():
        if entry.name.startswith(STAGING_PREFIX) and entry != staging:
            shutil.rmtree(entry)


def _read_tensor(source: Path, manifest: dict, index: dict, key: str) -> torch.Tensor:
    """One whole tensor: a parameter's fp32 master (joined from its tp parts when it is split across a
    tensor-parallel group), a frozen weight, or a module tensor."""
    kind, name = key.split("/", 1)
    if kind == "module":
        with open_shard(source, module_state_file(manifest)) as rank0:
            return rank0.get_tensor(key)
    split = tp_split(manifest, name)
    if split is None:
        return _read_stored(source, manifest, index, kind, name)
    parts = [_read_stored(source, manifest, index, kind, tp_part_name(name, r))
             for r in range(tp_size(manifest))]
    return join_parts(parts, split["dim"], split["split_factor"])


def _read_stored(source: Path, manifest: dict, index: dict, kind: str, name: str) -> torch.Tensor:
    """One stored tensor assembled from the pieces in each rank's file (only those files are opened, and
    closed after, so their pages do not stay mapped); a frozen weight the checkpoint records by its source, from
    the base model's file (whose size and hash `consolidate` checked)."""
    if kind == "frozen" and "frozen_source" in manifest:
        entry, frozen = manifest["frozen_source"], manifest["frozen"]
        with frozen_source.opened(entry, [name]) as handles:
            numel = math.prod(frozen[name]["shape"])
            return frozen_source.read(handles, entry, frozen, name, 0, numel).view(frozen[name]["shape"])
    with contextlib.ExitStack() as stack:
        files = {file: stack.enter_context(open_shard(source, file))
                 for file in sorted({file for _, _, file in index[name]})}
        entry = stored_entry(manifest, name)
        dtype = entry.get("dtype", "F32")  # a frozen weight's, as the model held it; masters and states are fp32
        numel = math.prod(entry["shape"])
        read_range(files, index, kind, name, 0, numel, None, dtype)  # the files hold it all: then allocate
        whole = torch.empty(numel, dtype=TORCH_DTYPES[dtype])
        read_range(files, index, kind, name, 0, numel, whole, dtype)
        return whole.view(entry["shape"])


def _model_config(source: Path) -> tuple[Path, dict]:
    """The checkpoint's config.json (in its folder or, for a Trainer checkpoint, the checkpoint-N folder around it)
    and what it holds."""
    folders = _model_file_folders(source)
    config_from = next((f for f in folders if (f / "config.json").is_file()), None)
    if config_from is None:
        raise CheckpointError(
            f"no config.json in {' or '.join(map(str, folders))}: the checkpoint was saved from a model that is "
            f"not a transformers PreTrainedModel, so there is no config to load it with")
    return config_from / "config.json", read_json_object(config_from / "config.json")


def _model_on_meta(config_path: Path, config_json: dict) -> torch.nn.Module:
    """The checkpoint's model built on meta from its config.json (no memory): what save_pretrained looks up the
    conversions to revert on. A class transformers does not have (a script's own PreTrainedModel) is a plain module,
    whose names are saved as they are, unless its model type is one transformers converts."""
    import transformers
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    try:
        model_class = _base_model_class(config_path, config_json)
    except CheckpointError as error:
        model_type = config_json.get("model_type")
        if get_checkpoint_conversion_mapping(model_type) is not None:
            raise CheckpointError(f"{error}, and transformers saves {model_type} models in another layout "
                                  f"than it holds them in, which only the model's class can revert: load the "
                                  f"checkpoint into the model (engine.load_checkpoint) and save it with "
                                  f"engine.save_weights or the Trainer's save_model") from None
        return torch.nn.Module()
    try:
        config = transformers.AutoConfig.from_pretrained(config_path.parent)
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise CheckpointError(f"{config_path} does not describe a model transformers "
                              f"{transformers.__version__} can build: "
                              f"{str(error).strip().splitlines()[0]}") from None
    with torch.device("meta"):
        return model_class._from_config(config)


def _base_model_class(config_path: Path, config: dict) -> type:
    """The transformers class config.json's `architectures` names, as save_pretrained records it."""
    import transformers

    names = config.get("architectures")
    if not (isinstance(names, list) and names and all(isinstance(name, str) for name in names)):
        raise CheckpointError(f"{config_path}: 'architectures' must name the model's class, such as "
                              f"[\"GPT2LMHeadModel\"] (save_pretrained records it); got {names!r}")
    found = getattr(transformers, names[0], None)
    if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)):
        raise CheckpointError(f"{config_path}: 'architectures' names {names[0]!r}, which is not a model "
                              f"class of transformers {transformers.__version__}")
    return found


def _check_adapter_shapes(model: torch.nn.Module, manifest: dict, wanted: list[list[str]], adapter_path: Path) -> None:
    """Each tensor to be read has the shape the model built from the side files gives it (an adapter_config.json
    whose r differs from the adapter's weights, say)."""
    built = dict(model.state_dict())
    for name, key in wanted:
        kind, _, stored = key.partition("/")
        if kind == "module" or name not in built:
            continue
        shape = whole_shape(manifest, stored) if kind == "master" else manifest["frozen"][stored]["shape"]
        if list(built[name].shape) != list(shape):
            raise CheckpointError(f"{adapter_path} builds {name} of shape {list(built[name].shape)}, but "
                                  f"the checkpoint holds it as {list(shape)}: the adapter config is not "
                                  f"the one the adapter was trained with")


def _model_file_folders(source: Path) -> list[Path]:
    """Where a checkpoint's model files lie: its folder or, for a Trainer checkpoint, also the checkpoint-N folder
    around it (as `zero_checkpoint.partial` too, where an interrupted save left the newest complete one)."""
    folders = [source, source.parent] if source.name.split(".")[0] == TRAINER_SUBFOLDER else [source]
    for folder in folders:  # what is copied, and may then be uploaded, comes from the checkpoint and nowhere else
        for entry in folder.iterdir():
            inside(folder, entry.name)
    return folders


def _copy_tokenizer(folders: list[Path], output: Path) -> list[str]:
    """The tokenizer saved beside the checkpoint, if any, written into `output`; the names of its files."""
    tokenizer_from = next((f for f in folders if (f / "tokenizer_config.json").is_file()), None)
    if tokenizer_from is None:
        return []
    from transformers import AutoTokenizer

    return [Path(p).name for p in AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(output)]


def _copy_model_files(source: Path, config: dict, output: Path, dtype: str) -> list[str]:
    """config.json (`config`, with the output dtype), generation_config.json and the tokenizer, found in the
    checkpoint folder or, for a Trainer checkpoint, the checkpoint-N folder around it."""
    folders = _model_file_folders(source)
    config_from = next(f for f in folders if (f / "config.json").is_file())
    config = {**config, "dtype": str(DTYPES[dtype]).removeprefix("torch.")}
    (output / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = ["config.json"]
    if (config_from / "generation_config.json").is_file():
        shutil.copyfile(config_from / "generation_config.json", output / "generation_config.json")
        written.append("generation_config.json")
    return written + _copy_tokenizer(folders, output)


def push_to_hub(folder: str | os.PathLike, repo_id: str, commit_message: str = "Upload consolidated weights",
                private: bool | None = None) -> str:
    """Uploads `folder` with huggingface_hub's normal path (create the repo if needed, one commit)."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo_id, exist_ok=True, private=private)
    info = api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), commit_message=commit_message)
    return info.commit_url
