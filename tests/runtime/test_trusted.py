"""Code run from a place another account could change is refused before it runs (hf_zero.runtime.trusted). The
optimizer's layouts as `hf-zero plan` meets them: tests/cli/test_plan.py."""
from __future__ import annotations

import grp
import os
import pwd
import sys

import pytest

from hf_zero.runtime.trusted import folder_problem, import_checked, others_could_change


@pytest.fixture
def planted(tmp_path, request):
    """A folder on this process's module path, and the marker a module there touches when it runs; the modules it
    imported are forgotten afterwards."""
    folder = tmp_path / "code"
    folder.mkdir(mode=0o755)
    before = set(sys.modules)
    sys.path.insert(0, str(folder))
    request.addfinalizer(lambda: [sys.path.remove(str(folder)), *(sys.modules.pop(name) for name in
                                                                   set(sys.modules) - before)])
    return folder, tmp_path / "ran"


def write(path, text, mode):
    path.write_text(text)
    path.chmod(mode)


def test_a_link_on_the_way_in_a_folder_others_can_write_is_refused(tmp_path, planted):
    """A module found through a link whose folder another account may write: they can point the link elsewhere. The
    folders where the module really is are all private, so only the path as written shows it."""
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    write(real / "linked_optimizers.py", "", 0o644)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "link").symlink_to(real)
    assert folder_problem(real) is None
    assert folder_problem(shared / "link") == f"{shared} can be written by other accounts (mode drwxrwxrwx)"
    sys.path.insert(0, str(shared / "link"))
    try:
        with pytest.raises(ValueError, match=f"^{shared} can be written by other accounts"):
            import_checked("linked_optimizers")
    finally:
        sys.path.remove(str(shared / "link"))


def test_a_neighbour_of_the_module_others_can_write_is_refused_before_anything_runs(planted):
    """The module imports the file beside it: that file is checked with it, before either runs."""
    folder, ran = planted
    write(folder / "neighbour_optimizers.py", "from neighbour_helpers import SGD\n", 0o644)
    write(folder / "neighbour_helpers.py", f"import pathlib, torch\npathlib.Path({str(ran)!r}).touch()\n"
                                           "SGD = torch.optim.SGD\n", 0o666)
    with pytest.raises(ValueError, match=f"^{folder / 'neighbour_helpers.py'} can be written by other accounts"):
        import_checked("neighbour_optimizers")
    assert not ran.exists() and "neighbour_optimizers" not in sys.modules
    (folder / "neighbour_helpers.py").chmod(0o644)
    assert import_checked("neighbour_optimizers").SGD.__name__ == "SGD" and ran.exists()


def test_what_this_users_own_private_group_may_write_is_allowed_and_no_other_group(tmp_path):
    """umask 002 (a user private group, as Red Hat and Fedora give every user) leaves folders group-writable: allowed
    where the group is this user's own (its primary group, named after it, with no other member, as the system's
    group database says), and other accounts' write never."""
    folder = tmp_path / "group"
    folder.mkdir()
    folder.chmod(0o775)
    user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid())
    own = group.gr_name == user and set(group.gr_mem) <= {user} and os.stat(folder).st_gid == os.getgid()
    assert (others_could_change(folder) is None) == own
    folder.chmod(0o757)
    assert others_could_change(folder) == "can be written by other accounts (mode drwxr-xrwx)"
