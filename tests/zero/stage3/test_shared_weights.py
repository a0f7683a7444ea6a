"""Weights several units use at stage 3 (hf_zero/zero/stage3/shared_weights.py): a weight two blocks or the root
and a block share, the root freed early in backward, and a tied vocabulary weight's uses split."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

import hf_zero
from hf_zero.runtime.launch import spawn_gloo
from hf_zero.runtime.memory import current_rss, peak_rss, reset_peak_rss
from tests.helpers import VOCAB, local_part, named_copy, sgd_steps, tiny_model
from tests.helpers import batch as lm_batch

STEPS, WIDTH = 3, 32


def model_with_shared_weights(kind: str) -> nn.Module:
    if kind == "bert_mlm_tied_decoder":  # the decoder (root) is the word embeddings (the BertEmbeddings unit)
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    model = tiny_model("gpt2")
    first, second = model.transformer.h
    if kind == "weight_shared_by_two_blocks":
        second.mlp.c_fc.weight = first.mlp.c_fc.weight
    else:  # one module in both blocks
        second.mlp = first.mlp
    return model


SHARED = {"bert_mlm_tied_decoder": ["bert.embeddings.word_embeddings.weight"],
          "weight_shared_by_two_blocks": ["transformer.h.0.mlp.c_fc.weight"],
          "module_shared_by_two_blocks": [f"transformer.h.0.mlp.{name}" for name in
                                          ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")]}


def sgd_trained(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters after STEPS of sgd_steps with the default stage-3 settings (gathered at stage 3)."""
    engine = sgd_steps(model, STEPS, {})
    if engine is None:
        return named_copy(model)
    with engine.gathered_parameters():
        return named_copy(model)


def train_shared(kind: str) -> dict:
    model = model_with_shared_weights(kind)
    engine = sgd_steps(model, STEPS, {})
    if engine is None:
        return named_copy(model)
    with engine.gathered_parameters():
        return {"params": named_copy(model), "shared_weights": engine.ledger.shared_weights}


@pytest.mark.parametrize("kind", sorted(SHARED))
def test_weights_several_units_use_train_at_stage3_as_one_process(kind):
    expected = train_shared(kind)
    start = named_copy(model_with_shared_weights(kind))
    shared = SHARED[kind][0]
    assert (expected[shared] - start[shared]).abs().max() > 1e-3  # the shared weight trained
    for result in spawn_gloo(train_shared, 2, kind):
        assert max((result["params"][n] - expected[n]).abs().max().item() for n in expected) < 1e-6
        assert list(result["shared_weights"]) == SHARED[kind]
        assert all(where.startswith("root unit") for where in result["shared_weights"].values())


def bucket_peak_of_the_tied_gpt2() -> dict:
    # wte is the head too: its gradient is complete only at the end of backward
    engine = sgd_steps(tiny_model("gpt2-deep"), 1, {})
    units = {u.name: u.numel * 4 for u in engine.params.units}
    return {"peak": engine.ledger.last_step_peaks["bytes of gradient buckets"], "units": units}


def test_the_roots_bucket_opens_once_the_root_is_freed_and_then_holds_the_tied_heads_gradient():
    """The head's gradient of the tied wte comes first in backward and the embedding's last. Autograd would hold
    the head's, out of the ledger's sight, through every block; it is kept as it came until the root's weights
    are freed, then moves into the root's bucket. So the buckets held at once are the root's and two block
    buckets (the one filling and the one being reduced), never more; whether the previous block's reduction
    is still in flight when the next one opens is gloo's timing, so the peak lies between root + one block
    and root + two."""
    for result in spawn_gloo(bucket_peak_of_the_tied_gpt2, 2):
        block = max(size for name, size in result["units"].items() if name.startswith("transformer.h."))
        root = result["units"][""]
        assert root > 0 and root + block <= result["peak"] <= root + 2 * block, (result["peak"], root, block)


def root_during_backward(frees_early: bool) -> dict:
    """2 SGD steps of the 8-block GPT-2 on 2 ranks (its tied wte is the head too, so the root's last gradient
    comes at the very end): whether the root was gathered as each block's backward gather began."""
    model = tiny_model("gpt2-deep")
    engine = sgd_steps(model, 0, {})
    params, seen = engine.params, []
    params.root_frees_early = frees_early
    fetch = params._fetch

    def observed(unit, backward: bool) -> None:
        fetch(unit, backward)
        if backward and unit is not params.root:
            seen.append(params.root.gathered)

    params._fetch = observed
    for step in range(2):
        engine.backward(engine(**local_part(lm_batch("gpt2", step, 8), engine.comm.rank, 2)).loss)
        engine.step()
    with engine.gathered_parameters():
        return {"params": named_copy(model), "root_gathered": seen, "gathers": engine.ledger.last_step_events}


def test_the_root_is_freed_once_backward_has_read_back_what_the_forward_saved_of_it():
    """GPT-2's root (embeddings, final norm, tied head) is read in backward by the head and the final norm only,
    which run first: from the last block's backward on it is freed, instead of staying gathered to the end
    for the embeddings' gradients (which need no weights). Training is bitwise what keeping it gives."""
    model = tiny_model("gpt2-deep")
    sgd_steps(model, 2, {})  # one process
    expected = named_copy(model)
    for early, kept in zip(spawn_gloo(root_during_backward, 2, True), spawn_gloo(root_during_backward, 2, False)):
        assert len(early["root_gathered"]) == 2 * 8 and not any(early["root_gathered"])
        assert all(kept["root_gathered"])  # the reference: the root held through every block's backward
        assert all(torch.equal(early["params"][n], kept["params"][n]) for n in kept["params"])
        assert max((early["params"][n] - expected[n]).abs().max().item() for n in expected) < 1e-6
        assert early["gathers"]["unit all-gathers"] == kept["gathers"]["unit all-gathers"]  # no gather again


class RootWeightReadLate(nn.Module):
    """A root weight that backward reads last: `scale` multiplies the embeddings before the blocks, so the
    gradient of that product (which reads `scale`) comes after every block's backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.scale = nn.Parameter(torch.rand(WIDTH) + 0.5)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * self.scale
        for block in self.blocks:
            x = block(x)
        logits = x @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train_root_read_late() -> dict:
    model = RootWeightReadLate()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if not torch.distributed.is_initialized():
        for step in range(STEPS):
            model(**lm_batch("gpt2", step, 8)).backward()
            optimizer.step()
            optimizer.zero_grad()
        return named_copy(model)
    engine = hf_zero.initialize(model, optimizer, {"zero_stage": 3, "param_persistence_threshold": 0})
    for step in range(STEPS):
        engine.backward(engine(**local_part(lm_batch("gpt2", step, 8), engine.comm.rank, 2)))
        engine.step()
    with engine.gathered_parameters():
        return named_copy(model)


def test_a_root_weight_backward_reads_last_keeps_the_root_until_it_is_read():
    expected = train_root_read_late()
    assert (expected["scale"] - RootWeightReadLate().scale.detach()).abs().max() > 1e-3  # it trained
    for result in spawn_gloo(train_root_read_late, 2):
        assert max((result[n] - expected[n]).abs().max().item() for n in expected) < 1e-6


def train_shared_checkpointed() -> dict:
    """The module two blocks share lives in the root; with activation checkpointing each block's
    recomputation reads it again in backward, where autograd saved nothing of it."""
    model = model_with_shared_weights("module_shared_by_two_blocks")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return sgd_trained(model)


def test_a_layer_blocks_share_stays_gathered_for_their_recomputation():
    expected = train_shared_checkpointed()
    for result in spawn_gloo(train_shared_checkpointed, 2):
        assert max((result[n] - expected[n]).abs().max().item() for n in expected) < 1e-6


def end_of_backward_over_what_it_leaves() -> dict:
    """2 SGD steps of a GPT-2 whose tied vocabulary weight (32768 x 256, 32 MiB in fp32) outweighs the rest
    (2 blocks, 6 MiB): how far resident memory rose from the moment the root was freed in backward (at the
    last block's backward gather: the head and the final norm are done) to the end of backward, above what
    backward left (the gradient shards)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=32768, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    engine = hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_stage": 3})
    params, rank = engine.params, engine.comm.rank
    fetch = params._fetch

    def observed(unit, backward: bool) -> None:
        fetch(unit, backward)
        if backward and params.backward.seen.index(unit) == 1:
            assert not params.root.gathered
            reset_peak_rss()

    params._fetch = observed
    ids = torch.randint(0, 32768, (4, 32), generator=torch.Generator().manual_seed(0))[2 * rank:2 * rank + 2]
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        risen = peak_rss() - current_rss()
        engine.step()
    return {"risen": risen, "vocab_bytes": 32768 * 256 * 4}


def test_the_end_of_backward_makes_no_vocabulary_sized_gradient_for_a_tied_embedding(monkeypatch):
    """The head's gradient of the tied wte goes into the root's bucket once the root's weights are freed, and
    the embedding gives only the rows its tokens picked, added into that bucket: from the last block's backward
    to the end, a rank adds its gradient shard and the reduction's buffers beyond what backward leaves
    (measured: 1.12-1.27 vocabulary weights). A dense embedding gradient beside the bucket made it 2.1; autograd
    alone, summing the head's and the embedding's gradients, 3.6."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for rank in spawn_gloo(end_of_backward_over_what_it_leaves, 2):
        print(f"risen {rank['risen'] / 2**20:.1f} MiB, vocabulary weight {rank['vocab_bytes'] / 2**20:.0f} MiB")
        assert rank["risen"] < 1.6 * rank["vocab_bytes"]


class RowsTaken:
    """Stands in for the reducer: keeps what _EmbeddingLookup's backward hands it."""

    def take_rows(self, param: nn.Parameter, rows: torch.Tensor, row_grads: torch.Tensor) -> None:
        self.rows, self.row_grads = rows, row_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx, scale_grad_by_freq", [(None, False), (3, False), (-1, True)])
def test_an_embeddings_rows_are_its_dense_gradients_rows_bit_for_bit(dtype, padding_idx, scale_grad_by_freq):
    """The rows a tied embedding hands to the reducer at stage 3 are those of torch's dense embedding gradient,
    summed in the same order (a token repeated many times, the padding token, scaling by frequency), and the
    rows no token picked are the only ones left out. They come in min(tokens, vocabulary) slots, the distinct rows
    first (their number is known before the ids are: the host does not wait for the device), the others zeros."""
    from hf_zero.zero.stage3.shared_weights import _EmbeddingRows

    embedding = nn.Embedding(50, 16, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq, dtype=dtype)
    ids = torch.randint(0, 12, (6, 40), generator=torch.Generator().manual_seed(0))
    ids[0, :3] = 49  # the padding row when padding_idx is -1
    upstream = torch.randn(6, 40, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    embedding(ids).backward(upstream)
    dense = embedding.weight.grad
    embedding.weight.grad = None

    taken = RowsTaken()
    with _EmbeddingRows(embedding.weight, taken):
        out = embedding(ids)
    assert torch.equal(out, embedding.weight[ids] if padding_idx is None else nn.functional.embedding(
        ids, embedding.weight.detach(), padding_idx))
    out.backward(upstream)
    assert embedding.weight.grad is None
    distinct = ids.unique()
    assert taken.rows.shape == (min(ids.numel(), 50),)
    assert torch.equal(taken.rows[:distinct.numel()], distinct)
    assert torch.equal(taken.row_grads[:distinct.numel()], dense[distinct])
    assert not taken.row_grads[distinct.numel():].any()
    assert torch.equal(torch.zeros_like(dense).index_add_(0, taken.rows, taken.row_grads), dense)
    left_out = torch.ones(50, dtype=torch.bool)
    left_out[taken.rows] = False
    assert not dense[left_out].any()


FROZEN_ROWS = 10


def train_with_rows_frozen_by_a_hook() -> dict:
    """3 SGD steps of GPT-2 with a hook on its tied wte that zeroes the gradient of the first rows (as one keeps
    the original vocabulary while training added tokens): in one process, or at stage 3 on 2 ranks."""
    model = tiny_model("gpt2")
    mask = torch.ones(VOCAB, 1)
    mask[:FROZEN_ROWS] = 0
    model.transformer.wte.weight.register_hook(lambda grad: grad * mask)
    return sgd_trained(model)


def test_a_hook_on_a_tied_weight_sees_its_whole_gradient():
    """A tied weight's uses give their gradients apart at stage 3 (Stage3Params._split_tied_uses), except when
    a hook is registered on it: then the hook gets the sum, as in one process, and the frozen rows stay put
    (split anyway, the head's gradient would move them)."""
    start = tiny_model("gpt2").transformer.wte.weight.detach()
    expected = train_with_rows_frozen_by_a_hook()
    assert torch.equal(expected["transformer.wte.weight"][:FROZEN_ROWS], start[:FROZEN_ROWS])
    for result in spawn_gloo(train_with_rows_frozen_by_a_hook, 2):
        assert torch.equal(result["transformer.wte.weight"][:FROZEN_ROWS], start[:FROZEN_ROWS])
        assert max((result[n] - expected[n]).abs().max().item() for n in expected) < 1e-6


class GPT2WithWtePenalty(GPT2LMHeadModel):
    """GPT-2 whose loss adds a penalty on its tied vocabulary weight, read in the model's own forward: a use of
    the weight besides the two modules that hold it (the embedding reads it first, the head second)."""

    def forward(self, **batch):
        out = super().forward(**batch)
        out.loss = out.loss + 1e-2 * self.transformer.wte.weight.square().mean()
        return out


def train_with_a_wte_penalty() -> dict:
    model = GPT2WithWtePenalty(tiny_model("gpt2").config)
    model.load_state_dict(tiny_model("gpt2").state_dict())
    return sgd_trained(model)


def test_a_tied_weight_read_once_more_outside_its_modules_trains_as_one_process():
    """At stage 3 the embedding's rows come last; the penalty's gradient of the same weight comes first, through
    the parameter itself, and must be added as one more use's, not taken for the whole gradient."""
    expected = train_with_a_wte_penalty()
    for result in spawn_gloo(train_with_a_wte_penalty, 2):
        assert max((result[n] - expected[n]).abs().max().item() for n in expected) < 1e-6
