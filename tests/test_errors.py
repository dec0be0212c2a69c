"""Every bad input gets its documented one-line error (API side)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import llmem_plugin
from llmem_plugin import ConfigError, TraceError
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config


def one_line(err: Exception) -> str:
    msg = str(err)
    assert "\n" not in msg
    return msg


def test_unknown_model_suggests_close_names():
    with pytest.raises(ConfigError) as e:
        llmem_plugin.estimate("llama-3.1-8", seq_len=16)
    msg = one_line(e.value)
    assert "unknown model 'llama-3.1-8'" in msg and "'llama-3.1-8b'" in msg and "HINT" in msg


@pytest.mark.parametrize(
    "content, expected",
    [
        ("{not json", "malformed config"),
        (json.dumps({"hidden_size": 8}), "no 'model_type'"),
        (json.dumps({"model_type": "no-such-arch"}), "malformed config"),
    ],
)
def test_malformed_config(tmp_path, content, expected):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        llmem_plugin.estimate(str(path), seq_len=16)
    assert expected in one_line(e.value)


@pytest.mark.parametrize("field, flag", [("seq_len", "--seq-len"), ("micro_batch_size", "--batch-size"),
                                         ("grad_accum_steps", "--grad-accum")])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_sizes(field, flag, value):
    with pytest.raises(ConfigError) as e:
        Workload(**{field: value})
    msg = one_line(e.value)
    assert f"{field} must be a positive integer, got {value}" in msg and flag in msg


@pytest.mark.parametrize("field, value, suggestion", [("precision", "bf16mixed", "bf16-mixed"),
                                                      ("optimizer", "adam", "adamw"),
                                                      ("precision", "int4", None)])
def test_unsupported_precision_or_optimizer(field, value, suggestion):
    with pytest.raises(ConfigError) as e:
        Workload(**{field: value})
    msg = one_line(e.value)
    assert f"unsupported {field} '{value}'" in msg and "valid:" in msg
    if suggestion:
        assert f"did you mean '{suggestion}'" in msg


def test_lora_targets_matching_nothing():
    wl = Workload(seq_len=16, lora=LoraSpec(rank=4, target_modules=("c_attn",)))
    with pytest.raises(ConfigError) as e:
        llmem_plugin.estimate(tiny_config("llama"), wl)
    msg = one_line(e.value)
    assert "c_attn" in msg and "q_proj" in msg and "HINT" in msg


@torch.library.custom_op("llmem_test::cuda_only", mutates_args=(), device_types="cuda")
def _cuda_only(x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never runs on CPU
    return x.clone()


class _CudaOnlyMLP(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmem_test.cuda_only(self.inner(x))


def test_untraceable_forward_is_a_trace_error_not_a_number():
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.model.layers[0].mlp = _CudaOnlyMLP(model.model.layers[0].mlp)
    with pytest.raises(TraceError) as e:
        llmem_plugin.estimate(model, seq_len=16)
    msg = one_line(e.value)
    assert "could not be traced" in msg and "cuda_only" in msg and "HINT" in msg


def test_moe_outside_bf16_is_refused():
    with pytest.raises(ConfigError) as e:
        llmem_plugin.estimate(tiny_config("mixtral"), seq_len=16, precision="bf16-mixed")
    assert "--precision bf16" in one_line(e.value)


def test_live_module_storage_is_never_touched():
    """A real module's parameters are not read, copied or moved by estimate()."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    before = {n: (p.data_ptr(), p.device, p.clone()) for n, p in model.named_parameters()}
    est = llmem_plugin.estimate(model, seq_len=16, precision="fp32")
    for n, p in model.named_parameters():
        ptr, dev, val = before[n]
        assert p.data_ptr() == ptr and p.device == dev and torch.equal(p, val) and p.grad is None
    meta = llmem_plugin.estimate(tiny_config("llama"), seq_len=16, precision="fp32")
    assert est.peak_allocated_bytes == meta.peak_allocated_bytes
