"""The kernels' build cache: built once in a folder of its own, never from a place another user can write."""
import logging
import os
import re
import types
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from hf_zero.ops import build

NAME = "hf_zero_cpu_adam"


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    """An empty extensions cache whose compiler writes an empty library and records where it built, and whose
    import of a cached library records it: the build logic without half a minute of compiling."""
    built_in, imported = [], []

    def compile_for_a_while(name, build_directory, **kwargs):
        built_in.append(Path(build_directory))
        (Path(build_directory) / f"{name}.so").touch()
        return types.ModuleType(name)

    def import_cached(name, library):
        imported.append(library)
        return types.ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", compile_for_a_while)
    monkeypatch.setattr(build, "_import", import_cached)
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setenv(build.EXTENSIONS_DIR_ENV, str(tmp_path / "extensions"))
    return types.SimpleNamespace(built_in=built_in, imported=imported, root=tmp_path / "extensions")


def load_again(monkeypatch) -> None:
    """As a new process would: nothing remembered from an earlier load."""
    monkeypatch.setattr(build, "_built", {})
    build.load_extension(NAME)


def test_the_first_build_says_it_is_building_and_where_it_caches_and_a_later_one_imports_it(
        extensions, monkeypatch, caplog):
    messages = []
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="hf_zero"):
            load_again(monkeypatch)
        messages.append([r.getMessage() for r in caplog.records])
        caplog.clear()
    directory = build.build_directory(NAME)
    assert messages == [[f"building hf_zero's C++ {NAME} kernel on first use (about half a minute); it is "
                         f"cached in {directory} for later runs (`hf-zero build-ops` builds it ahead of time)"], []]
    assert len(extensions.built_in) == 1 and extensions.built_in[0] != directory  # built aside, then moved
    assert extensions.imported == [directory / f"{NAME}.so"]


def test_a_build_killed_halfway_is_never_built_into_again(extensions, monkeypatch, caplog):
    """A killed build leaves its folder, torch's `lock` in it, and perhaps its compiler still running there:
    the next build takes a new folder of its own, removes the leftover, and never waits on its lock."""
    directory = build.build_directory(NAME)
    directory.parent.mkdir(parents=True)
    leftover = directory.parent / f"{NAME}.build-killed"
    leftover.mkdir()
    (leftover / "lock").touch()
    (leftover / "cpu_adam.o").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        load_again(monkeypatch)
    assert extensions.built_in[0].parent == directory.parent and extensions.built_in[0] != leftover
    assert not leftover.exists() and (directory / f"{NAME}.so").is_file()
    assert f"removing {leftover}, left by a build of {NAME} that was interrupted" in caplog.text


def test_an_edited_kernel_is_built_into_a_new_folder(extensions, monkeypatch, tmp_path):
    before = build.build_directory(NAME)
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for source in build.CSRC.iterdir():
        (csrc / source.name).write_bytes(source.read_bytes())
    (csrc / "cpu_adam.cpp").write_text((csrc / "cpu_adam.cpp").read_text() + "\n// edited\n")
    monkeypatch.setattr(build, "CSRC", csrc)
    assert build.build_directory(NAME) != before


@pytest.mark.parametrize("planted", ["a world-writable cache", "a group-writable build folder"])
def test_a_library_in_a_folder_other_users_can_write_is_never_loaded(extensions, monkeypatch, planted):
    directory = build.build_directory(NAME)
    directory.mkdir(parents=True)
    (directory / f"{NAME}.so").write_bytes(b"planted")
    writable = extensions.root if planted == "a world-writable cache" else directory
    writable.chmod(0o777 if writable == extensions.root else 0o775)
    with pytest.raises(RuntimeError, match=re.escape(str(writable)) + r" can be written by other accounts \(mode d.*\); "
                                           r"hf_zero loads compiled code from there"):
        load_again(monkeypatch)
    assert extensions.imported == [] and extensions.built_in == []


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another account needs root")
def test_a_cache_owned_by_another_user_is_refused(extensions, monkeypatch):
    extensions.root.mkdir(mode=0o755)
    os.chown(extensions.root, 12345, 12345)
    with pytest.raises(RuntimeError, match=re.escape(f"{extensions.root} is owned by uid 12345, not by this user")):
        load_again(monkeypatch)
    assert extensions.imported == [] and extensions.built_in == []


def test_a_link_planted_as_the_build_lock_is_refused_and_its_target_kept(extensions, monkeypatch, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    directory = build.build_directory(NAME)
    directory.parent.mkdir(parents=True)
    (directory.parent / f"{NAME}.flock").symlink_to(victim)
    with pytest.raises(RuntimeError, match="cannot open the build lock .*a symbolic link there is refused"):
        load_again(monkeypatch)
    assert victim.read_text() == "precious"
