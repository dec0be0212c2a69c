"""litgpt's own model class and loop (``litgpt:NAME`` / ``litgpt:DIR``,
llmem_plugin/models/litgpt.py): the fake trace of litgpt 0.4.13's ``GPT`` and
``fit()`` step equals a real CPU run of the same code byte for byte, the
loop keeps what ``fit()`` keeps, and what is not modelled is refused in one
line. The stub device's check is tests/stub/test_litgpt.py."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import yaml

from llmem_plugin.models import litgpt as lg
from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import resolve_config
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.trace.step import micro_mark
from llmem_plugin.trace.tracker import round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.trace.test_fake_equals_real import fake_and_real  # a litgpt:... source builds like a catalog config
from tests.trace.test_plain_loop import _live_at

litgpt_config = pytest.importorskip("litgpt.config")

# A small Llama-3-style and Gemma-2-style config (GQA, RoPE; Gemma 2's softcapping and sliding window).
SMALL = {"n_layer": 2, "n_embd": 256, "n_head": 4, "n_query_groups": 2, "head_size": 64, "intermediate_size": 512,
         "vocab_size": 2000, "padded_vocab_size": 2048, "block_size": 512}


def small_config(tmp_path, name: str = "Llama-3.2-1B", **extra) -> str:
    """A litgpt model_config.yaml: ``name``'s config table entry with SMALL's sizes."""
    cfg = dataclasses.asdict(litgpt_config.Config.from_name(name, **SMALL, **extra))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return f"litgpt:{path}"


# Lightning's BitsandbytesPrecision as litgpt 0.4.13 runs it (llmem_plugin.models.litgpt._quantize).
_LIGHTNING_BNB = {"quantize": "nf4", "kbit_prepare": "off", "quantize_lm_head": True, "quantized_from": "fp16",
                  "bnb_version": "0.42.0", "optimizer": "paged-adamw"}


def lora_wl(**kw) -> Workload:
    base = dict(seq_len=256, micro_batch_size=2, precision="bf16", runner="plain-loop", grad_accum_steps=2,
                lora=LoraSpec(rank=8, alpha=16, dropout=0.05, target_modules=("query", "value"), adapter_dtype="base"))
    return Workload(**{**base, **kw})


@pytest.mark.parametrize(("name", "wl"), [
    ("Llama-3.2-1B", lora_wl()),
    ("Llama-3.2-1B", lora_wl(lora=None, runner="torch")),  # full fine-tuning: finetune/full.py's loss
    ("Gemma-2-2b", lora_wl(lora=LoraSpec(rank=8, alpha=16, dropout=0.1, adapter_dtype="base",
                                         target_modules=("query", "key", "value", "projection", "mlp", "head")))),
    ("Llama-3.2-1B", lora_wl(**_LIGHTNING_BNB)),  # QLoRA: every nn.Linear 4-bit, bitsandbytes 0.42's matmul
], ids=["llama-lora", "llama-full", "gemma2-lora-all", "llama-qlora"])
def test_litgpt_fake_trace_equals_a_real_cpu_run(tmp_path, name, wl):
    fake, real = fake_and_real(small_config(tmp_path, name), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_fit_keeps_the_fp32_logit_chunks_and_the_loss_between_micro_steps(tmp_path):
    """Between micro-steps ``fit()`` holds ``logits`` (Fabric's fp32 copies of the
    128-token head chunks; the last one a view) and the 0-dim fp32 loss."""
    source = small_config(tmp_path)
    b, s = 2, 256
    traces = {r: fake_and_real(source, lora_wl(runner=r, micro_batch_size=b, seq_len=s))[0]
              for r in ("torch", "plain-loop")}
    mark = micro_mark(1, 0)
    held = _live_at(traces["plain-loop"], mark) - _live_at(traces["torch"], mark)
    chunks = s // lg.LM_HEAD_CHUNK
    assert held == chunks * round_allocation(4 * b * lg.LM_HEAD_CHUNK * SMALL["padded_vocab_size"]) + round_allocation(4)


def test_the_lora_model_is_litgpts_with_only_the_adapters_trainable(tmp_path):
    model = modelbuild.build_model(small_config(tmp_path), lora_wl(), device="meta")
    assert lg.is_litgpt_model(model) and type(model).__module__ == "litgpt.lora"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    h, kv = SMALL["n_embd"], SMALL["n_query_groups"] * SMALL["head_size"]
    assert trainable and all("lora_" in n for n in trainable)
    # Per layer: A (r x n_embd) and B over the enabled q and v outputs (litgpt LoRAQKVLinear).
    n = sum(p.numel() for n_, p in model.named_parameters() if n_ in trainable)
    assert n == SMALL["n_layer"] * (8 * h * 2 + (h + kv) * 8)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.cos.shape[0] == 256  # fit() rebuilt the RoPE cache at the sample length


def test_hf_target_names_map_to_litgpts_switches():
    assert lg.lora_flags(("q_proj", "v_proj")) == {"lora_query": True, "lora_key": False, "lora_value": True,
                                                   "lora_projection": False, "lora_mlp": False, "lora_head": False}
    assert lg.lora_flags(("gate_proj", "up_proj", "down_proj", "lm_head"))["lora_mlp"]
    with pytest.raises(ConfigError, match="all three MLP projections"):
        lg.lora_flags(("gate_proj",))
    with pytest.raises(ConfigError, match="no litgpt switch"):
        lg.lora_flags(("fc1",))


@pytest.mark.parametrize(("kw", "match"), [
    ({"quantize": "int8"}, "--quantize int8 with a litgpt model"),
    ({"quantize": "nf4", "kbit_prepare": "off"}, "BitsandbytesPrecision, which converts every nn.Linear"),
    ({**_LIGHTNING_BNB, "optimizer": "adamw"}, "instantiate_bnb_optimizer"),
    ({"grad_checkpointing": True}, "--grad-checkpointing with a litgpt model"),
    ({"loss": "chunked"}, "litgpt's scripts compute their own"),
    ({"runner": "hf-trainer"}, "--runner hf-trainer with a litgpt model"),
    ({"precision": "bf16-mixed"}, "bf16-true"),
])
def test_what_litgpts_step_does_not_model_is_refused_in_one_line(tmp_path, kw, match):
    with pytest.raises(UnsupportedError, match=match) as e:
        modelbuild.build_model(small_config(tmp_path), lora_wl(**kw))
    assert "\n" not in str(e.value) and "HINT" in str(e.value)


def test_bad_names_files_and_adapter_dtypes_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a litgpt config name"):
        modelbuild.build_model("litgpt:No-Such-Model", lora_wl())
    with pytest.raises(ConfigError, match="does not exist"):
        modelbuild.build_model(f"litgpt:{tmp_path}/missing.yaml", lora_wl())
    with pytest.raises(ConfigError, match="--lora-adapter-dtype base"):
        modelbuild.build_model(small_config(tmp_path), lora_wl(lora=LoraSpec(rank=8)))
    with pytest.raises(ConfigError, match="block size 512"):
        modelbuild.build_model(small_config(tmp_path), lora_wl(seq_len=1024))


def test_distributed_methods_and_the_planner_refuse_a_litgpt_model(tmp_path):
    source = small_config(tmp_path)
    with pytest.raises(UnsupportedError, match="one GPU only"):
        resolve_config(source)
    est = importlib.import_module("llmem_plugin.estimate")
    model = modelbuild.build_model(source, lora_wl(), device="meta")
    with pytest.raises(UnsupportedError, match="one GPU only"):
        est.trace_step(model, lora_wl(), vocab_size=100, wrap=lambda m: m)


def test_a_missing_litgpt_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_litgpt(name, *a, **k):
        if name.startswith("litgpt"):
            raise ImportError("No module named 'litgpt'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_litgpt)
    with pytest.raises(ConfigError, match="pip install litgpt==0.4.13 without its pinned"):
        modelbuild.build_model("litgpt:Llama-3.2-1B", lora_wl())


def test_the_cli_estimates_a_litgpt_checkpoint_dir_with_litgpts_defaults(tmp_path, capsys):
    """``--model litgpt:DIR`` reads the directory's model_config.yaml; the CLI gives litgpt's bf16-true,
    bf16 adapters, and for QLoRA Lightning's quantization settings; the report names litgpt's loss."""
    import json

    from tests.cli._run import run

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model_config.yaml").write_text(open(small_config(tmp_path).removeprefix("litgpt:")).read())
    argv = ["estimate", "--model", f"litgpt:{ckpt}", "--seq-len", "256", "--lora-rank", "8", "--runner", "plain-loop"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "litgpt's chunked_cross_entropy on the 128-token head chunks" in " ".join(out.split())
    wl = json.loads(run(capsys, *argv, "--quantize", "nf4", "--json")[1])["workload"]
    assert (wl["precision"], wl["lora"]["adapter_dtype"]) == ("bf16", "base")
    assert (wl["quantize_lm_head"], wl["quantized_from"], wl["kbit_prepare"]) == (True, "fp16", "off")


@pytest.mark.parametrize(("argv", "match"), [
    (["--model", "litgpt:No-Such-Model"], "not a litgpt config name"),
    (["--model", "litgpt:Llama-3.2-1B", "--method", "ddp", "--gpus", "2"], "one GPU only"),
])
def test_the_cli_refuses_litgpt_mistakes_with_exit_2_and_one_line(capsys, argv, match):
    from tests.cli._run import run

    code, out, err = run(capsys, "estimate", *argv)
    errors = [line for line in err.splitlines() if line.startswith("llmem: error:")]
    assert code == 2 and len(errors) == 1 and match in errors[0] and "Traceback" not in err, err


def test_lightnings_quantization_makes_every_linear_4bit_the_head_included(tmp_path):
    """BitsandbytesPrecision replaces torch.nn.Linear inside init_module: each block's fused qkv, attention
    projection, the three MLP projections (LLaMAMLP fc_1, fc_2, proj) and the LoRA head's linear."""
    from llmem_plugin.techniques.quant import Linear4bitStandIn

    model = modelbuild.build_model(small_config(tmp_path), lora_wl(**_LIGHTNING_BNB), device="meta")
    quantized = [n for n, m in model.named_modules() if isinstance(m, Linear4bitStandIn)]
    assert not [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert len(quantized) == SMALL["n_layer"] * 5 + 1 and "lm_head.linear" in quantized
    assert all(m.quant_dtype == torch.float16 for m in model.modules() if isinstance(m, Linear4bitStandIn))
