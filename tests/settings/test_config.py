"""Bad input is refused with a message naming the setting and what is allowed, before any training."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hf_zero
from hf_zero import ZeroConfig, ZeroConfigError
from hf_zero.runtime.launch import free_port
from tests.helpers import make_optimizer, tiny_model


@pytest.mark.parametrize("setting, value, message", [
    ("zero_stage", 5, r"zero_stage must be one of 0, 1, 2, 3; got 5"),
    ("dtype", "fp8", r"dtype must be one of \['bf16', 'fp16', 'fp32'\]"),
    ("reduce_bucket_size", 0, r"reduce_bucket_size must be a positive integer; got 0"),
    ("allgather_bucket_size", -4, r"allgather_bucket_size must be a positive integer; got -4"),
    ("gradient_accumulation_steps", 0, r"gradient_accumulation_steps must be a positive integer"),
    ("prefetch_bucket_size", -1, r"prefetch_bucket_size must be an integer >= 0"),
    ("gradient_clipping", -1.0, r"gradient_clipping must be a number >= 0"),
    ("loss_scale", 128.0, r"loss_scale applies to fp16 only"),
    ("reduce_dtype", "bf16", r"reduce_dtype must be fp32 or the compute dtype, fp32 \(dtype\); got 'bf16'"),
    ("reduce_dtype", "fp8", r"reduce_dtype must be fp32 or the compute dtype, fp32 \(dtype\); got 'fp8'"),
])
def test_bad_setting_names_the_setting_and_the_allowed_values(setting, value, message):
    with pytest.raises(ZeroConfigError, match=message):
        ZeroConfig.from_any({setting: value})


def test_unknown_setting_lists_the_known_ones():
    with pytest.raises(ZeroConfigError, match=r"unknown ZeRO setting\(s\) \['zero_stag'\]; known settings"):
        ZeroConfig.from_any({"zero_stag": 2})


def test_config_from_json_file(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero_stage": 3, "dtype": "bf16"}))
    config = ZeroConfig.from_any(str(path))
    assert (config.zero_stage, config.torch_dtype) == (3, torch.bfloat16)


def test_bad_config_is_refused_before_the_model_is_touched():
    model = tiny_model("gpt2")
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ZeroConfigError, match="zero_stage"):
        hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 5})
    assert [p.data_ptr() for p in model.parameters()] == before


def test_optimizer_that_needs_a_closure_is_refused():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="LBFGS needs a closure"):
        hf_zero.initialize(model, torch.optim.LBFGS(model.parameters()), {"zero_stage": 1})


def test_parameters_on_mixed_devices_are_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_parameter_missing_from_the_optimizer_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"parameter 1.weight requires grad but is in no optimizer param group"):
        hf_zero.initialize(model, torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_model_already_wrapped_in_ddp_is_refused():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(TypeError, match="already wrapped in DistributedDataParallel"):
            hf_zero.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()


def test_unit_classes_that_match_nothing_list_the_model_classes():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match=r"unit_module_classes \['NoSuchBlock'\] match no module.*GPT2Block"):
        hf_zero.initialize(model, make_optimizer(model), {"zero_stage": 3, "unit_module_classes": ["NoSuchBlock"]})


@pytest.mark.parametrize("settings, message", [
    ({"dtype": "fp16", "loss_scale": float("inf")}, r"loss_scale must be a finite number; got inf"),
    ({"dtype": "fp16", "loss_scale": float("nan")}, r"loss_scale must be a finite number; got nan"),
    ({"gradient_clipping": float("nan")}, r"gradient_clipping must be a finite number; got nan"),
    ({"zero_stage": 2.0}, r"zero_stage must be one of 0, 1, 2, 3; got 2.0"),
    ({"zero_stage": True}, r"zero_stage must be one of 0, 1, 2, 3; got True"),
    ({"overlap_comm": "no"}, r"overlap_comm must be true or false; got 'no'"),
    ({"reduce_bucket_size": 5e6}, r"reduce_bucket_size must be an integer; got 5000000.0"),
    ({"gradient_clipping": True}, r"gradient_clipping must be a finite number; got True"),
    ({"unit_module_classes": "GPT2Block"}, r"unit_module_classes must be a list of module class names"),
])
def test_types_are_checked_exactly_and_numbers_must_be_finite(settings, message):
    with pytest.raises(ZeroConfigError, match=message):
        ZeroConfig.from_any(settings)


@pytest.mark.parametrize("content, message", [
    (None, r"config file .*missing.json: no such file"),
    ("{not json", r"config file .*bad.json is not valid JSON: Expecting property name"),
    ("[1, 2]", r"config file .*list.json must hold a JSON object of engine settings"),
])
def test_a_missing_or_invalid_config_file_is_named(tmp_path, content, message):
    name = {None: "missing.json", "{not json": "bad.json", "[1, 2]": "list.json"}[content]
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ZeroConfigError, match=message):
        ZeroConfig.from_any(str(tmp_path / name))


def test_an_nvme_path_the_kernel_refuses_is_caught_at_config_time():
    """As root, access() says /sys is writable; creating a folder there still fails (EPERM)."""
    import os
    if not (os.path.isdir("/sys") and os.access("/sys", os.W_OK | os.X_OK)):
        pytest.skip("needs a folder that access() calls writable and the kernel refuses (/sys as root)")
    with pytest.raises(ZeroConfigError, match=r"nvme_path '/sys': cannot create a folder in it"):
        ZeroConfig.from_any({"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/sys"})
