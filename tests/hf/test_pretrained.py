"""Partitioned from_pretrained and from_config at stage 3 (hf_zero/hf/pretrained.py): once stage-3 arguments are
parsed, the model is built on meta and each rank fills only its shards, with the values a whole-model build
gives, and no rank holds the whole model while it loads."""
from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    set_seed,
)

from hf_zero.hf import pretrained
from hf_zero.runtime.launch import spawn_gloo
from tests.helpers import assert_saved_as_stock_saves, max_diff, named_copy
from tests.script_references import run_script_reference

SCRIPT = Path(__file__).parents[1] / "scripts" / "hf_style_clm.py"
SEED = 7


def save_gpt2(folder: Path, n_layer: int = 2, n_embd: int = 32, vocab_size: int = 64) -> int:
    """A randomly initialised GPT-2 written by save_pretrained as sharded safetensors; returns its fp32 bytes."""
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab_size,
                                       n_positions=16, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(folder, max_shard_size=f"{max(1, n_embd * n_embd * 16 // 1000)}KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return sum(p.numel() for p in model.parameters()) * 4


def save_bert(folder: Path) -> None:
    torch.manual_seed(1)
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=16)).save_pretrained(folder)


def save_converted(folders: dict[str, Path]) -> None:
    """A tiny Mixtral and ViT as transformers 5.24 saves them: Mixtral's experts one tensor each (`block_sparse_moe.
    experts.N.w1.weight`, ...), which transformers merges into one 3-D tensor while loading; ViT under its legacy
    names (`encoder.layer.N.attention.attention.query`), which it renames."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        ViTConfig,
        ViTForImageClassification,
    )

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                                     max_position_embeddings=32)).save_pretrained(folders["mixtral"])
    ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=48, image_size=16, patch_size=8,
                                        num_labels=3)).save_pretrained(folders["vit"])


CONVERTED = {"mixtral": AutoModelForCausalLM, "vit": AutoModelForImageClassification}


def build_converted(folders: dict[str, Path], output_dir: Path) -> dict:
    """Each converted checkpoint from_pretrained under stage-3 arguments, handed to ZeroTrainer: the values the
    engine then holds, gathered; then saved by save_model into output_dir/kind."""
    from hf_zero import ZeroTrainer

    results = {}
    for kind, auto in CONVERTED.items():
        set_seed(SEED)
        args = arguments(output_dir)
        model = auto.from_pretrained(folders[kind])
        results[f"{kind}_on_meta"] = all(p.is_meta for p in model.parameters())
        trainer = ZeroTrainer(model=model, args=args)
        results[kind] = gathered(trainer)
        trainer.save_model(str(output_dir / kind))
    return results


def test_checkpoints_transformers_converts_while_loading_build_partitioned_with_the_whole_builds_values(tmp_path):
    """transformers' conversion mapping, applied per unit: Mixtral's experts merged from their one-by-one tensors,
    ViT's legacy names renamed. Refused before ("is not stored as one tensor of that shape"). save_model reverts
    the conversions as save_pretrained does: the checkpoint comes back as it was."""
    folders = {kind: tmp_path / kind for kind in CONVERTED}
    save_converted(folders)
    expected = {kind: named_copy(auto.from_pretrained(folders[kind])) for kind, auto in CONVERTED.items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in expected["mixtral"]  # one 3-D tensor of all the experts
    for result in spawn_gloo(build_converted, 2, folders, tmp_path / "out"):
        for kind in CONVERTED:
            assert result[f"{kind}_on_meta"]
            assert result[kind].keys() == expected[kind].keys()
            assert max_diff(result[kind], expected[kind]) == 0, kind
    for kind in CONVERTED:
        assert_saved_as_stock_saves(tmp_path / "out" / kind, folders[kind])


def arguments(output_dir: Path, partitioned: bool = True, zero_stage: int | str = 3, **more):
    from training_args import ZeroTrainingArguments

    return ZeroTrainingArguments(output_dir=str(output_dir), zero_stage=zero_stage, use_cpu=True, report_to=[], seed=SEED,
                                 zero_init_partitioned=partitioned, save_strategy="no", **more)


def gathered(trainer) -> dict[str, torch.Tensor]:
    with trainer.engine.gathered_parameters():
        return named_copy(trainer.model)


def build_three_ways(folders: dict[str, Path], output_dir: Path, tensor_parallel_size: int) -> dict:
    """On each rank, under stage-3 arguments: GPT-2 from_pretrained, BERT for sequence classification from a
    masked-LM checkpoint (a new head) and GPT-2 from_config, each handed to ZeroTrainer; the values the
    engine then holds, gathered, and what the models held before the Trainer. Each Trainer gets arguments of its
    own: once a Trainer has taken its model, its arguments build whole models again (`later`, a model loaded to
    evaluate after training, which no engine would fill)."""
    from hf_zero import ZeroTrainer

    def stage3_arguments():
        return arguments(output_dir, tensor_parallel_size=tensor_parallel_size)

    results = {}
    set_seed(SEED)
    args = stage3_arguments()
    gpt2 = AutoModelForCausalLM.from_pretrained(folders["gpt2"])
    results["gpt2_on_meta"] = all(p.is_meta for p in gpt2.parameters())
    results["gpt2"] = gathered(ZeroTrainer(model=gpt2, args=args))
    later = AutoModelForCausalLM.from_pretrained(folders["gpt2"])
    results["later_on_meta"] = any(p.is_meta for p in later.parameters())
    results["later"] = named_copy(later)
    set_seed(SEED)
    args = stage3_arguments()
    bert, info = BertForSequenceClassification.from_pretrained(folders["bert"], num_labels=3,
                                                               output_loading_info=True)
    results["bert_on_meta"] = bert.bert.embeddings.word_embeddings.weight.is_meta  # read later, by the engine
    results["bert_missing"] = sorted(info["missing_keys"])
    results["bert"] = gathered(ZeroTrainer(model=bert, args=args))
    set_seed(SEED)
    args = stage3_arguments()
    config = AutoConfig.from_pretrained(folders["gpt2"])
    from_config = AutoModelForCausalLM.from_config(config)
    results["from_config_on_meta"] = all(p.is_meta for p in from_config.parameters())
    results["from_config"] = gathered(ZeroTrainer(model=from_config, args=args))
    return results


# With 2 ranks every chunk boundary falls on a row boundary; with 3 they cut rows, so a read that starts at
# the wrong element of a row shows.
@pytest.mark.parametrize("ranks, tensor_parallel_size", [(2, 1), (3, 1), pytest.param(4, 2, marks=pytest.mark.slow)],
                         ids=["dp2", "dp3", "tp2_dp2"])
def test_stage3_arguments_build_from_pretrained_and_from_config_partitioned_with_the_whole_builds_values(
        tmp_path, ranks, tensor_parallel_size):
    folders = {"gpt2": tmp_path / "gpt2", "bert": tmp_path / "bert"}
    save_gpt2(folders["gpt2"])
    save_bert(folders["bert"])
    set_seed(SEED)
    expected_gpt2 = named_copy(AutoModelForCausalLM.from_pretrained(folders["gpt2"]))
    set_seed(SEED)
    expected_bert = named_copy(BertForSequenceClassification.from_pretrained(folders["bert"], num_labels=3))
    config = AutoConfig.from_pretrained(folders["gpt2"])
    set_seed(SEED)
    expected_from_config = named_copy(AutoModelForCausalLM.from_config(config))
    for result in spawn_gloo(build_three_ways, ranks, folders, tmp_path / "out", tensor_parallel_size):
        assert result["gpt2_on_meta"] and result["bert_on_meta"] and result["from_config_on_meta"]
        assert max_diff(result["gpt2"], expected_gpt2) == 0
        assert not result["later_on_meta"] and max_diff(result["later"], expected_gpt2) == 0
        # The new head (and the pooler, which a masked-LM model lacks) is initialised by transformers from the
        # seeded global generator, the rest read.
        assert result["bert_missing"] == ["bert.pooler.dense.bias", "bert.pooler.dense.weight", "classifier.bias",
                                          "classifier.weight"]
        assert max_diff(result["bert"], expected_bert) == 0
        assert expected_bert["classifier.weight"].abs().sum() > 0
        assert max_diff(result["from_config"], expected_from_config) == 0


def train_auto_and_given(folder: Path, output_dir: Path) -> dict:
    """On each rank, 3 steps under --zero_stage auto arguments: a GPT-2 classifier from_pretrained of a language-model
    checkpoint (its new head initialised by transformers) and GPT-2 from_config, where the plan chooses among every
    stage, and GPT-2 from_pretrained with hpZ, which only stage 3 takes; then each again built whole
    (--zero_init_partitioned false) with the stage the plan chose given. Dropout stays on: the runs draw the same
    masks only where the builds leave the global generator alike."""
    from transformers import AutoModelForSequenceClassification

    from hf_zero import ZeroTrainer

    ids = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(2))
    texts = [{"input_ids": row, "labels": row} for row in ids]
    classes = [{"input_ids": row, "labels": torch.tensor(i % 3)} for i, row in enumerate(ids)]
    jobs = {"classifier": (lambda: AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3,
                                                                                      pad_token_id=0), classes, {}),
            "from_config": (lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)), texts, {}),
            "hpz": (lambda: AutoModelForCausalLM.from_pretrained(folder), texts, {"zero_hpz_partition_size": 2})}
    results = {}
    for name, (build, samples, settings) in jobs.items():
        runs = {}
        for way in ("auto", "given"):
            stage = "auto" if way == "auto" else runs["auto"]["stage"]
            set_seed(SEED)
            args = arguments(output_dir / name / way, partitioned=way == "auto", zero_stage=stage, **settings,
                             per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                             disable_tqdm=True)
            model = build()
            on_meta = all(p.is_meta for n, p in model.named_parameters() if not n.startswith("score."))
            trainer = ZeroTrainer(model=model, args=args, train_dataset=samples)
            trainer.train()
            runs[way] = {"stage": trainer.engine.zero_stage, "on_meta": on_meta,
                         "built_partitioned": trainer.built_partitioned,
                         "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                         "params": gathered(trainer)}
        results[name] = runs
    return results


@pytest.mark.slow
def test_zero_stage_auto_builds_partitioned_and_trains_as_the_chosen_stage_built_whole(tmp_path):
    """--zero_stage auto builds the model on meta, as stage 3 does, before its plan has chosen: where the plan chooses
    stages 0-2 the engine fills it whole on every rank, where it chooses 3 in shards. Either way it trains as the run
    given that stage and built whole."""
    save_gpt2(tmp_path / "gpt2", vocab_size=64)
    for result in spawn_gloo(train_auto_and_given, 2, tmp_path / "gpt2", tmp_path / "out"):
        for name, runs in result.items():
            auto, given = runs["auto"], runs["given"]
            assert auto["on_meta"] and not given["on_meta"], name
            assert (auto["stage"] == 3) == (name == "hpz") == auto["built_partitioned"], (name, auto["stage"])
            assert len(auto["losses"]) == 3 and auto["losses"] == given["losses"], name
            assert max_diff(auto["params"], given["params"]) == 0, name


def stock_configs() -> dict[str, tuple[Any, Any]]:
    """Tiny configurations of the four model families the stock initialisation is checked on: GPT-2 and BERT with
    their output embeddings tied, Llama with rotary buffers, T5 with three tied embeddings and an init per module
    kind."""
    from transformers import (
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        LlamaConfig,
        T5Config,
    )

    return {
        "gpt2": (AutoModelForCausalLM, GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32,
                                                  bos_token_id=0, eos_token_id=0)),
        "bert": (AutoModelForMaskedLM, BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                  intermediate_size=64, vocab_size=100, max_position_embeddings=32)),
        "llama": (AutoModelForCausalLM, LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                    num_key_value_heads=2, intermediate_size=64, vocab_size=100)),
        "t5": (AutoModelForSeq2SeqLM, T5Config(num_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64,
                                               vocab_size=100, decoder_start_token_id=0)),
    }


def from_config_at_stage3(output_dir: Path) -> dict:
    """Each stock configuration built by from_config under stage-3 arguments (on meta), with the global generator's
    state right after it, and the values the engine holds once ZeroTrainer has taken the model."""
    from hf_zero import ZeroTrainer

    results = {}
    for kind, (auto, config) in stock_configs().items():
        args = arguments(output_dir / kind)
        set_seed(SEED)
        model = auto.from_config(config)
        results[kind] = {"on_meta": all(p.is_meta for p in model.parameters()), "rng": torch.get_rng_state(),
                         "values": gathered(ZeroTrainer(model=model, args=args))}
    return results


def test_from_config_at_stage3_gives_the_stock_initialisation_bitwise(tmp_path):
    """A from-scratch model built partitioned holds what a plain from_config holds after the same set_seed, and the
    global generator is left where the plain build leaves it (what the script draws next is as under stock)."""
    expected = {}
    for kind, (auto, config) in stock_configs().items():
        set_seed(SEED)
        expected[kind] = named_copy(auto.from_config(config)), torch.get_rng_state()
    for result in spawn_gloo(from_config_at_stage3, 2, tmp_path):
        for kind, (values, rng) in expected.items():
            assert result[kind]["on_meta"], kind
            assert result[kind]["values"].keys() == values.keys(), kind
            assert max_diff(result[kind]["values"], values) == 0, kind
            assert torch.equal(result[kind]["rng"], rng), kind


def test_a_parameter_whose_values_its_constructor_drew_is_refused_at_from_config():
    """transformers' init is replayed module by module; a weight only the module's constructor set (torch's default
    init, which _init_weights leaves alone) cannot be, and is named rather than given other values."""
    from hf_zero.hf.stock_init import record_stock_init

    class Keeps(GPT2LMHeadModel):
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Linear(4, 4)  # built after post_init: no init of transformers' reaches it

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    with pytest.raises(ValueError, match=r"extra\.weight, extra\.bias keep the values .* "
                                         r"--zero_init_partitioned false"):
        record_stock_init(lambda: Keeps(config))


def peak_growth(folder: Path, output_dir: Path, partitioned: bool = True, nvme_path: str | None = None,
                steps: int = 0) -> dict:
    """Peak RSS growth of this rank from before from_pretrained until the engine holds the model (the Trainer
    built, its optimizer created: what a rank needs before the first step; "loaded"), then through `steps`
    training steps ("growth"), with the parameters, optimizer states and gradients on NVMe when `nvme_path` is
    given."""
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (its import is not the model's memory)

    from hf_zero import ZeroTrainer
    from hf_zero.runtime.host_memory import _glibc
    from hf_zero.runtime.memory import current_rss, peak_rss, reset_peak_rss

    _glibc().mallopt(-3, 2**20)  # M_MMAP_THRESHOLD fixed at 1 MiB, as MALLOC_MMAP_THRESHOLD_ sets it at a start

    nvme = {} if nvme_path is None else {"zero_offload_param": "nvme", "zero_offload_optimizer": "nvme",
                                         "zero_nvme_path": nvme_path, "zero_nvme_tile_numel": 65_536}
    args = arguments(output_dir, partitioned, **nvme)
    gc.collect()
    reset_peak_rss()
    before = current_rss()
    model = AutoModelForCausalLM.from_pretrained(folder)
    trainer = ZeroTrainer(model=model, args=args)
    trainer.create_optimizer()
    engine = trainer.engine
    loaded = peak_rss() - before
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"loaded": loaded, "growth": peak_rss() - before, "losses": losses,
            "offload": (engine.config.offload_param, engine.config.offload_optimizer),
            "holds": sum(s.numel() * s.element_size() for s in engine.params.param_shards)}


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory) -> tuple[int, dict[str, list[dict]]]:
    """A 32-block GPT-2 of 233 MB in fp32 (its blocks each 3% of it; gpt2-large's are 2.5%) on 4 ranks, built
    partitioned, built whole, and built partitioned with NVMe offload; the partitioned runs then train two steps.
    glibc's mmap threshold is fixed at 1 MiB in the ranks, as in the benchmarks: these units (7 MB) are below the
    threshold glibc raises itself to, and it would then keep freed units in its heap (0.87x the model, measured,
    with NVMe), which is the allocator's history and not what the engine holds (gpt2-large's 75 MB units are
    above it: benchmarks/bench_pretrained_memory.py)."""
    folder = tmp_path_factory.mktemp("memory")
    model_bytes = save_gpt2(folder / "ckpt", n_layer=32, n_embd=384, vocab_size=4096)
    (folder / "nvme").mkdir()
    runs = {}
    for name, partitioned, nvme, steps in [("partitioned", True, None, 2), ("whole", False, None, 0),
                                           ("nvme", True, str(folder / "nvme"), 2)]:
        # NVMe's growth is the smallest figure, so its ranks start from a fresh interpreter's heap rather than
        # the forkserver's (0.49-0.51x the model against 0.55-0.58x); the others are far from their bounds.
        runs[name] = spawn_gloo(peak_growth, 4, folder / "ckpt", folder / name, partitioned, nvme, steps,
                                start_method="spawn" if nvme else "forkserver")
    return model_bytes, runs


@pytest.mark.slow
def test_no_rank_holds_the_whole_model_while_it_loads_and_the_whole_model_path_does(memory_runs):
    """Measured: 0.37-0.38x the whole model per rank (its shard 0.25x, one unit being filled, the allocator's
    free memory), and 1.38x on the whole-model path."""
    model_bytes, runs = memory_runs
    partitioned, whole = runs["partitioned"], runs["whole"]
    for rank in range(4):
        print(f"rank {rank}: loaded {partitioned[rank]['loaded'] / model_bytes:.2f}x the model partitioned, "
              f"{whole[rank]['loaded'] / model_bytes:.2f}x whole")
        assert partitioned[rank]["holds"] == whole[rank]["holds"] < 0.26 * model_bytes
        assert partitioned[rank]["loaded"] < 0.6 * model_bytes, (rank, partitioned[rank]["loaded"] / model_bytes)
        assert whole[rank]["loaded"] >= model_bytes, (rank, whole[rank]["loaded"] / model_bytes)


@pytest.mark.slow
def test_with_nvme_offload_no_rank_holds_the_whole_model_over_training_and_without_it_every_rank_does(memory_runs):
    """ZeRO-Infinity's promise at the scale of a test, two steps. In memory the states alone are 16Ψ/Nd = the whole
    fp32 model per rank; with parameters, states and gradients on NVMe a rank's growth stays below it: pools, a
    unit and its gradients at a time, and torch's own first-forward set-up (about 50 MiB). Measured 0.49-0.51x
    against 1.39-1.42x when written (torch 2.11); under torch 2.13 every commit since measures 0.60-0.67x, two runs
    of one commit up to 0.06 apart (a bisect found no engine change, only 8c1096c's change of how these runs are
    spawned), and today's code 0.64-0.68x (1.60-1.64x in memory): the bound of 0.65x failed one run in three. The bound is 0.75x: below the whole model the test's name is about
    (1.0x) by a stage-3 unit's gradients and more. Its losses are the in-memory run's: ZeRO-Infinity trains from the
    shards as the partitioned build read them."""
    model_bytes, runs = memory_runs
    on_nvme, in_memory = runs["nvme"], runs["partitioned"]
    assert on_nvme[0]["offload"] == ("nvme", "nvme") and in_memory[0]["offload"] == ("none", "none")
    for rank in range(4):
        print(f"rank {rank}: {on_nvme[rank]['growth'] / model_bytes:.2f}x the model with NVMe, "
              f"{in_memory[rank]['growth'] / model_bytes:.2f}x in memory")
        assert on_nvme[rank]["growth"] < 0.75 * model_bytes, (rank, on_nvme[rank]["growth"] / model_bytes)
        assert in_memory[rank]["growth"] >= model_bytes, (rank, in_memory[rank]["growth"] / model_bytes)
        # ZeRO-Infinity from the shards as read: the same losses as in memory
        assert on_nvme[rank]["losses"] == pytest.approx(in_memory[rank]["losses"], rel=1e-5)


def script_args(*args: str) -> list[str]:
    """The script's arguments at stage 3 for 6 steps; `args` come last, so they win over these."""
    return ["--zero_stage", "3", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
            "--max_steps", "6", "--logging_steps", "1", "--learning_rate", "3e-3", "--do_train", "--do_eval",
            "--log_level", "info", "--log_level_replica", "info", *args]


def hf_zero_run(*args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """The script launched by `hf-zero run` on `ranks` ranks, with script_args(*args)."""
    return subprocess.run([sys.executable, "-m", "hf_zero", "run", "--nproc_per_node", str(ranks), str(SCRIPT),
                           *script_args(*args)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def built_partitioned(tmp_path_factory) -> tuple[Path, int, dict[int, tuple[Path, str]]]:
    """The script fine-tuning a checkpoint built partitioned, saving every 3 of its 6 steps, on 2 ranks (dp 2) and
    on 4 (tp 2 x dp 2): the runs the tests below compare with the whole build, and resume from. Returns the
    checkpoint's folder, its bytes, and by tp size each run's output folder and log."""
    root = tmp_path_factory.mktemp("partitioned")
    model_bytes = save_gpt2(root / "ckpt")
    runs = {}
    for ranks, tensor_parallel_size in ((2, 1), (4, 2)):
        out = root / f"tp{tensor_parallel_size}"
        done = hf_zero_run("--model_name_or_path", str(root / "ckpt"), "--output_dir", str(out), "--save_strategy",
                           "steps", "--save_steps", "3", "--tensor_parallel_size", str(tensor_parallel_size),
                           ranks=ranks)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[tensor_parallel_size] = (out, done.stderr + done.stdout)
    return root / "ckpt", model_bytes, runs


@pytest.mark.slow
def test_an_unmodified_script_fine_tunes_a_checkpoint_built_partitioned_as_when_built_whole(built_partitioned,
                                                                                            tmp_path):
    ckpt, model_bytes, partitioned_runs = built_partitioned
    out, log = partitioned_runs[1]
    runs = {True: (json.loads((out / "log_history.json").read_text()), log)}
    outputs = {True: out, False: tmp_path / "out_False"}
    reference_log = run_script_reference(SCRIPT, script_args("--model_name_or_path", str(ckpt), "--output_dir",
                                                             str(outputs[False]), "--zero_init_partitioned", "false"),
                                         ranks=2)
    runs[False] = (json.loads((outputs[False] / "log_history.json").read_text()), reference_log)
    read = [float(mib) for mib in re.findall(r"built the model partitioned: read ([\d.]+) MiB", runs[True][1])]
    assert len(read) == 2 and all(mib * 2**20 < 0.6 * model_bytes for mib in read)  # each rank its slices only
    assert "built the model partitioned" not in runs[False][1]
    for name, (_, log) in runs.items():  # the Trainer's count is the model's, though stage-3 parameters are empty
        counts = re.findall(r"Number of trainable parameters = ([\d,]+)", log)
        assert counts and all(int(count.replace(",", "")) == model_bytes // 4 for count in counts), (name, counts)
    losses = {k: [entry["loss"] for entry in history if "loss" in entry] for k, (history, _) in runs.items()}
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    eval_losses = {k: [e["eval_loss"] for e in history if "eval_loss" in e] for k, (history, _) in runs.items()}
    assert eval_losses[True] == pytest.approx(eval_losses[False], rel=1e-5)
    # The saved model reloads, outside any stage-3 arguments, to the same logits.
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    logits = {}
    for partitioned in (True, False):
        with torch.no_grad():
            logits[partitioned] = AutoModelForCausalLM.from_pretrained(outputs[partitioned])(ids).logits
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_with_tensor_parallelism_each_rank_reads_its_tp_parts_dp_chunk_and_trains_as_when_built_whole(
        built_partitioned, tmp_path):
    ckpt, model_bytes, partitioned_runs = built_partitioned
    out, log = partitioned_runs[2]
    outputs = {"true": out, "false": tmp_path / "out_false"}
    runs = {"true": (json.loads((out / "log_history.json").read_text()), log)}
    reference_log = run_script_reference(SCRIPT, script_args("--model_name_or_path", str(ckpt), "--output_dir",
                                                             str(outputs["false"]), "--tensor_parallel_size", "2",
                                                             "--zero_init_partitioned", "false"), ranks=4)
    runs["false"] = (json.loads((outputs["false"] / "log_history.json").read_text()), reference_log)
    read = [float(mib) for mib in re.findall(r"built the model partitioned: read ([\d.]+) MiB", runs["true"][1])]
    # tp 2 x dp 2: about a quarter of the block weights, half of the embeddings (0.27 by hand); reading the
    # split weights' whole tensors and cutting them would take about 0.5.
    assert len(read) == 4 and all(mib * 2**20 < 0.4 * model_bytes for mib in read), read
    assert "built the model partitioned" not in runs["false"][1]
    for key in ("loss", "eval_loss"):
        values = {k: [entry[key] for entry in history if key in entry] for k, (history, _) in runs.items()}
        assert values["true"] and values["true"] == pytest.approx(values["false"], rel=1e-5), key
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = {k: AutoModelForCausalLM.from_pretrained(outputs[k])(ids).logits for k in runs}
    torch.testing.assert_close(logits["true"], logits["false"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage", [3, "auto"])
def test_a_checkpoint_that_cannot_be_read_in_slices_is_refused_naming_the_file(tmp_path, stage):
    """Under --zero_stage auto too, which builds partitioned before its plan chooses; the message names the flag."""
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    model.config.save_pretrained(tmp_path / "bin")  # transformers 5 writes safetensors only: a .bin by hand
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    args = arguments(tmp_path / "out", zero_stage=stage)
    assert pretrained.enabled()
    with pytest.raises(ValueError, match=rf"^--zero_stage {stage} builds the model partitioned, .*pytorch_model\.bin "
                                         rf"is not one .* --zero_init_partitioned false"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "bin")
    del args
    gc.collect()
    assert not pretrained.enabled()  # the switch lives as long as the arguments that asked for it
    assert not any(p.is_meta for p in AutoModelForCausalLM.from_pretrained(tmp_path / "bin").parameters())


@pytest.mark.slow
@pytest.mark.parametrize("ranks, tensor_parallel_size", [(2, 1), (4, 2)], ids=["dp2", "tp2_dp2"])
def test_a_model_built_partitioned_checkpoints_resumes_and_consolidates_as_any_stage3_model(
        built_partitioned, tmp_path, ranks, tensor_parallel_size):
    from hf_zero.checkpoint.consolidate import consolidate

    ckpt, _, partitioned_runs = built_partitioned
    first = partitioned_runs[tensor_parallel_size][0]  # saved at steps 3 and 6
    resumed = hf_zero_run("--model_name_or_path", str(ckpt), "--output_dir", str(tmp_path / "b"),
                          "--resume_from_checkpoint", str(first / "checkpoint-3"),
                          "--tensor_parallel_size", str(tensor_parallel_size), ranks=ranks)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("built the model partitioned") == ranks
    losses = {run: {e["step"]: e["loss"] for e in json.loads((folder / "log_history.json").read_text())
                    if "loss" in e} for run, folder in (("a", first), ("b", tmp_path / "b"))}
    assert sorted(losses["b"]) == [1, 2, 3, 4, 5, 6]  # 1-3 from the checkpoint's trainer state, 4-6 trained again
    assert [losses["b"][s] for s in (4, 5, 6)] == pytest.approx([losses["a"][s] for s in (4, 5, 6)], rel=1e-5)
    consolidate(first / "checkpoint-6", tmp_path / "consolidated", progress=False)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(first)(ids).logits
        consolidated = AutoModelForCausalLM.from_pretrained(tmp_path / "consolidated")(ids).logits
    torch.testing.assert_close(consolidated, saved, atol=1e-5, rtol=0)


def lora_on_a_base_built_two_ways(folder: Path, output_dir: Path) -> dict:
    """peft's LoRA (and a trained copy of the head, modules_to_save) around GPT-2 from_pretrained under stage-3
    arguments, the base built partitioned and built whole, 3 steps through ZeroTrainer each: whether the base was on
    meta, the losses, and the adapter save_model wrote."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from hf_zero import ZeroTrainer
    from tests.trainer_helpers import lm_examples

    results = {}
    for partitioned in (True, False):
        args = arguments(output_dir / str(partitioned), partitioned=partitioned, max_steps=3, logging_steps=1,
                         per_device_train_batch_size=2, learning_rate=1e-2)
        set_seed(SEED)
        adapter = LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0, modules_to_save=["lm_head"])
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), adapter)
        base_on_meta = all(p.is_meta for n, p in model.named_parameters() if "lora_" not in n)
        trainer = ZeroTrainer(model=model, args=args, train_dataset=[
            {"input_ids": e["input_ids"] % 64, "labels": e["labels"] % 64} for e in lm_examples(12, 3)])
        trainer.train()
        trainer.save_model(str(output_dir / str(partitioned) / "adapter"))
        torch.distributed.barrier()  # the main process has written it
        results[partitioned] = {
            "base_on_meta": base_on_meta, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "adapter": load_file(output_dir / str(partitioned) / "adapter" / "adapter_model.safetensors")}
    return results


def test_a_peft_model_around_a_base_built_partitioned_trains_as_when_the_base_is_built_whole(tmp_path):
    """get_peft_model around a base that stage-3 arguments built on meta: the engine fills the base's shards through
    peft's wrapper, and peft's adapter keeps the values peft gave it (moved onto the meta base, they were lost:
    "Cannot copy out of meta tensor", then a refusal). Against the base built whole (--zero_init_partitioned false,
    the path tests/hf/test_trainer.py checks against stock DDP): the same losses and the same adapter, bitwise."""
    save_gpt2(tmp_path / "base")
    for result in spawn_gloo(lora_on_a_base_built_two_ways, 2, tmp_path / "base", tmp_path / "out"):
        partitioned, whole = result[True], result[False]
        assert partitioned["base_on_meta"] and not whole["base_on_meta"]
        assert len(whole["losses"]) == 3 and partitioned["losses"] == whole["losses"]
        assert partitioned["adapter"].keys() == whole["adapter"].keys()
        assert any("lora_A" in k for k in whole["adapter"]) and any("lm_head" in k for k in whole["adapter"])
        for name, tensor in whole["adapter"].items():
            assert torch.equal(partitioned["adapter"][name], tensor), name
        assert any(tensor.abs().sum() > 0 for name, tensor in whole["adapter"].items() if "lora_B" in name)  # trained


def test_a_prompt_learning_adapter_around_a_base_built_partitioned_is_refused_naming_the_flag(tmp_path):
    """Prompt tuning's encoder is made by peft on its base's device: on a base built on meta it has no values, and
    the checkpoint does not hold it. Refused when the Trainer takes the model, naming the tensor and the flag,
    rather than read as a missing checkpoint key ("the folder holds weights of another model")."""
    from peft import PromptTuningConfig, get_peft_model

    from hf_zero import ZeroTrainer

    save_gpt2(tmp_path / "base")
    args = arguments(tmp_path / "out")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                           PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"prompt_encoder\.default\.embedding\.weight of the peft model .* "
                                         r"--zero_init_partitioned false"):
        ZeroTrainer(model=model, args=args)
