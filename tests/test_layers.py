"""The package's layers: a module imports only from its own layer or those below it (each layer's __init__
says what it owns), and the GPU simulator is reached only through the device layer's one plug point."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_zero"
# Lowest first. The package's own top-level modules (hf_zero/__init__.py, the former import paths kept as
# re-exports) sit above every layer.
LAYERS = ["settings", "runtime", "ops", "zero", "optim", "checkpoint", "engine", "plan", "hf", "cli"]
TOP = len(LAYERS)
SIMULATOR = "hf_zero.testing"
PLUG_POINT = "hf_zero.runtime.device"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    """The layer's rank of an hf_zero module; None for the simulator, which is no layer of the product."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS + ["testing"]:
        return TOP
    return None if parts[1] == "testing" else LAYERS.index(parts[1])


def name_of(layer: int) -> str:
    return LAYERS[layer] if layer < TOP else "the package's top level"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """Every hf_zero module `path` imports, wherever the import stands (functions and TYPE_CHECKING too), and
    modules named to importlib.import_module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "hf_zero" else [node.module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "hf_zero" or name.startswith("hf_zero.")]


def upward_imports(package: Path) -> list[str]:
    wrong = []
    for path in sorted(package.rglob("*.py")):
        me = module_name(path, package)
        mine = layer_of(me)
        for line, imported in imports_of(path):
            theirs = layer_of(imported)
            where = f"{path.relative_to(package.parent)}:{line} imports {imported}"
            if theirs is None:
                if mine is not None and me != PLUG_POINT:
                    wrong.append(f"{where} (the simulator: only {PLUG_POINT} may)")
            elif mine is not None and theirs > mine:
                wrong.append(f"{where} ({name_of(mine)} below {name_of(theirs)})")
            elif mine is None and theirs > LAYERS.index("runtime"):
                wrong.append(f"{where} (the simulator sees the runtime and settings only)")
    return wrong


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports(PACKAGE) == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: a copy of the package with one upward import added (the device layer reaching the
    engine) and one simulator import outside the plug point is refused, naming both."""
    copy = tmp_path / "hf_zero"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (copy / "runtime" / "memory.py").write_text("from hf_zero.engine import ZeroEngine\n")
    (copy / "zero" / "partition.py").write_text("import hf_zero.testing.simulated_gpu\n")
    wrong = upward_imports(copy)
    assert [w.split(" (")[0] for w in wrong] == ["hf_zero/runtime/memory.py:1 imports hf_zero.engine",
                                                "hf_zero/zero/partition.py:1 imports hf_zero.testing.simulated_gpu"]


def test_settings_import_without_torch():
    """The hf-zero command checks its flags before any process starts, without paying torch's import."""
    code = ("import sys; import hf_zero.settings.config, hf_zero.settings.deepspeed_config, "
            "hf_zero.settings.flag_names, hf_zero.settings.environment; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("old_path, names", [
    ("hf_zero.trainer", ["ZeroTrainer", "ZeroSeq2SeqTrainer"]),
    ("hf_zero.engine", ["ZeroEngine", "initialize"]),
    ("hf_zero.checkpoint", ["CheckpointError", "is_complete"]),
    ("hf_zero.config", ["ZeroConfig"]),
    ("hf_zero.launch", ["init_distributed", "spawn_gloo"]),
    ("hf_zero.run", ["main"]),
])
def test_former_import_paths_still_work(old_path, names):
    module = __import__(old_path, fromlist=names)
    assert all(callable(getattr(module, name)) for name in names)


@pytest.mark.parametrize("old_module, help_says", [("hf_zero.run", "Run an unmodified Hugging Face example script"),
                                                   ("hf_zero.train_lm", "--zero_stage")])
def test_former_launch_modules_still_start_a_rank(old_module, help_says):
    """`torchrun -m hf_zero.run SCRIPT.py` and `torchrun -m hf_zero.train_lm` keep working: each reaches the rank's
    argument parser (--help answers without starting anything)."""
    done = subprocess.run([sys.executable, "-m", old_module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert help_says in done.stdout
