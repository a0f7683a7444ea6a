"""--torch_compile (the `compile` setting): each block compiled on its own, the engine's hooks outside the compiled
code (hf_zero/engine/compile.py). Compiled training is checked against the same run eager and against one process,
and through torch's own AOTAutograd: a backend that counts the forward and backward graphs it runs shows the
compiled code ran, and dynamo's error_on_recompile shows no graph was compiled again."""
from __future__ import annotations

import inspect
import logging
import os
from collections import Counter
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import hf_zero
from hf_zero.engine.compile import _CompiledForward
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.settings.config import ZeroConfigError
from tests.helpers import batch, local_part, make_optimizer, max_diff, tiny_model, train_single_process

WORLD, STEPS, GLOBAL_BATCH = 2, 3, 8
COUNTING = "hf_zero_test_counting_aot_eager"

# (name, engine settings, how the model is changed first): every stage, each offload mode, the delayed update,
# gradient accumulation, ZeRO-R's checkpoints, transformers' own gradient checkpointing and a LoRA adapter.
VARIANTS = [
    ("stage0", {"zero_stage": 0}, None),
    ("stage1", {"zero_stage": 1}, None),
    ("stage2_accumulating", {"zero_stage": 2, "gradient_accumulation_steps": 2}, None),
    ("stage3", {"zero_stage": 3}, None),
    ("stage2_cpu_offload", {"zero_stage": 2, "offload_optimizer": "cpu"}, None),
    ("stage3_cpu_offload", {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, None),
    ("stage3_nvme", {"zero_stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}, None),
    ("stage2_delayed_update", {"zero_stage": 2, "offload_optimizer": "cpu", "delayed_param_update": True,
                               "delayed_param_update_warmup": 1}, None),
    ("stage3_zero_r_cpu_checkpointing", {"zero_stage": 3, "cpu_checkpointing": True}, None),
    ("stage3_gradient_checkpointing", {"zero_stage": 3}, "gradient_checkpointing"),
    ("stage3_lora", {"zero_stage": 3}, "lora"),
]


VARIANTS_BY_NAME = {name: config for name, config, _ in VARIANTS}
BLOCKS = 2  # tiny_model's GPT-2 blocks


def count_compiled_runs() -> Counter:
    """Registers COUNTING: torch's aot_eager (AOTAutograd, no code generation) whose forward and backward graphs
    count each time they run, and each time one is compiled."""
    from torch._dynamo import register_backend
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    runs: Counter = Counter()

    def counted(kind: str):
        def compiler(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
            runs[f"{kind} compiled"] += 1
            compiled = boxed_nop(graph, example_inputs)

            def run(args: list) -> Any:
                runs[kind] += 1
                return compiled(args)
            run._boxed_call = True
            return run
        return compiler

    register_backend(name=COUNTING)(aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward")))
    return runs


def changed(model: nn.Module, change: str | None) -> nn.Module:
    if change == "gradient_checkpointing":
        model.gradient_checkpointing_enable()
    elif change == "lora":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0))
    return model


def train(config: dict, change: str | None, backend: str | None, runs: Counter | None = None) -> dict[str, Any]:
    """STEPS steps of a tiny GPT-2 (dropout off) on this rank's half of each global batch, eager or compiled, then an
    evaluation's forward (`runs`: how many compiled forward graphs it ran)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model("gpt2")
    model.config.use_cache = False  # as the Trainer trains: the blocks then share one graph
    model = changed(model, change)
    compiled = {"compile": True, "compile_backend": backend} if backend else {}
    optimizer = make_optimizer(model) if change != "lora" else \
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = hf_zero.initialize(model, optimizer, {**config, **compiled})
    accumulation = engine.gradient_accumulation_steps
    losses = []
    for step in range(STEPS):
        b = local_part(batch("gpt2", step, GLOBAL_BATCH), rank, world)
        for micro in range(accumulation):
            loss = engine(**{k: v.chunk(accumulation)[micro] for k, v in b.items()}).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    model.eval()
    before = Counter(runs)
    with torch.no_grad():
        eval_loss = engine(**batch("gpt2", 100, 4)).loss.item()
    return {"losses": losses, "masters": engine.gathered_masters(), "eager_blocks": engine.eager_blocks,
            "eval_loss": eval_loss, "eval_runs": (Counter(runs) - before)["forward"]}


def evaluate_and_generate(engine: hf_zero.ZeroEngine, step: int) -> None:
    model = engine.module
    model.eval()
    with torch.no_grad():
        engine(**batch("gpt2", 100 + step, 2))
    model.generate(batch("gpt2", 200 + step, 2)["input_ids"][:, :4], max_new_tokens=3, do_sample=False,
                   pad_token_id=0)
    model.train()


def no_recompile_after_warm_up() -> dict[str, Any]:
    """Stage 3 with parameters in host memory (each unit's storage gathered and freed every step), accumulation 2,
    an evaluation and a generation after each step: two steps warm up, then dynamo must compile nothing more."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # As in a process of its own: the variants before left dynamo's caches holding their graphs, up to its limits.
    torch._dynamo.reset()
    model = tiny_model("gpt2")
    engine = hf_zero.initialize(model, make_optimizer(model), {
        "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", "gradient_accumulation_steps": 2,
        "compile": True, "compile_backend": COUNTING})
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # reset() leaves dynamo's counters
    compiled_after: list[int] = []
    for step in range(5):
        if step == 2:
            torch._dynamo.config.error_on_recompile = True
        b = local_part(batch("gpt2", step, GLOBAL_BATCH), rank, world)
        for micro in range(2):
            engine.backward(engine(**{k: v.chunk(2)[micro] for k, v in b.items()}).loss)
            engine.step()
        evaluate_and_generate(engine, step)
        compiled_after.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    torch._dynamo.config.error_on_recompile = False
    return {"unique_graphs": compiled_after}


def with_nvme_folder(config: dict, folder: str) -> dict:
    if "nvme" not in config.values():
        return config
    os.makedirs(folder, exist_ok=True)
    return {**config, "nvme_path": folder}


def every_variant(nvme_folder: str) -> dict[str, Any]:
    runs = count_compiled_runs()
    results: dict[str, Any] = {}
    for name, config, change in VARIANTS:
        before = Counter(runs)
        results[name] = {how: train(with_nvme_folder(config, f"{nvme_folder}/{name}_{how}"), change, backend, runs)
                         for how, backend in (("eager", None), ("compiled", COUNTING))}
        results[name]["runs"] = runs - before
    results["no_recompile"] = no_recompile_after_warm_up()
    return results


@pytest.fixture(scope="module")
def compiled_and_eager(tmp_path_factory) -> dict[str, Any]:
    return spawn_gloo(every_variant, WORLD, str(tmp_path_factory.mktemp("nvme")))[0]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [name for name, _, _ in VARIANTS])
def test_compiled_training_equals_eager_with_aot_eager(compiled_and_eager, variant):
    """aot_eager runs the graphs AOTAutograd traces, op by op: what dynamo and AOTAutograd change (the engine's hooks
    around compiled blocks, parameters refilled each step, recomputation under checkpointing) shows, and rounding
    does not. Every compiled block's forward and backward graph ran, and none ran eager; an evaluation after training
    ran compiled too, to eager's loss."""
    run = compiled_and_eager[variant]
    calls = STEPS * dict(VARIANTS_BY_NAME[variant]).get("gradient_accumulation_steps", 1) * BLOCKS
    assert run["runs"]["forward"] >= calls and run["runs"]["backward"] >= calls, run["runs"]
    assert run["compiled"]["eager_blocks"] == {} and run["compiled"]["eval_runs"] >= 1
    torch.testing.assert_close(run["compiled"]["losses"], run["eager"]["losses"], rtol=0, atol=1e-6)
    assert abs(run["compiled"]["eval_loss"] - run["eager"]["eval_loss"]) <= 1e-6
    assert max_diff(run["compiled"]["masters"], run["eager"]["masters"]) <= 1e-6


@pytest.mark.slow
def test_nothing_is_compiled_again_after_two_steps_of_training_evaluation_and_generation(compiled_and_eager):
    graphs = compiled_and_eager["no_recompile"]["unique_graphs"]
    assert graphs[0] > 0 and graphs[1:] == [graphs[1]] * 4, graphs


def inductor_every_stage() -> dict[int, dict[str, Any]]:
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # one core per rank: a pool of compile workers would take the other's
    runs = {stage: train({"zero_stage": stage}, None, "inductor") for stage in range(4)}
    return {"runs": runs, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}


@pytest.mark.slow
def test_inductor_compiled_training_matches_one_process_on_the_global_batch_at_every_stage():
    """Inductor generates its own kernels (fused, reductions in its own order): within 1e-5 of one eager process."""
    compiled = spawn_gloo(inductor_every_stage, WORLD)[0]
    reference = train_single_process("gpt2", STEPS, GLOBAL_BATCH)
    assert compiled["graphs"] >= 1  # inductor compiled (dynamo's count of graphs)
    for stage, run in compiled["runs"].items():
        assert run["eager_blocks"] == {}
        assert max_diff(run["masters"], reference["params"]) <= 1e-5, stage


# ---- what is said, and what is refused --------------------------------------------------------------------


class Breaking(nn.Module):
    """A block whose forward dynamo cannot trace whole (a print is a graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        print("", end="")
        return torch.relu(x)


class Blocks(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def engine_of(model: nn.Module, stage: int = 2, backend: str = "eager") -> hf_zero.ZeroEngine:
    return hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"zero_stage": stage, "compile": True, "compile_backend": backend})


def test_a_graph_break_is_said_once_naming_the_block(caplog):
    engine = engine_of(Blocks(Breaking))
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).sum())
            engine.step()
    breaks = [r.getMessage() for r in caplog.records if "graph break" in r.getMessage()]
    assert len(breaks) == 1 and "graph break in blocks.0 (Breaking" in breaks[0], breaks


def test_a_block_holding_a_hooked_module_runs_eager_and_is_said(caplog):
    model = Blocks(Breaking)
    model.blocks[1].linear.register_forward_hook(lambda m, a, out: None)
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        engine = engine_of(model)
    assert list(engine.eager_blocks) == ["blocks.1"]
    assert "blocks.0" not in engine.eager_blocks and isinstance(model.blocks[0].forward, _CompiledForward)
    said = [r.getMessage() for r in caplog.records if "runs eager" in r.getMessage()]
    assert said == ["torch.compile: blocks.1 runs eager: its linear has forward hooks of its own, which dynamo "
                    "would trace into the graph"]


def test_under_zero_r_a_block_left_eager_is_checkpointed_eager():
    """ZeRO-R compiles what a checkpoint runs only for the blocks the engine compiles: a block left eager for a hook
    inside it keeps the hook out of dynamo (here a print, which would break dynamo's graph)."""
    model = tiny_model("gpt2")
    model.config.use_cache = False
    model.transformer.h[1].mlp.register_forward_hook(lambda m, a, out: print("", end=""))
    engine = hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 2, "cpu_checkpointing": True,
                                                               "compile": True, "compile_backend": "aot_eager"})
    assert list(engine.eager_blocks) == ["transformer.h.1"]
    torch._dynamo.utils.counters.clear()
    for step in range(2):
        engine.backward(engine(**batch("gpt2", step, 4)).loss)
        engine.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # block 0 compiled inside its checkpoint
    assert not torch._dynamo.utils.counters["graph_break"]  # block 1 never reached dynamo


def test_a_model_without_blocks_is_compiled_whole_and_said(caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        engine = engine_of(model, stage=3)
    assert isinstance(model.forward, _CompiledForward)
    assert list(inspect.signature(model.forward).parameters) == ["input"]  # what the Trainer inspects, kept
    assert any("has no repeated blocks" in r.getMessage() and "compiled whole" in r.getMessage()
               for r in caplog.records)
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    reference.load_state_dict({k: v.detach().clone() for k, v in engine.gathered_masters().items()})
    x = torch.randn(4, 8)
    torch.testing.assert_close(engine(x), reference(x))


def test_under_aten_cpu_capability_inductor_caches_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """inductor's cache does not tell the instruction sets apart: its AVX-512 kernels loaded under
    ATEN_CPU_CAPABILITY=avx2 gave NaN losses (the inductor test above, run under each capability in turn). A folder
    the user chose is left alone."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    engine_of(Blocks(Breaking), backend="inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "_avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    engine_of(Blocks(Breaking), backend="inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


@pytest.mark.parametrize("settings, message", [
    ({"compile": True, "compile_backend": "inductr"},
     "compile_backend 'inductr' is not a torch.compile backend torch "),
    ({"compile_backend": "aot_eager"}, "compile_backend is set but compile is off"),
    ({"compile": True, "compile_mode": "fastest"}, "compile_mode must be one of default, reduce-overhead, "),
    ({"compile": True, "compile_backend": "aot_eager", "compile_mode": "max-autotune"},
     "compile_mode is inductor's; compile_backend aot_eager takes no mode"),
    ({"compile": True, "zero_stage": 3, "compile_mode": "reduce-overhead"},
     "compile_mode reduce-overhead records CUDA graphs"),
])
def test_bad_compile_settings_are_refused_before_any_work(settings, message):
    model = tiny_model("gpt2")
    with pytest.raises(ZeroConfigError, match=message.replace("(", r"\(")):
        hf_zero.initialize(model, make_optimizer(model), settings)
    assert not isinstance(model.transformer.h[0].forward, _CompiledForward)  # refused before anything was compiled
