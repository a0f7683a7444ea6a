"""Engine checkpoints: exact resume, resume on other world sizes and stages, atomic saves, damaged files."""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_zero
from hf_zero.checkpoint import MANIFEST, CheckpointError, folders
from hf_zero.checkpoint import write as checkpoint_write
from hf_zero.checkpoint.consolidate import consolidate
from hf_zero.runtime.launch import spawn_gloo
from tests.checkpoint_helpers import (
    SAVE_AT,
    STOP,
    continue_from,
    continue_on_this_world,
    new_engine,
    rehash,
    rewrite_shard,
    steps_like_a_fresh_engine,
    train,
    whole_params,
    world2_checkpoint_runs,
    world4_checkpoint_runs,
)
from tests.helpers import hf_zero_messages, make_optimizer, max_diff, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return str(root), spawn_gloo(world2_checkpoint_runs, 2, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s0", "s1", "s2", "s3", "s2_bf16", "s1_fp16"])
def test_resume_on_the_same_world_size_is_bitwise_the_uninterrupted_run(saved, name):
    for rank_result in saved[1]:
        result = rank_result[name]
        assert result["steps"][0] == result["steps"][1] == 6
        assert result["scales"][0] == result["scales"][1]
        for n, p in result["straight"].items():
            assert torch.equal(p, result["resumed"][n]), f"{name}: {n} differs after resuming"


@pytest.mark.slow
def test_a_stage2_checkpoint_continues_at_stage3(saved):
    result = saved[1][0]["s2_to_s3"]
    assert max_diff(result["straight"], result["resumed"]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3, 4])
def test_a_two_rank_checkpoint_continues_the_same_trajectory_on_other_world_sizes(saved, world):
    root, results = saved
    straight = results[0]["s2"]["straight"]
    if world == 1:
        resumed = continue_from(f"{root}/s2", {"zero_stage": 2})
    else:
        resumed = spawn_gloo(continue_on_this_world, world, root)[0]
    assert max_diff(straight, resumed) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("runs, failing_rank", [("saved", 1), ("saved_on_4", 3)])
def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_previous_checkpoint(
        request, runs, failing_rank):
    for rank_result in request.getfixturevalue(runs)[1]:
        result = rank_result["failing_save"]
        assert f"failed on rank {failing_rank}: OSError: [Errno 28] No space left on device" in result["error"]
        assert not result["partial_left"]
        assert max_diff(result["good"], result["reloaded"]) == 0


@pytest.fixture
def one_checkpoint(tmp_path):
    engine = new_engine({"zero_stage": 1})
    train(engine, 0, 2)
    folder = tmp_path / "ckpt"
    engine.save_checkpoint(folder)
    return folder, whole_params(engine)


def test_the_manifest_names_every_file_with_its_checksum(one_checkpoint):
    folder, _ = one_checkpoint
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["rank00000-of-00001.safetensors"]
    assert len(manifest["shards"][0]["sha256"]) == 64
    assert manifest["optimizer"]["elementwise"] == ["exp_avg", "exp_avg_sq"]
    assert manifest["optimizer"]["scalars"][0] == {"step": 2.0}
    assert set(manifest["parameters"]) == {n for n, _ in tiny_model("gpt2").named_parameters()}


def test_a_truncated_shard_is_named_and_nothing_is_loaded(one_checkpoint):
    folder, _ = one_checkpoint
    shard = folder / "rank00000-of-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    engine = new_engine({"zero_stage": 1})
    before = whole_params(engine)
    with pytest.raises(CheckpointError, match=r"rank00000-of-00001.safetensors is \d+ bytes, the manifest says"):
        engine.load_checkpoint(folder)
    assert max_diff(before, whole_params(engine)) == 0
    assert engine.global_steps == 0


def test_a_corrupted_shard_is_named(one_checkpoint):
    folder, _ = one_checkpoint
    shard = folder / "rank00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank00000-of-00001.safetensors does not match its SHA-256"):
        new_engine({"zero_stage": 1}).load_checkpoint(folder)


def test_a_missing_rank_file_is_named(one_checkpoint):
    folder, _ = one_checkpoint
    (folder / "rank00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank00000-of-00001.safetensors is missing"):
        new_engine({"zero_stage": 1}).load_checkpoint(folder)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(one_checkpoint):
    folder, _ = one_checkpoint
    with pytest.raises(CheckpointError, match=r"from another model.*parameter 'bert.embeddings"):
        new_engine({"zero_stage": 1}, kind="bert").load_checkpoint(folder)


def test_a_lone_previous_checkpoint_left_by_an_interrupted_swap_is_loaded(one_checkpoint, caplog):
    folder, params = one_checkpoint
    shutil.move(folder, folder.with_name("ckpt.old"))
    engine = new_engine({"zero_stage": 1})
    engine.load_checkpoint(folder)
    assert max_diff(whole_params(engine), params) == 0
    assert "a save was interrupted; loading the newest complete checkpoint" in caplog.text


class Killed(BaseException):
    """Stands for the process dying: no `except Exception` of the code under test catches it, and nothing
    after the point of death runs, so the folders are left as a kill would leave them."""


def die_at(monkeypatch, step: int) -> list[str]:
    """Makes the `step`-th change a save makes to its folders (1-based) kill it: before that change, or
    for a removal halfway through it. Returns the changes made, as they are made."""
    changes: list[str] = []

    def dying(kind, change):
        def wrapped(*args, **kwargs):
            changes.append(f"{kind} {' '.join(Path(a).name for a in args[:2] if isinstance(a, (str, Path)))}")
            if len(changes) == step:
                if kind == "remove" and args[0].is_dir():  # halfway, in _remove's order: the manifest first,
                    (args[0] / MANIFEST).unlink(missing_ok=True)  # the marker last
                    for file in [f for f in sorted(args[0].iterdir()) if f.name != folders.MARKER][::2]:
                        file.unlink()
                raise Killed
            return change(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(folders, "rename", dying("rename", folders.rename))
    monkeypatch.setattr(folders, "remove_folder", dying("remove", folders.remove_folder))
    monkeypatch.setattr(checkpoint_write, "save_file", dying("write", checkpoint_write.save_file))
    return changes


def test_a_save_killed_at_any_point_never_loses_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    """Kills a save over a checkpoint at each change it makes to the folders, then kills the next save
    (from a fresh engine, which first recovers what the crash left) at each of its changes; after every
    kill the checkpoint loads, and it is never older than what loaded before."""
    engines = {step: new_engine({"zero_stage": 1}) for step in (0, SAVE_AT, STOP)}
    train(engines[SAVE_AT], 0, SAVE_AT)
    train(engines[STOP], 0, STOP)
    params = {step: whole_params(engine) for step, engine in engines.items()}

    def loaded_step(folder) -> int:
        engine = new_engine({"zero_stage": 1})
        engine.load_checkpoint(folder)
        assert max_diff(whole_params(engine), params[engine.global_steps]) == 0
        return engine.global_steps

    def killed_save(engine, folder, step: int) -> list[str]:
        with monkeypatch.context() as patch:
            changes = die_at(patch, step)
            try:
                engine.save_checkpoint(folder)
            except Killed:
                return changes
        return changes + ["(finished)"]

    engines[SAVE_AT].save_checkpoint(tmp_path / "count" / "ckpt")
    plain = killed_save(engines[STOP], tmp_path / "count" / "ckpt", 0)[:-1]  # the changes of a save over one
    assert [c.split()[0] for c in plain] == ["remove", "remove", "write", "rename", "rename", "rename", "remove"], plain
    windows = 0
    for first in range(1, len(plain) + 1):
        folder = tmp_path / f"first{first}" / "ckpt"
        engines[SAVE_AT].save_checkpoint(folder)
        killed_save(engines[STOP], folder, first)
        after_first = loaded_step(folder)
        assert after_first in (SAVE_AT, STOP), plain[first - 1]
        second = 1
        while True:
            trial = tmp_path / f"first{first}" / f"second{second}"
            shutil.copytree(folder.parent, trial / "copy", symlinks=True,
                            ignore=lambda d, names: [n for n in names if n.startswith("second")])
            changes = killed_save(engines[0], trial / "copy" / "ckpt", second)
            windows += 1
            step = loaded_step(trial / "copy" / "ckpt")
            assert step == 0 or step == after_first, (plain[first - 1], changes[-1], step, after_first)
            if changes[-1] == "(finished)":
                assert step == 0
                break
            second += 1
    assert windows >= 7 * 7, windows  # every point of the first save, each with every point of the next (57)
@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints4")
    return root, spawn_gloo(world4_checkpoint_runs, 4, str(root))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["s1", "s2", "s3"])
def test_resume_on_4_ranks_is_bitwise_the_uninterrupted_run(saved_on_4, name):
    for rank_result in saved_on_4[1]:
        result = rank_result[name]
        assert result["steps"] == (6, 6)
        for n, p in result["straight"].items():
            assert torch.equal(p, result["resumed"][n]), f"{name}: {n} differs after resuming"


@pytest.mark.slow
def test_a_4_rank_stage3_checkpoint_consolidates_to_the_same_logits(saved_on_4, tmp_path):
    from hf_zero.checkpoint.consolidate import consolidate
    from tests.checkpoint.test_consolidate import logits_from
    from tests.checkpoint_helpers import assert_same_logits

    root, results = saved_on_4
    consolidate(root / "s3", tmp_path, max_shard_size="20KB", progress=False)
    assert_same_logits(logits_from(tmp_path), results[0]["s3_logits"])


@pytest.mark.slow
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    folder = tmp_path / "ckpt"
    script = f"from tests.checkpoint_helpers import crash_during_save; crash_during_save({str(folder)!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 17, done.stderr  # it died inside the second save
    assert (tmp_path / "ckpt.partial").is_dir()
    engine = new_engine({"zero_stage": 1})
    engine.load_checkpoint(folder)
    assert engine.global_steps == SAVE_AT
    reference = new_engine({"zero_stage": 1})
    train(reference, 0, SAVE_AT)
    assert max_diff(whole_params(reference), whole_params(engine)) == 0
    engine.save_checkpoint(folder)  # the next save clears what the crash left
    assert not (tmp_path / "ckpt.partial").exists()


def test_a_checkpoints_learning_rate_and_weight_decay_win_and_a_warning_says_so(one_checkpoint, caplog):
    import logging

    folder, _ = one_checkpoint
    model = tiny_model("gpt2")
    optimizer = make_optimizer(model, lr=5e-4)
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 1, "reduce_bucket_size": 3000})
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        engine.load_checkpoint(folder)
    warnings = hf_zero_messages(caplog.records)
    assert any("param group 0 has lr 0.0005 in this optimizer and 0.001 in the checkpoint; the checkpoint's value "
               "is used" in w for w in warnings), warnings
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 1e-3]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        new_engine({"zero_stage": 1}).load_checkpoint(folder)  # the same settings: nothing to say
    assert not [r for r in caplog.records if "load_checkpoint" in r.getMessage()]


def test_shard_files_get_the_permissions_of_the_other_files(tmp_path):
    old_mask = os.umask(0o022)
    try:
        new_engine({"zero_stage": 1}).save_checkpoint(tmp_path / "ckpt")
    finally:
        os.umask(old_mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "ckpt").iterdir()}
    assert modes["manifest.json"] == 0o644
    assert modes["rank00000-of-00001.safetensors"] == modes["manifest.json"], modes


class NewTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every tensor an op creates (not a view of one already there), but for those in `exempt`."""

    def __init__(self, exempt: set[int]) -> None:
        super().__init__()
        self.exempt, self.bytes = exempt, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if torch.is_tensor(t)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs | self.exempt:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_save_copies_the_states_to_host_buffers_and_allocates_nothing_state_sized_on_the_device(
        tmp_path, monkeypatch):
    """Under the simulated GPU every engine tensor counts as device memory. A save must move the masters and
    Adam moments to host buffers made by hf_zero.runtime.device, not clone them where they are (about 12 bytes per
    parameter / Nd of device memory for the duration of the save)."""
    monkeypatch.setenv("HF_ZERO_SIMULATE_ASYNC", "1")
    engine = new_engine({"zero_stage": 2})
    train(engine, 0, 1)
    host_buffers: set[int] = set()
    made_on_host = hf_zero.runtime.device.host_empty

    def host_empty(numel, dtype):  # host memory: not counted
        with torch.utils._python_dispatch._disable_current_modes():
            buffer = made_on_host(numel, dtype)
        host_buffers.add(buffer.untyped_storage().data_ptr())
        return buffer

    monkeypatch.setattr(hf_zero.runtime.device, "host_empty", host_empty)
    queue = hf_zero.testing.simulated_gpu.CopyEngine.queue

    def queue_unseen(*args):  # the simulation's own copies of the values are not the engine's allocations
        with torch.utils._python_dispatch._disable_current_modes():
            return queue(*args)

    monkeypatch.setattr(hf_zero.testing.simulated_gpu.CopyEngine, "queue", queue_unseen)
    counter = NewTensorBytes(host_buffers)
    with counter:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    states = 3 * sum(p.numel() for p in engine.module.parameters()) * 4
    assert counter.bytes < 0.05 * states, f"{counter.bytes} bytes made outside host buffers; states {states}"
    continued = new_engine({"zero_stage": 2})
    continued.load_checkpoint(str(tmp_path / "ckpt"))
    assert max_diff(continued.gathered_masters(), engine.gathered_masters()) == 0


# ---- what a save may replace --------------------------------------------------------------------
def test_a_save_into_a_folder_of_other_files_is_refused_and_deletes_nothing(tmp_path):
    folder = tmp_path / "run"
    (folder / "runs").mkdir(parents=True)
    for name in ("train.log", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text(name)
    engine = new_engine({"zero_stage": 1})
    with pytest.raises(CheckpointError, match=r"run holds files that are not an hf_zero checkpoint \(model.safetensors, "
                                              r"runs, tokenizer.json, train.log\)"):
        engine.save_checkpoint(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "runs", "tokenizer.json", "train.log"]
    assert (folder / "train.log").read_text() == "train.log"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_save_over_a_plain_file_is_refused(tmp_path):
    (tmp_path / "ckpt").write_text("notes")
    with pytest.raises(CheckpointError, match="ckpt exists and is not a folder"):
        new_engine({"zero_stage": 1}).save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt").read_text() == "notes"


def test_a_save_into_an_empty_folder_or_over_an_earlier_checkpoint_works(tmp_path):
    (tmp_path / "ckpt").mkdir()
    engine = new_engine({"zero_stage": 1})
    engine.save_checkpoint(tmp_path / "ckpt")
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    loaded = new_engine({"zero_stage": 1})
    loaded.load_checkpoint(tmp_path / "ckpt")
    assert max_diff(whole_params(loaded), whole_params(engine)) == 0


@pytest.mark.parametrize("beside", ["ckpt.old", "ckpt.partial"])
def test_a_users_folders_beside_a_checkpoint_are_never_moved_or_removed(one_checkpoint, beside):
    folder, params = one_checkpoint
    users = folder.with_name(beside)
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=rf"{beside} holds files that are not an hf_zero checkpoint \(notes.txt\)"):
        new_engine({"zero_stage": 1}).save_checkpoint(folder)
    assert (users / "notes.txt").read_text() == "mine"
    engine = new_engine({"zero_stage": 1})
    engine.load_checkpoint(folder)
    assert max_diff(whole_params(engine), params) == 0


@pytest.mark.parametrize("directory", ["", "/", "."])
def test_a_save_to_no_folder_name_is_refused_naming_it(directory):
    with pytest.raises(CheckpointError, match=rf"save_checkpoint needs a folder to create or replace.*got '{directory}'"):
        new_engine({"zero_stage": 1}).save_checkpoint(directory)


# ---- a damaged or crafted checkpoint: one CheckpointError, and nothing changes ----------------------
SHARD = "rank00000-of-00001.safetensors"


def _edit_manifest(change):
    def edit(folder: Path) -> None:
        manifest = json.loads((folder / MANIFEST).read_text())
        change(manifest)
        (folder / MANIFEST).write_text(json.dumps(manifest))  # NaN is written as JSON's NaN
    return edit


def _first_parameter(manifest) -> str:
    return next(iter(manifest["parameters"]))


def _overlapping_pieces(manifest) -> None:
    """Two pieces of one parameter that overlap, with sizes adding up to its element count."""
    pieces = manifest["shards"][0]["pieces"]
    name, lo, hi = pieces[0]
    pieces[0] = [name, lo, hi - 4]
    pieces.append([name, hi - 8, hi - 4])


def _header(length: int, header: bytes) -> bytes:
    return length.to_bytes(8, "little") + header


def _replace_shard_bytes(data: bytes):
    def replace(folder: Path) -> None:
        (folder / SHARD).write_bytes(data)
        rehash(folder)
    return replace


def _shard_outside(folder: Path) -> None:
    outside = folder.parent / "elsewhere.safetensors"
    shutil.move(folder / SHARD, outside)
    (folder / SHARD).symlink_to(outside)


def _move_shard(named: str | None = None):
    """Moves the shard where the manifest then names it: `named` relative to the folder, or (None) an
    absolute path outside it."""
    def move(folder: Path) -> None:
        target = folder / named if named else folder.parent / "absolute.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(folder / SHARD, target)
        _edit_manifest(lambda m: m["shards"][0].update(file=named or str(target)))(folder)
    return move


def _last_tensor_dropped(folder: Path) -> None:
    rewrite_shard(folder / SHARD, lambda tensors: tensors.pop(sorted(k for k in tensors if k.startswith("master/"))[-1]))


def _a_tensor_as_f16(folder: Path) -> None:
    def to_f16(tensors):
        key = sorted(k for k in tensors if k.startswith("master/"))[0]
        tensors[key] = tensors[key].half()
    rewrite_shard(folder / SHARD, to_f16)


DAMAGE = {  # what is done to the checkpoint -> what the error says
    "manifest not UTF-8": (lambda f: (f / MANIFEST).write_bytes(b'{"format": "\xff\xfe"}'), "not valid JSON"),
    "manifest a list": (lambda f: (f / MANIFEST).write_text("[]"), "is not an hf_zero.checkpoint v1 manifest"),
    "no shards entry": (_edit_manifest(lambda m: m.pop("shards")), "an entry 'shards' is missing"),
    "no global_steps": (_edit_manifest(lambda m: m.pop("global_steps")), "an entry 'global_steps' is missing"),
    "no loss_scaler": (_edit_manifest(lambda m: m.pop("loss_scaler")), "an entry 'loss_scaler' is missing"),
    "parameters a list": (_edit_manifest(lambda m: m.update(parameters=[])), "parameters must be an object"),
    "shape a string": (_edit_manifest(lambda m: m["parameters"][_first_parameter(m)].update(shape="abc")), "has shape 'abc'"),
    "pieces a number": (_edit_manifest(lambda m: m["shards"][0].update(pieces=7)), "not iterable"),
    "global_steps NaN": (_edit_manifest(lambda m: m.update(global_steps=float("nan"))), "global_steps must be a count"),
    "lr NaN": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(lr=float("nan"))), "finite numbers"),
    "loss scale NaN": (_edit_manifest(lambda m: m["loss_scaler"].update(scale=float("nan"))), "positive finite scale"),
    "Adam step infinite": (_edit_manifest(lambda m: m["optimizer"]["scalars"][0].update(step=float("inf"))),
                           "optimizer.scalars must hold finite numbers"),
    # Values of the right JSON type that no optimizer can use loaded, and trained wrong or failed.
    "lr negative": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(lr=-1.0)),
                    "optimizer.param_groups[0].lr must be a finite number of at least 0; got -1.0"),
    "lr a string": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(lr="0.1")),
                    "optimizer.param_groups[0].lr must be a finite number of at least 0; got '0.1'"),
    "betas out of range": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(betas=[0.9, 1.0])),
                           "optimizer.param_groups[0].betas must be two numbers, each at least 0 and below 1"),
    "amsgrad a number": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(amsgrad=1)),
                         "optimizer.param_groups[0].amsgrad must be true, false or null; got 1"),
    "Adam step negative": (_edit_manifest(lambda m: m["optimizer"]["scalars"][0].update(step=-3.0)),
                           "optimizer.scalars[0].step must be a whole number of at least 0 (a count); got -3.0"),
    "Adam step fractional": (_edit_manifest(lambda m: m["optimizer"]["scalars"][0].update(step=2.5)),
                             "optimizer.scalars[0].step must be a whole number of at least 0 (a count); got 2.5"),
    # Numbers too big for a float (JSON has no limit on an integer): math.isfinite raised OverflowError.
    "lr beyond a float": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(lr=10**400)),
                          "finite numbers"),
    "Adam step beyond a float": (_edit_manifest(lambda m: m["optimizer"]["scalars"][0].update(step=10**400)),
                                 "optimizer.scalars must hold finite numbers"),
    "loss scale beyond a float": (_edit_manifest(lambda m: m["loss_scaler"].update(scale=10**400)),
                                  "positive finite scale"),
    # torch's load_state_dict refused a group's list of params only after the masters were set.
    "params listed in a param group": (_edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(params=[])),
                                       "optimizer.param_groups must not list params"),
    "overlapping pieces": (_edit_manifest(_overlapping_pieces), "is damaged: the checkpoint's shards do not hold each"),
    "no rank-0 shard": (_move_shard("rank00001-of-00002.safetensors"), "no shard of rank 0"),
    "shard name leaves the folder": (_move_shard("../elsewhere/evil.safetensors"), "is not a file name of this folder"),
    "shard name absolute": (_move_shard(), "is not a file name of this folder"),
    "shard a link outside": (_shard_outside, "outside the checkpoint folder"),
    "header too large": (_replace_shard_bytes(_header(2**40, b"{}")), "is not a readable safetensors file"),
    "header offsets outside the file": (_replace_shard_bytes(
        _header(64, b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,9999]}}'.ljust(64))),
        "is not a readable safetensors file"),
    "a tensor stored as F16": (_a_tensor_as_f16, "is F16 of shape"),
    "the last chunk's tensor missing": (_last_tensor_dropped, "has no tensor 'master/"),
}


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean") / "ckpt"
    engine = new_engine({"zero_stage": 1})
    train(engine, 0, 2)
    engine.save_checkpoint(folder)
    return folder


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_one_error_naming_the_file_and_changes_nothing(clean_checkpoint, tmp_path, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(clean_checkpoint, folder)
    make, says = DAMAGE[damage]
    make(folder)
    engine = new_engine({"zero_stage": 1})
    with pytest.raises(CheckpointError, match=re.escape(says)) as loading:
        engine.load_checkpoint(folder)
    assert "\n" not in str(loading.value) and ("manifest.json" in str(loading.value) or SHARD in str(loading.value))
    assert steps_like_a_fresh_engine(engine, {"zero_stage": 1})
    with pytest.raises(CheckpointError, match=re.escape(says)):
        consolidate(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["maximize", "amsgrad", "capturable"])
def test_an_optimizer_flag_the_checkpoint_changes_is_refused_naming_it_and_changes_nothing(clean_checkpoint, tmp_path,
                                                                                           flag):
    """maximize trained by gradient ascent, amsgrad failed at the next step for want of its state, capturable on a
    device assertion: the checkpoint's hyper-parameters win at load, but not its flags."""
    folder = tmp_path / "ckpt"
    shutil.copytree(clean_checkpoint, folder)
    _edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update({flag: True}))(folder)
    engine = new_engine({"zero_stage": 1})
    with pytest.raises(CheckpointError, match=re.escape(f"param group 0 has {flag}=true in the checkpoint and "
                                                        f"{flag}=false in this run's AdamW")):
        engine.load_checkpoint(folder)
    assert steps_like_a_fresh_engine(engine, {"zero_stage": 1})
    engine.load_checkpoint(clean_checkpoint)  # the unedited checkpoint loads: the refusal is the flag's


def test_a_kernel_flag_the_checkpoint_changes_stays_this_runs_and_a_warning_says_so(clean_checkpoint, tmp_path,
                                                                                     caplog):
    """foreach and fused choose which of torch's kernels runs the same update: a checkpoint from a run that used
    another (fused on a GPU) resumes, keeping this run's choice, and says so."""
    folder = tmp_path / "ckpt"
    shutil.copytree(clean_checkpoint, folder)
    _edit_manifest(lambda m: m["optimizer"]["param_groups"][0].update(foreach=True))(folder)
    engine = new_engine({"zero_stage": 1})
    mine = engine.optimizer.param_groups[0]["foreach"]
    engine.load_checkpoint(folder)
    assert engine.optimizer.param_groups[0]["foreach"] == mine != True  # noqa: E712 (None, False: not the file's)
    assert "has foreach=" in caplog.text and "this run's is kept" in caplog.text


def test_consolidating_a_shape_no_memory_holds_fails_in_one_line_and_leaves_no_output_folder(clean_checkpoint,
                                                                                              tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(clean_checkpoint, folder)

    def huge(manifest):
        name = _first_parameter(manifest)
        manifest["parameters"][name]["shape"] = [2**38]
        for shard in manifest["shards"]:
            shard["pieces"] = [piece for piece in shard["pieces"] if piece[0] != name]
        manifest["shards"][0]["pieces"].append([name, 0, 2**38])
    _edit_manifest(huge)(folder)
    with pytest.raises(CheckpointError) as consolidating:
        consolidate(folder, tmp_path / "out" / "model", progress=False)
    assert "\n" not in str(consolidating.value)
    assert not (tmp_path / "out").exists()


def test_a_rank_that_cannot_read_its_shard_fails_every_rank_alike_and_none_changes(saved):
    for result in saved[1]:
        outcome = result["unreadable_shard"]
        assert re.fullmatch(r"reading the shard headers under \S+ failed on rank 1: CheckpointError: "
                            r"rank00001-of-00002.safetensors has no tensor '\S+', which the manifest places there",
                            outcome["error"]), outcome["error"]
        assert outcome["unchanged"]


def test_a_folder_name_whose_partial_folder_the_file_system_cannot_name_is_refused_before_anything_is_written(
        tmp_path):
    """A name of 248-255 bytes is valid, but not its `.partial`; the save's cleanup then raised a
    second `OSError: File name too long` that hid the CheckpointError."""
    engine = new_engine({"zero_stage": 2})
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    too_long = "c" * (limit - 4)
    with pytest.raises(CheckpointError, match=f"'{too_long}' is {limit - 4} bytes; a save also writes .*\\(names are "
                                              f"at most {limit} bytes\\): use a name of at most {limit - 8} bytes"):
        engine.save_checkpoint(tmp_path / too_long)
    assert list(tmp_path.iterdir()) == []
    engine.save_checkpoint(tmp_path / ("c" * (limit - 8)))  # the longest that fits
    assert folders.is_complete(tmp_path / ("c" * (limit - 8)))


def test_a_second_save_of_the_same_folder_while_one_is_in_progress_is_refused_and_leaves_the_first_whole(
        tmp_path, monkeypatch):
    """Two processes saving into one folder at once corrupted nothing, but the second said
    "ck.partial holds files that are not an hf_zero checkpoint". Here the second save (another engine: the lock is
    a file lock, which a second open of the file in this process meets as another process would) runs while the
    first writes its shards."""
    folder = tmp_path / "ck"
    write_shard = checkpoint_write._write_shard
    second: list[CheckpointError] = []

    def another_save_meanwhile(*args):
        monkeypatch.setattr(checkpoint_write, "_write_shard", write_shard)
        with pytest.raises(CheckpointError) as refused:
            new_engine({"zero_stage": 2}).save_checkpoint(folder)
        second.append(refused.value)
        return write_shard(*args)

    engine = new_engine({"zero_stage": 2})
    train(engine, 0, 1)
    monkeypatch.setattr(checkpoint_write, "_write_shard", another_save_meanwhile)
    engine.save_checkpoint(folder)
    assert re.search(f"another save of {re.escape(str(folder))} is in progress \\(it holds "
                        f"{re.escape(str(folder))}.lock\\); wait for it to end, or save to another folder",
                        str(second[0])), second
    continued = new_engine({"zero_stage": 2})
    continued.load_checkpoint(folder)
    assert max_diff(whole_params(continued), whole_params(engine)) == 0


@pytest.mark.parametrize("target", ["a file", "nothing"])
def test_a_symbolic_link_at_the_save_lock_is_refused_naming_it(tmp_path, target):
    """A link at ck.lock (filelock follows none) said only `OSError: [Errno 40] Too many levels
    of symbolic links`. The link and what it points to are left as they were."""
    pointed = tmp_path / "elsewhere"
    if target == "a file":
        pointed.write_text("a user's file\n")
    (tmp_path / "ck.lock").symlink_to(pointed)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(tmp_path / 'ck.lock'))}, the save's lock, is a "
                                              f"symbolic link: it must be a plain file or absent; remove it, or save "
                                              f"to another folder"):
        new_engine({"zero_stage": 2}).save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck.lock").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == (
        ["ck.lock", "elsewhere"] if target == "a file" else ["ck.lock"])
    assert target == "nothing" or pointed.read_text() == "a user's file\n"
