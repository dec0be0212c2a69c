"""Padding-free packed batches: documents concatenated into one row.

A padding-free collator flattens a micro-batch into a single row and passes
each document's boundaries with it, so flash attention runs its varlen kernel
over the documents and no padding or attention mask exists. TRL 1.16's
``DataCollatorForLanguageModeling(padding_free=True)`` (trl/trainer/
sft_trainer.py ``torch_call``; on by default with ``packing=True`` and the
``bfd`` strategy) returns, for a row of ``T`` tokens and ``n`` documents:

- ``input_ids``, ``labels`` and ``position_ids`` ``[1, T]`` (int64; positions
  restart at 0 in each document);
- ``cu_seq_lens_q`` and ``cu_seq_lens_k``: one int32 ``[n + 1]`` tensor of
  document starts and the total, under both keys (the Trainer moves each
  key's value to the GPU, so the device holds two copies);
- ``max_length_q``/``max_length_k``: the longest document, a Python int;
- ``seq_idx`` ``[1, T]`` int32: each token's document.

transformers' ``_flash_attention_forward`` takes the varlen path when all
four boundary inputs are given (modeling_flash_attention_utils.py), and
``create_causal_mask`` runs ``find_packed_sequence_indices`` on the
positions (masking_utils.py), whose result flash attention's mask function
drops. What this module models: a micro-batch of ``micro_batch_size`` x
``seq_len`` tokens (a packed row per sample, each full: the most a row holds)
split into ``packed_docs`` documents of equal length (the last takes the
remainder). The kernel's memory depends on the document count only through
its 128 rows of padding per document (``mha_varlen_bwd``).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from typing import Any

import torch


__all__ = ["BOUNDARIES", "doc_lengths", "documents", "packed_batch", "tracing", "unsupported"]

# How the model learns the documents' boundaries: from the collator (cu_seq_lens_q/k and max_length_q/k among
# the inputs: TRL's padding-free collator, DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or from
# the positions alone (DataCollatorWithFlattening's default): each attention call then
# derives them (prepare_fa_kwargs_from_position_ids: a nonzero and a host sync per layer).
BOUNDARIES = ("collator", "positions")

_DOCUMENTS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("llmem_packed_documents",
                                                                                  default=None)


@contextlib.contextmanager
def tracing(lengths: list[int] | None) -> Iterator[None]:
    """Within this block the row being traced holds documents of these lengths (None: not a packed row);
    the attention emulation reads them (:func:`documents`)."""
    token = _DOCUMENTS.set(None if lengths is None else tuple(lengths))
    try:
        yield
    finally:
        _DOCUMENTS.reset(token)


def documents() -> tuple[int, ...] | None:
    """The document lengths of the row being traced (:func:`tracing`), for the attention emulation."""
    return _DOCUMENTS.get()


def doc_lengths(total: int, docs: int) -> list[int]:
    """``docs`` lengths summing to ``total``: equal, the last with the remainder."""
    base = total // docs
    return [base] * (docs - 1) + [total - base * (docs - 1)]


def unsupported(method: str, workload: Any) -> str | None:
    """Why a packed ``workload`` cannot be estimated under ``method``, or None
    (one sentence with a HINT; :func:`llmem_plugin.techniques.check_supported`)."""
    if workload.packed_docs is None:
        return None
    attn = workload.attn_implementation.value
    if attn != "flash_attention_2":
        return (f"--packed-docs with --attn {attn} is not modelled: without flash attention's varlen kernel "
                "transformers builds a [T, T] block-diagonal mask over the packed row. HINT: pass --attn "
                "flash_attention_2, as padding-free packing expects")
    if method != "single":
        return (f"--packed-docs under {method} is not modelled yet (checked on one GPU). HINT: estimate one GPU's "
                "step without --method, or drop --packed-docs")
    if workload.loss.value not in ("hf", "trl-fused") or workload.logits_to_keep:
        return ("--packed-docs is modelled with the model's own loss and TRL's fused head only. HINT: use --loss hf "
                "or trl-fused, and drop --logits-to-keep")
    if workload.reference_model:
        return ("--packed-docs with --reference-model is not modelled: TRL's DPO turns padding-free off. "
                "HINT: drop --packed-docs")
    if workload.task not in (None, "causal-lm"):
        return f"--packed-docs with --task {workload.task} is not modelled (causal LMs only). HINT: drop --packed-docs"
    return None


def packed_batch(lengths: list[int], vocab: int, *, fake: bool,
                 boundaries: str = "collator") -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``input_ids``, ``labels`` and the other inputs of a packed row of documents of these lengths.

    Each tensor is one allocation, made in the order the Trainer moves the
    collator's keys to the GPU (the collator builds them on the CPU). With
    ``boundaries="positions"`` the row carries its positions only
    (transformers' ``DataCollatorWithFlattening`` by default). The step
    traces it within :func:`tracing` of the same lengths.
    """
    from llmem_plugin.trace._pause import untracked

    starts = [0, *itertools.accumulate(lengths)]
    gen = None if fake else torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (1, starts[-1]), generator=gen)
    labels = input_ids.clone()
    with untracked():  # the collator's CPU tensors; what reaches the GPU is their copies below
        if not fake:
            labels[0, starts[:-1]] = -100  # TRL: labels[position_ids == 0] = -100
        host: dict[str, Any] = {"position_ids": torch.tensor([i for n in lengths for i in range(n)])[None]}
        if boundaries == "collator":
            host["cu_seq_lens_q"] = torch.tensor(starts, dtype=torch.int32)
            host["cu_seq_lens_k"] = torch.tensor(starts, dtype=torch.int32)
            host["max_length_q"] = host["max_length_k"] = max(lengths)
            host["seq_idx"] = torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32)[None]
    return input_ids, labels, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
