"""Whole training steps on the stub CUDA device against the estimate, byte for byte.

``python -m benchmarks.groundtruth.run --device stub`` runs each case's CUDA
worker (the real model, loop and optimizer) on torch's CUDA build with the
stub libraries: torch's own caching allocator, CUDA dispatch, autocast,
SDPA backend choice (cuDNN off) and cuBLAS / cuBLASLt workspaces. Its
``max_memory_allocated`` / ``max_memory_reserved`` must equal the
estimator's allocated and reserved peaks exactly. The cases are small so
the test takes well under two minutes on two cores; the full-size rows are
in benchmarks/groundtruth/data/stub-h100-2026-11-25.jsonl.
"""

from __future__ import annotations

import pytest

from llmem_plugin.verify.validate import validate_rows

from .conftest import run_cases

# One worker builds this module's module-scoped fixtures once (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("stub-wholestep")

# tiny = catalog config with 2 layers, hidden 64 (benchmarks/groundtruth/matrix.py CPU_CASES),
# run under the "torch" runner on the stub.
CASES = (
    "tiny-llama-3.2-1b-bf16-mixed-s64-b2-sdpa",  # autocast, SDPA (efficient attention), foreach AdamW
    "tiny-llama-3.2-1b-bf16-s64-b2-gc-sdpa-adamw-fused",  # pure bf16, checkpointing, fused AdamW
    "tiny-gpt2-bf16-mixed-s64-b2-lora-eager",  # GPT-2 Conv1D (cuBLASLt addmm), LoRA, eager attention
    "tiny-opt-125m-fp32-s32-b2-ga2-sdpa",  # fp32, gradient accumulation 2
    "gpt2-fp32-s1024-b8-sdpa",  # full GPT-2 124M: segments of the large pool
    "tiny-distilbert-sst2-bf16-mixed-s64-b2-sdpa",  # a sequence classifier: labels [batch]
    "tiny-t5-base-bf16-mixed-s64-b2-sdpa-t16",  # seq2seq: a 16-token target under a 64-token source
    "tiny-bart-base-fp32-s32-b2-sdpa-t16",  # BART; with LoRA: test_bart_lora_once_the_mask_read_is_a_gpu_s below
    "tiny-seqcls-llama-3.2-1b-bf16-mixed-s64-b2-sdpa",  # a decoder saved as a sequence classifier
    "tiny-seqcls-bert-base-uncased-bf16-mixed-s64-b2-sdpa",  # BERT and RoBERTa classifiers
    "tiny-seqcls-roberta-base-fp32-s64-b2-sdpa",
    "tiny-bert-base-uncased-bf16-mixed-s64-b2-sdpa",  # BERT's masked-LM head
    # Checkpointing policies (4 layers, activations set the peak): every second layer; op-level SAC, where
    # torch's policy sees the real CUDA SDPA op and the estimator's emulation stands in for it.
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-gc-every2-sdpa",
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-gc-sac-torchtitan-sdpa",
    "tiny4-llama-3.2-1b-bf16-s256-b4-gc-sac-torchtitan-lora-sdpa",
    "tiny4-llama-3.2-1b-bf16-s256-b4-gc-reentrant-lora-sdpa",  # reentrant (LLaMA-Factory's default)
    "tiny4-qwen2.5-0.5b-bf16-mixed-s256-b4-gc-sac-_scaled_dot_product_efficient_attention+mm-sdpa",
    # The plain loop: each micro-step's outputs (logits, loss and its graph) alive into the next forward.
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-ga2-sdpa-plainloop",
    # The chunked head (torchtune's chunked-output cross-entropy, no upcast), with LoRA and accumulation.
    # Under the plain loop (…-chunked4-noup-plainloop) the estimate is 512 B over: the ignore column the
    # estimator's hstack keeps (torchtune caches it) against the harness's F.pad.
    "tiny4-llama-3.2-1b-bf16-s256-b4-ga2-lora-sdpa-chunked4-noup",
    # LoRA adapters in the base dtype (peft autocast_adapter_dtype=False), dropout 0.05: bf16 branch inputs.
    "tiny4-llama-3.2-1b-bf16-s256-b4-lorabase-sdpa",
    # QLoRA through bitsandbytes 0.50.2's own CUDA library (loaded on the stub since stubcuda/build.py
    # adds its imports): packed nf4 weights, the dequantize-then-linear path, peft's k-bit preparation off.
    # With double quantization and the preparation on (…-bf16-mixed-s256-b4-lora-sdpa-nf4-dq) the estimate
    # is 1,024 B (0.001%) under: an 8 KiB fp32 absmax that bitsandbytes frees when its fallback returns.
    "tiny4-llama-3.2-1b-bf16-s256-b4-lora-sdpa-nf4-kbit-off",
    # bitsandbytes' paged AdamW (managed memory, host memory on the stub, outside PyTorch's allocator). As
    # litgpt's QLoRA recipe runs it (nf4, bf16 adapters, paged AdamW, chunked head, plain loop:
    # …-lorabase-sdpa-paged-adamw-nf4-kbit-off-chunked4-noup-plainloop) the estimate is 512 B over, the
    # chunked plain loop's ignore column above.
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-sdpa-paged-adamw",
    # torchao's NF4 as torchtune runs it: torchao's own NF4Tensor and linear_nf4 on CUDA dispatch.
    "tiny4-llama-3.2-1b-bf16-s256-b4-gc-lorabase-sdpa-nf4-torchao",
)


@pytest.fixture(scope="module")
def rows(stub, tmp_path_factory):
    return run_cases(tmp_path_factory, CASES, steps=2)


def test_rows_are_stub_evidence(rows):
    assert [r["id"] for r in rows] == list(CASES)
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert r["device"] == "stub" and r["device_kind"] == "stub"
        assert r["measured"]["device_total_bytes"] is None
        assert all(s["device_used_bytes"] is None for s in r["steps"])
        assert r["stub"]["cudnn_sdp_enabled"] is False
        assert r["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    # Llama-style models read the position ids once per forward (transformers' packed-sequence check).
    llama = rows[0]["stub"]
    assert llama["neutralised"] == {"transformers.masking_utils.find_packed_sequence_indices": 2}
    assert {d["site"].split(":")[0] for d in llama["device_reads"]} == {"transformers/masking_utils.py"}


def test_estimate_equals_the_stub_allocator(rows):
    report = validate_rows(rows)
    for c in report.rows:
        assert c.kind == "stub" and c.note == ""
        assert c.predicted["allocated"] == c.measured["allocated"], (c.id, c.diff_bytes)
        assert c.predicted["reserved"] == c.measured["reserved"], (c.id, c.diff_bytes)
    assert report.num_stub_exact == len(CASES)
    assert report.summary["allocated"].num_rows == 0  # none of it counts as GPU truth


def test_bart_lora_once_the_mask_read_is_a_gpu_s(stub, tmp_path):
    """BART with LoRA on q_proj/v_proj: at its peak (backward's start) the decoder's self-attention masks are
    alive. On a GPU, transformers reads its all-ones decoder mask as unpadded and attends with is_causal;
    the stub reads 0 there and builds a boolean mask that torch converts per layer (+2,048 B per layer,
    tests/stub/_unpadded_masks.py). With that read answered as a GPU answers it, the estimate is exact."""
    import json
    import os

    case = "tiny-bart-base-fp32-s32-b2-lora-sdpa-t16"
    row_file = tmp_path / "row.json"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(stub.ROOT), os.environ.get("PYTHONPATH")]))}
    proc = stub.run_python(["-m", "tests.stub._unpadded_masks", "--worker", case, "--worker-device", "stub",
                            "--stub-gpu", "h100-sxm", "--steps", "2", "--row-file", str(row_file)],
                           env=env, timeout_s=300)
    assert row_file.exists(), proc.stderr[-2000:]
    row = json.loads(row_file.read_text())
    assert row["status"] == "ok", row["error"]
    assert row["stub"]["neutralised"] == {"transformers.masking_utils._ignore_causal_mask_sdpa": 2}
    assert row["stub"]["device_reads"] == []  # no read left that takes the all-zero path
    (c,) = validate_rows([row]).rows
    assert c.kind == "stub" and c.note == ""
    assert c.predicted["allocated"] == c.measured["allocated"], c.diff_bytes
    assert c.predicted["reserved"] == c.measured["reserved"], c.diff_bytes
