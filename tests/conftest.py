"""Tiny models of several architectures, built from configs (no downloads)."""

from __future__ import annotations

import os
import sys

import pytest

import transformers

# The trace cache is keyed by the inputs and the code, not by what a test monkeypatches: off for the
# suite (llmem_plugin/trace/cache.py), on only where tests/trace/test_cache.py turns it on.
os.environ["LLMEM_NO_CACHE"] = "1"

# Small but structurally complete configs: GQA where the family has it, tied
# embeddings where the family ties them, dropout where the family has it.
TINY_CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )),
    "gpt2": (transformers.GPT2Config, dict(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0,
    )),
    "opt": (transformers.OPTConfig, dict(
        vocab_size=512, hidden_size=64, ffn_dim=160, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64,
    )),
    "qwen2": (transformers.Qwen2Config, dict(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )),
    "mixtral": (transformers.MixtralConfig, dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512,
    )),
}


def room(gib: float) -> int:
    """A GPU memory size for tests that sit a budget near a fit: the CUDA
    context the estimator adds outside the allocator
    (``llmem_plugin.device.overheads.CUDA_CONTEXT_BYTES``) plus ``gib`` GiB, so the
    budget keeps its meaning when the context figure moves. (The planner's
    5% margin applies to the whole size, so the room below its limit is
    ``0.95 * room(gib) - context``.)"""
    from llmem_plugin.device.overheads import CUDA_CONTEXT_BYTES

    return CUDA_CONTEXT_BYTES + int(gib * 2**30)


def tiny_config(arch: str, **overrides):
    cls, kwargs = TINY_CONFIGS[arch]
    return cls(**{**kwargs, **overrides})


@pytest.fixture(params=sorted(TINY_CONFIGS))
def arch(request) -> str:
    return request.param


@pytest.fixture
def no_bitsandbytes(monkeypatch):
    """Make every ``import bitsandbytes...`` fail, as on a machine without it."""
    for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError):
        import bitsandbytes  # noqa: F401
    yield


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    """The trace and result caches turned on (the suite turns them off above), in a fresh folder."""
    monkeypatch.setenv("LLMEM_NO_CACHE", "0")
    monkeypatch.setenv("LLMEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
