"""The summary of an estimate as text: the tables ``llmem estimate`` prints and ``str(Estimate)`` returns.

It sits below both :mod:`llmem_plugin.estimate` (whose ``Estimate.__str__``
renders through it) and :mod:`llmem_plugin.cli.report` (which prints it and
renders the other reports with its helpers), so the core never imports the CLI's
commands. Its tables are laid out by :mod:`llmem_plugin.cli.columns`, which
imports nothing but rich, so that they fit the terminal without cutting a name.
"""

from __future__ import annotations

import torch
from rich.console import Console

from llmem_plugin.cli.columns import Column, print_fitted
from llmem_plugin.trace.tracker import MemoryCategory, Phase

__all__ = [
    "adapter_dtype",
    "batch_layout",
    "checkpointing_policy",
    "gib",
    "host_line",
    "load_path",
    "loss_path",
    "qlora_path",
    "render_estimate",
]

_GIB = 1024**3  # sizes are printed in GiB (2^30 bytes) and labelled so

# How Estimate.trace_path is printed at the end of the report.
_TRACE_PATHS = {"full": "full trace", "synthesized": "synthesized from shortened copies (exact)",
                "extrapolated": "fast (layer-extrapolated peaks)"}


def gib(nbytes: int) -> str:
    """``nbytes`` as GiB with two decimals."""
    return f"{nbytes / _GIB:,.2f}"


def _count(n: int) -> str:
    for unit, div in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def checkpointing_policy(wl) -> str:
    """What the traced step's layers keep for backward, in words."""
    if not wl.grad_checkpointing:
        return "none (every layer keeps its activations)"
    which = f"every {wl.checkpoint_every}th layer" if wl.checkpoint_every > 1 else "every layer"
    if wl.checkpoint_save_ops is None:
        return f"{which} recomputed in full (keeps only its input)"
    from llmem_plugin.techniques.checkpointing import parse_save_ops

    return f"{which} op-level selective: {parse_save_ops(wl.checkpoint_save_ops).describe()}"


def qlora_path(wl) -> str:
    """How the traced job quantizes its base weights, in words (llmem_plugin.techniques.quant)."""
    from llmem_plugin.techniques.quant import bnb_modelled_as, bnb_tuple

    if not wl.quantize.bitsandbytes:
        return ("torchao NF4 base (torchtune: attention and MLP weights, scalers quantized too; each matmul "
                "dequantizes its weight); the output projection and every other parameter keep their dtype")
    version = f"bitsandbytes {wl.bnb_version}"
    newer = bnb_modelled_as(wl.bnb_version)
    if newer:
        version += f" (newer than the newest read: modelled as {newer})"
    elif bnb_tuple(wl.bnb_version) < (0, 43, 2):
        version += " (each 4-bit matmul keeps its input until the loss is freed)"
    head = "the LM head quantized too" if wl.quantize_lm_head else "the LM head kept 16-bit"
    if wl.quantized_from is not None:
        head += f"; quantized from {wl.quantized_from} (each dequantized weight cast to the compute dtype)"
    prep = {"on": "peft's k-bit preparation: every other parameter fp32",
            "off": "no k-bit preparation: other parameters keep their dtype",
            "norms-only": "norm weights fp32, other parameters keep their dtype"}[wl.kbit_prepare]
    return f"{wl.quantize.value}{' + double quant' * wl.double_quant} base, {version}; {head}; {prep}"


def load_path(wl) -> str:
    """How the traced job's weights reach the GPU, in words (llmem_plugin.trace.loading)."""
    if wl.quantize is not None and not wl.quantize.bitsandbytes and wl.load == "torchtune-0.1":
        return ("torchtune 0.1's QLoRA setup: one layer made on the GPU and deep-copied per layer, each NF4 copy "
                "dequantized and re-quantized, then the checkpoint loaded, each weight quantized again; "
                "torchao 0.1's to_nf4, unchunked")
    if wl.quantize is not None and not wl.quantize.bitsandbytes:
        return ("torchtune 0.6.1's QLoRA setup: each layer made on the GPU, every weight 16-bit then to_nf4, "
                "then the checkpoint loaded, each weight quantized again from a 16-bit copy; torchao 0.18.0")
    if wl.quantize is not None:
        prep = {"on": ", then k-bit preparation casts the other weights to fp32",
                "norms-only": ", then the norm weights are cast to fp32"}.get(wl.kbit_prepare, "")
        return f"weights quantized on load by bitsandbytes, each arriving 16-bit first{prep}"
    if wl.load == "fp32-cast":
        return "weights materialised in fp32, then cast to their training dtype one by one"
    return "weights loaded once each in their training dtype"


def batch_layout(wl) -> str:
    """How the traced micro-batch lays out its tokens, in words."""
    tokens = wl.micro_batch_size * wl.seq_len
    if wl.packed_docs is None:
        return f"{wl.micro_batch_size} x {wl.seq_len} tokens, padded"
    return (f"one padding-free packed row of {tokens} tokens ({wl.micro_batch_size} x {wl.seq_len}) holding "
            f"{wl.packed_docs} documents, their boundaries passed to flash attention's varlen kernel")


def loss_path(est) -> str:
    """How the traced step computed its loss, in words (llmem_plugin.techniques.loss)."""
    wl = est.workload
    if est.model.startswith("litgpt:"):  # llmem_plugin.models.litgpt: litgpt's scripts compute their own loss
        from llmem_plugin.models.litgpt import loss_path as litgpt_loss_path

        return litgpt_loss_path(wl)
    if est.model_class and not est.model_class.endswith(("ForCausalLM", "LMHeadModel")):
        return f"{est.model_class}'s own loss"  # other tasks: their forward's loss, as traced
    path = _loss_path(wl)
    if wl.outputs_to_fp32:  # Lightning Fabric's convert_output (Workload.outputs_to_fp32)
        path += "; the model's outputs cast to fp32 by the loop's wrapper (Lightning Fabric)"
    return path


def _loss_path(wl) -> str:
    keep = f" on the last {wl.logits_to_keep} tokens" if wl.logits_to_keep else ""
    if wl.loss.value == "cce":
        return "Cut Cross-Entropy (cut-cross-entropy: no logits; lse, positions and the vocabulary order only)"
    if wl.loss.value == "liger":
        return "liger-kernel fused linear cross-entropy (no full logits)"
    if wl.loss.value == "trl-fused":
        return ("TRL 1.16's fused LM head (the valid labels' hidden states gathered, 4096 x 32768 logit tiles, fp32 "
                "gradient accumulators; no full logits)")
    if wl.loss.value == "chunked":
        each = "each chunk's logits upcast to fp32" if wl.loss_chunk_upcast else "no fp32 upcast"
        return f"chunked cross-entropy over {wl.loss_chunks} sequence chunks, {each}"
    if wl.loss.value == "no-upcast":
        return f"cross-entropy on the full logits in their own dtype (no fp32 copy){keep}"
    # transformers' ForCausalLMLoss (loss/loss_utils.py): logits.float(), then cross-entropy.
    return f"the model's own loss (transformers' ForCausalLMLoss: full logits upcast to fp32){keep}"


def adapter_dtype(wl) -> str:
    """The LoRA adapters' dtype where it is not peft's fp32 default on a 16-bit model."""
    if wl.lora.adapter_dtype == "base" and wl.precision.param_dtype != torch.float32:
        return f" ({str(wl.precision.param_dtype).removeprefix('torch.')} adapters)"
    return ""


def _print_breakdown(est, console: Console) -> None:
    """The tensors at the peak by category, then the peak, its phase and module (a module path wraps)."""
    labels = [cat.value for cat in MemoryCategory if cat is not MemoryCategory.HOST]
    values = [gib(est.breakdown.get(cat, 0)) for cat in MemoryCategory if cat is not MemoryCategory.HOST]
    totals = len(labels)
    labels += ["peak tensors", "peak phase"]
    values += [gib(est.peak_tensor_bytes), est.peak_phase.value]
    if est.peak_module:
        labels.append("active module")
        values.append(est.peak_module)
    print_fitted(console, [Column(header="tensors at the peak", cells=labels, style="bold"),
                           Column(header="GiB", cells=values, justify="right", wrap=True)], sections={totals})


def _print_per_gpu(est, console: Console) -> None:
    """What the GPU holds: torch's two peaks, nvidia-smi's total, the overheads outside the tensors, the
    verdict (what each is called wraps at narrow widths)."""
    ov = est.overheads
    rows = [("allocated", gib(est.peak_allocated_bytes), "torch.cuda.max_memory_allocated"),
            ("reserved", gib(est.peak_reserved_bytes), "torch.cuda.max_memory_reserved"),
            ("device total", gib(est.device_total_bytes), "nvidia-smi used memory")]
    overheads = len(rows)
    rows += [("cuBLAS workspaces", gib(ov.num_cublas_workspaces * ov.cublas_workspace_bytes
                                       + ov.cublaslt_workspace_bytes), "inside allocated"),
             ("CUDA context", gib(ov.cuda_context_bytes), "outside the allocator")]
    if ov.nccl_bytes:
        rows.append(("NCCL buffers", gib(ov.nccl_bytes), "outside the allocator"))
    if est.paged_bytes:
        rows.append(("paged optimizer states", gib(est.paged_bytes), "CUDA managed memory, evictable to host"))
    headroom = est.capacity_bytes - est.device_total_bytes
    rows.append(("verdict", "fits" if est.fits else "does NOT fit", f"headroom {gib(headroom)} GiB"))
    labels, values, names = zip(*rows)
    print_fitted(console, [Column(header="", cells=labels, style="bold"),
                           Column(header="GiB", cells=values, justify="right"),
                           Column(header="what torch / nvidia-smi calls it", cells=names, wrap=True)],
                 row_styles=[None] * (len(rows) - 1) + ["green" if est.fits else "red"], sections={overheads},
                 title=f"per GPU ({est.gpu}, {gib(est.capacity_bytes)} GiB)", title_justify="left")


def render_estimate(est, console: Console) -> None:
    """Print the breakdown at the peak of ``est`` (an :class:`llmem_plugin.estimate.Estimate`)."""
    wl = est.workload
    lora = f", LoRA r={wl.lora.rank}{adapter_dtype(wl)}" if wl.lora else ""
    if wl.quantize is not None:  # QLoRA: the quantization and what k-bit preparation upcast
        lora += f", {wl.quantize.value}{'+dq' * wl.double_quant} base (k-bit preparation {wl.kbit_prepare})"
    every = f" every {wl.checkpoint_every} layers" if wl.checkpoint_every > 1 else ""
    if wl.checkpoint_save_ops is not None:
        every += f", op-level SAC ({wl.checkpoint_save_ops})"
    gc = f", grad checkpointing{every}" if wl.grad_checkpointing else ""
    cls = f" ({est.model_class})" if est.model_class else ""
    title = (
        f"{est.model}{cls}: {_count(est.params)} params ({_count(est.trainable_params)} trainable), "
        f"seq {wl.seq_len} x batch {wl.micro_batch_size}, {wl.precision.value}, {wl.optimizer.value}{lora}{gc}"
    )
    console.print(title)
    _print_breakdown(est, console)
    _print_per_gpu(est, console)
    if est.alloc_retries:
        console.print(f"at this capacity the allocator frees its cached blocks and retries {est.alloc_retries} "
                      "time(s) per run (torch's num_alloc_retries): reserved is the replay capped at the GPU's "
                      "memory, and those retries cost time")
    if wl.offload_activations is not None:
        console.print(f"pinned host memory ({wl.offload_activations.value} activation offload): "
                      f"{gib(est.host_peak_bytes)} GiB")
    if est.host_bytes:
        console.print(host_line(est.host_bytes, est.host_capacity_bytes, est.host_memory_source,
                                 what=f"host (CPU) RAM of the process: {gib(est.host_bytes)} GiB "
                                      f"({gib(est.host_bytes - est.host_peak_bytes)} GiB framework and CUDA context)"))
    console.print(f"loss path: {loss_path(est)}")
    if wl.packed_docs is not None:
        console.print(f"batch: {batch_layout(wl)}")
    console.print(f"activation checkpointing: {checkpointing_policy(wl)}")
    if wl.quantize is not None:
        console.print(f"QLoRA: {qlora_path(wl)}")
    if est.setup_allocated_bytes is not None:
        console.print(f"setup ({load_path(wl)}): {gib(est.setup_allocated_bytes)} GiB allocated, "
                      f"{gib(est.setup_reserved_bytes)} GiB reserved before step 1; the peaks above include it")
    phases = ", ".join(f"{p.value} {gib(v)}" for p, v in est.phase_peaks.items() if p is not Phase.SETUP)
    mode = _TRACE_PATHS.get(est.trace_path, est.trace_path)
    console.print(f"per-phase peaks (GiB): {phases}")
    for note in est.notes:
        console.print(f"note: {note}", markup=False)  # notes quote TOML sections, "[parallelism]"
    console.print(f"{mode}, {est.seconds:.2f} s")


def host_line(need: int, capacity: int, source: str, *, what: str) -> str:
    """``what`` followed by the node's RAM, where it comes from, and the host verdict."""
    if not capacity:
        return what
    verdict = "fits" if need <= capacity else "does NOT fit"
    return f"{what}; node RAM {gib(capacity)} GiB ({source}): {verdict}"
