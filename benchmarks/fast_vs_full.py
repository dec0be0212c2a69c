"""Fast mode against the full trace, at full size: every catalog model, and the
models whose layers differ (DeepSeek-V3 671B, Qwen3-MoE with
``decoder_sparse_step=2``, Gemma-3 1B, Jamba, RecurrentGemma, Mamba).

Each model runs in a fresh process: the full trace, then fast mode, under the
same workload (seq 2048, batch 1; default precision, or pure bf16 where the
model has experts: transformers' grouped_mm experts take bf16 only). Mamba,
Jamba and RecurrentGemma run at seq 128: without their CUDA kernels,
transformers scans the sequence one token at a time in Python, so a trace
costs seconds per token and layer. The GPU
memory is set to 1 PiB so that fast mode never hands a close verdict to the
full trace (``estimate.FAST_VERDICT_BAND``). Rows are appended to
``results/fast-vs-full-<date>.jsonl`` as they come.

    python benchmarks/fast_vs_full.py                 # all models
    python benchmarks/fast_vs_full.py gemma-3-1b ...  # some of them
    python benchmarks/fast_vs_full.py --default-path  # the default path (synthesized where exact) against
                                                      # --full, with and without checkpointing, byte for byte
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time

SEQ_LEN = 2048
SCAN_SEQ_LEN = 128  # sequential-scan models (see above)
CAPACITY = 2**50

# Architectures from the issue, as their published config.json files give them
# (fields the builder reads; the rest are transformers' defaults).
EXTRA = {
    # deepseek-ai/DeepSeek-V3 config.json (671B): 61 layers, the first 3 dense.
    "deepseek-v3-671b": ("DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=163840, tie_word_embeddings=False,
    )),
    # Qwen/Qwen3-30B-A3B config.json with every second layer dense.
    "qwen3-30b-a3b-sparse-step-2": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=2, max_position_embeddings=40960, tie_word_embeddings=False,
    )),
    # google/gemma-3-1b-pt config.json: 5 sliding-window layers, then 1 global.
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, sliding_window_pattern=6,
        max_position_embeddings=32768, query_pre_attn_scalar=256, rope_theta=1000000.0,
    )),
    # ai21labs/Jamba-v0.1 shapes at 8 of its 32 layers' period (one attention
    # layer in 8, experts every other layer), 16 experts.
    "jamba-v0.1": ("JambaConfig", dict(
        vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_experts=16, num_experts_per_tok=2, attn_layer_period=8, attn_layer_offset=4,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    )),
    # google/recurrentgemma-2b config.json: (recurrent, recurrent, attention) x 26 layers.
    "recurrentgemma-2b": ("RecurrentGemmaConfig", dict(
        vocab_size=256000, hidden_size=2560, intermediate_size=15360, num_hidden_layers=26, num_attention_heads=10,
        lru_width=2560, attention_window_size=2048, conv1d_width=4,
    )),
    # state-spaces/mamba-130m-hf config.json.
    "mamba-130m": ("MambaConfig", dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16)),
}


def _source(name: str):
    if name not in EXTRA:
        return name
    import transformers

    cls, fields = EXTRA[name]
    return getattr(transformers, cls)(**fields)


def _one(name: str, default_path: bool = False, gc: bool = False) -> dict:
    import llmem_plugin
    from llmem_plugin.errors import ConfigError

    if default_path:
        return _default_vs_full(name, gc)
    source = _source(name)
    seq_len = SCAN_SEQ_LEN if name in ("mamba-130m", "jamba-v0.1", "recurrentgemma-2b") else SEQ_LEN
    kw = dict(seq_len=seq_len, batch_size=1, gpu_memory=CAPACITY)
    try:
        llmem_plugin.estimate(source, fast=True, **{**kw, "seq_len": 8})  # warm-up, and the precision check
    except ConfigError:
        kw["precision"] = "bf16"
    row: dict = {"model": name, "seq_len": seq_len, "batch_size": 1}
    for fast in (False, True):
        t = time.perf_counter()
        est = llmem_plugin.estimate(source, fast=fast, **kw)
        tag = "fast" if fast else "full"
        row["precision"] = est.workload.precision.value
        row[f"{tag}_s"] = round(time.perf_counter() - t, 2)
        row[f"{tag}_mode"] = "fast" if est.fast else "full trace"
        for key in ("peak_tensor_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
            row[f"{tag}_{key}"] = getattr(est, key)
        row[f"{tag}_peak_phase"] = est.peak_phase.value
        if fast:
            row["fast_notes"] = [n for n in est.notes if n.startswith("fast")]
    for key in ("peak_tensor_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes"):
        row[f"err_{key.removeprefix('peak_').removesuffix('_bytes')}_pct"] = round(
            100 * (row[f"fast_{key}"] / row[f"full_{key}"] - 1), 5)
    return row


def _default_vs_full(name: str, gc: bool) -> dict:
    """The default path (``estimate(source)``: the stream synthesized from shortened copies where that is exact)
    against ``full=True``, every figure compared for byte equality."""
    import llmem_plugin
    from llmem_plugin.errors import ConfigError

    from llmem_plugin.models.modelbuild import build_model, position_limit
    from llmem_plugin.workload import Workload

    source = _source(name)
    seq_len = SCAN_SEQ_LEN if name in ("mamba-130m", "jamba-v0.1", "recurrentgemma-2b") else SEQ_LEN
    # A learned position table holds fewer positions than SEQ_LEN (GPT-2 1,024, BERT 512): its longest.
    try:
        probe = build_model(source, Workload(seq_len=8))
    except ConfigError:  # experts take bf16 only (as the warm-up below finds)
        probe = build_model(source, Workload(seq_len=8, precision="bf16"))
    seq_len = min(seq_len, position_limit(probe) or seq_len)
    kw = dict(seq_len=seq_len, batch_size=1, gpu_memory=CAPACITY, grad_checkpointing=gc)
    try:
        llmem_plugin.estimate(source, fast=True, **{**kw, "seq_len": 8})  # warm-up, and the precision check
    except ConfigError:
        kw["precision"] = "bf16"
    row: dict = {"model": name, "seq_len": seq_len, "batch_size": 1, "grad_checkpointing": gc}
    figures = {}
    for tag, full in (("default", False), ("full", True)):
        t = time.perf_counter()
        est = llmem_plugin.estimate(source, full=full, **kw)
        row["precision"] = est.workload.precision.value
        row[f"{tag}_s"] = round(time.perf_counter() - t, 2)
        row[f"{tag}_path"] = est.trace_path
        figures[tag] = (est.peak_tensor_bytes, est.peak_allocated_bytes, est.peak_reserved_bytes,
                        est.device_total_bytes, est.peak_phase.value)
        row[f"{tag}_peak_reserved_bytes"] = est.peak_reserved_bytes
    row["identical"] = figures["default"] == figures["full"]
    return row


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        default_path = "--default-path" in sys.argv
        print(json.dumps(_one(sys.argv[2], default_path=default_path, gc="--gc" in sys.argv)))
        return
    import subprocess

    from _common import RESULTS, environment

    from llmem_plugin.models import catalog

    default_path = "--default-path" in sys.argv
    gcs = [False, True] if default_path else [False]
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or [*sorted(catalog.names()), *EXTRA]
    stem = "default-vs-full" if default_path else "fast-vs-full"
    path = os.path.join(RESULTS, f"{stem}-{dt.date.today().isoformat()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"environment": environment()}) + "\n")
    for name, gc in ((n, g) for n in names for g in gcs):
        flags = (["--default-path"] if default_path else []) + (["--gc"] if gc else [])
        out = subprocess.run([sys.executable, __file__, "--case", name, *flags], capture_output=True, text=True,
                             check=False)
        if out.returncode != 0:
            row = {"model": name, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            row = json.loads(out.stdout.strip().splitlines()[-1])
        print(row, flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
