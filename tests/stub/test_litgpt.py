"""litgpt's own LoRA step on the stub CUDA device against the estimate of
``litgpt:DIR``, byte for byte.

``benchmarks/published/litgpt_stub.py --case`` runs litgpt 0.4.13's ``GPT``
with its LoRA layers, Fabric's fp32 output cast, ``chunked_cross_entropy``
and ``fit()``'s loop on torch's CUDA build with the stub libraries (torch's
own caching allocator, CUDA dispatch and SDPA backend choice), its modules
loaded from the litgpt the main environment imports. The allocator's cache is
emptied once the weights are placed, the state the estimate starts from. The
full-size configurations are in
benchmarks/results/published-litgpt-stub-2026-11-27.json.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from llmem_plugin.workload import LoraSpec, Workload

from tests.models.test_litgpt import small_config

pytest.importorskip("litgpt.config")

ALL = ("query", "key", "value", "projection", "mlp", "head")


@pytest.mark.parametrize(("name", "targets", "dropout"), [
    ("Llama-3.2-1B", ("query", "value"), 0.05),  # GQA, fused qkv with q and v adapted (zero-padded product)
    ("Gemma-2-2b", ALL, 0.1),  # softcapped eager attention, sliding-window bias, every projection adapted
])
def test_litgpts_step_on_the_stub_equals_the_estimate(stub, tmp_path, monkeypatch, name, targets, dropout):
    source = small_config(tmp_path, name)
    micro_batch, accum, seq_len, r = 2, 2, 256, 8
    pkg = Path(importlib.util.find_spec("litgpt").submodule_search_locations[0])
    case = {"config_file": source.removeprefix("litgpt:"), "micro_batch": micro_batch, "accum": accum, "r": r,
            "alpha": 16, "dropout": dropout, "targets": list(targets), "seq_len": seq_len}
    out = tmp_path / "row.json"
    proc = stub.run_python(["-m", "benchmarks.published.litgpt_stub", "--wheel", str(pkg), "--case", json.dumps(case),
                            "--out", str(out)], gpu="h100-sxm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())
    import torch

    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)  # as on the stub (no cuDNN SDPA)
    est = importlib.import_module("llmem_plugin.estimate").estimate(
        source, Workload(seq_len=seq_len, micro_batch_size=micro_batch, grad_accum_steps=accum, precision="bf16",
                         runner="plain-loop", lora=LoraSpec(rank=r, alpha=16, dropout=dropout, target_modules=targets,
                                                            adapter_dtype="base")),
        gpu="h100-sxm", torch_version="2.13.0")
    assert est.peak_allocated_bytes == row["step_max_memory_allocated"]
    assert est.peak_reserved_bytes == row["max_memory_reserved"]
