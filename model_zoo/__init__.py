"""Named model configurations, returned as transformers configs so every transformers tool works on them.

For now: the byte-level GPT-2 of the main job and the two benchmark workloads of docs/BENCHMARKS.md.
"""
from __future__ import annotations

from typing import Any

from transformers import GPT2Config, GPT2LMHeadModel, PretrainedConfig, PreTrainedModel

BYTE_VOCAB = 256  # the main job tokenises text as UTF-8 bytes: no tokenizer download needed

_GPT2: dict[str, dict[str, Any]] = {
    # name: (layers, hidden, heads, vocab, positions) and what it is for
    "gpt2-tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=BYTE_VOCAB, n_positions=128),
    "gpt2-demo": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=BYTE_VOCAB, n_positions=256),
    "gpt2-bench-speed": dict(n_layer=6, n_embd=512, n_head=8, vocab_size=50257, n_positions=1024),
    "gpt2-bench-memory": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=8192, n_positions=1024),
}


def list() -> list[str]:  # noqa: A001 - the zoo's public verb
    return sorted(_GPT2)


def config(name: str, **overrides: Any) -> PretrainedConfig:
    if name not in _GPT2:
        raise KeyError(f"unknown model {name!r}; the zoo has {', '.join(sorted(_GPT2))}")
    return GPT2Config(**{**_GPT2[name], "bos_token_id": 0, "eos_token_id": 0, **overrides})


def build(name: str, **overrides: Any) -> PreTrainedModel:
    return GPT2LMHeadModel(config(name, **overrides))


def parameter_count(name: str) -> int:
    """Closed form for GPT-2 with tied embeddings: wte + wpe + 12h²+13h per block + final LayerNorm."""
    c = _GPT2[name]
    h, layers = c["n_embd"], c["n_layer"]
    return c["vocab_size"] * h + c["n_positions"] * h + layers * (12 * h * h + 13 * h) + 2 * h
