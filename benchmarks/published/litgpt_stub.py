"""Run litgpt's own LoRA fine-tuning step on the stub CUDA device, for the
litgpt config_hub rows of measurements.jsonl.

The estimator models a litgpt job with transformers' class of the same
architecture. This script runs litgpt's own code instead (its ``GPT``,
``LoRALinear``/``LoRAQKVLinear``, ``lm_head_chunk_size=128`` and
``chunked_cross_entropy``'s arithmetic, AdamW, the hand-written loop of
``litgpt/finetune/lora.py`` ``fit()``), on PyTorch's CUDA build with the stub
libraries: what PyTorch's caching allocator reports is exact, kernels compute
nothing. The step includes what Lightning Fabric adds around the model: its
``_FabricModule`` returns the outputs cast to fp32 (``convert_output``), so
the loss runs on fp32 copies of the logit chunks. After the steps it runs
``validate()``'s batch (an unchunked no_grad forward and the sliced
cross-entropy) with the last step's outputs still bound, as ``fit()`` does
every ``eval.interval`` steps; ``step_max_memory_allocated`` is the peak
before it. It tells, for each row, what litgpt's step itself peaks at, so a gap
between the estimate and the published figure splits into "transformers'
class holds a different set of tensors than litgpt's" (estimate against this
run) and "the published run peaked somewhere the step does not reach"
(this run against the figure: validation, generation, other sequence lengths).

litgpt 0.4.13 (PyPI) is the code of the table's commit 00af8b0d: the two
differ in nothing under ``litgpt/`` (``git diff 00af8b0d v0.4.13 -- litgpt/``
is empty). Its package ``__init__`` and ``litgpt.utils`` import Lightning,
which the stub venv does not carry; the three modules the step needs
(``config``, ``model``, ``lora``) import only two helpers from ``utils``, given
here as stand-ins (a round-up to a multiple, and a checkpoint key mapper the
step never calls).

Usage (the quantized rows are left out: litgpt pins bitsandbytes 0.42.0, whose
4-bit matmul keeps its inputs, and quantizes through Lightning's
``BitsandbytesPrecision``; the stub venv carries bitsandbytes 0.50.2 and no
Lightning)::

    pip download litgpt==0.4.13 --no-deps -d /tmp/litgpt
    stubcuda/run --gpu a10g python -m benchmarks.published.litgpt_stub \\
        --wheel /tmp/litgpt/litgpt-0.4.13-py3-none-any.whl \\
        --out benchmarks/results/published-litgpt-stub-2026-11-27.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.machinery
import importlib.util
import json
import platform
import sys
import tempfile
import types
import zipfile
from pathlib import Path

# Row id -> (litgpt config name, micro-batch, gradient accumulation, LoRA flags), read from
# config_hub/finetune/<model>/lora.yaml at 00af8b0d (r, alpha, dropout and the lora_* switches;
# train.micro_batch_size, train.global_batch_size / micro_batch_size on one device).
_ALL = ("query", "key", "value", "projection", "mlp", "head")
_QV = ("query", "value")
ROWS = {
    "lgch-llama-2-7b-lora": ("Llama-2-7b-hf", 2, 4, 32, 16, 0.05, _QV),
    "lgch-llama-3.1-8b-lora": ("Llama-3.1-8B", 1, 8, 32, 16, 0.05, _QV),
    "lgch-llama-3.2-1b-lora": ("Llama-3.2-1B", 1, 8, 32, 16, 0.05, _QV),
    "lgch-llama-3.2-3b-lora": ("Llama-3.2-3B", 1, 8, 32, 16, 0.05, _QV),
    "lgch-mistral-7b-lora": ("Mistral-7B-v0.1", 2, 4, 32, 16, 0.05, _QV),
    "lgch-phi-3-lora": ("Phi-3-mini-4k-instruct", 4, 2, 8, 16, 0.05, _ALL),
    "lgch-gemma2-2b-lora": ("Gemma-2-2b", 2, 3, 8, 16, 0.1, _ALL),
}
SEQ_LEN = 512  # train.max_seq_length; the transcription's tokens per sample (measurements.jsonl notes)
OPTIMIZER_STEPS = 2


def load_litgpt(source: Path) -> types.ModuleType:
    """litgpt's ``config``, ``model`` and ``lora`` modules from a wheel or an
    installed ``litgpt`` package directory, without executing its package
    ``__init__`` (which imports Lightning)."""
    if source.is_dir():
        package = source
    else:
        root = Path(tempfile.mkdtemp(prefix="litgpt-"))
        with zipfile.ZipFile(source) as z:
            z.extractall(root)
        package = root / "litgpt"
    spec = importlib.machinery.ModuleSpec("litgpt", None, is_package=True)
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [str(package)]
    sys.modules["litgpt"] = pkg
    utils = types.ModuleType("litgpt.utils")
    utils.find_multiple = lambda n, k: n if n % k == 0 else n + k - n % k
    utils.map_old_state_dict_weights = lambda *a, **k: None
    sys.modules["litgpt.utils"] = utils
    import litgpt.lora as lora

    return lora


def fabric_forward(model, *args, **kwargs):
    """``_FabricModule.forward`` under bf16-true: the module's output, every
    floating tensor cast with ``.to(torch.get_default_dtype())``
    (``convert_output``), the 16-bit originals released when it returns."""
    import torch

    output = model(*args, **kwargs)
    if isinstance(output, list):
        return [t.to(torch.get_default_dtype()) for t in output]
    return output.to(torch.get_default_dtype())


def chunked_cross_entropy(logits: list, targets, ignore_index: int = -100):
    """litgpt 0.4.13 ``litgpt.utils.chunked_cross_entropy`` on a list of chunk
    logits (the branch ``fit()`` takes), statement for statement: a function,
    so its per-chunk reshapes (a copy for the sliced last chunk when the
    micro-batch is above 1) are released when it returns, as in litgpt.
    ``litgpt.utils`` itself imports Lightning, which the stub venv lacks."""
    import torch

    logit_chunks = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
    target_chunks = [target_chunk.reshape(-1) for target_chunk in targets.split(logits[0].size(1), dim=1)]
    loss_chunks = [
        torch.nn.functional.cross_entropy(logit_chunk, target_chunk, ignore_index=ignore_index, reduction="none")
        for logit_chunk, target_chunk in zip(logit_chunks, target_chunks)
    ]
    non_masked_elems = (targets != ignore_index).sum()
    return torch.cat(loss_chunks).sum() / non_masked_elems.maximum(torch.ones_like(non_masked_elems))


def run_row(lora, name: str, micro_batch: int, accum: int, r: int, alpha: int, dropout: float,
            targets: tuple[str, ...], *, seq_len: int = SEQ_LEN, config_file: str | None = None,
            fresh_cache: bool = False) -> dict:
    """litgpt's LoRA step for one configuration. ``config_file``: a litgpt
    ``model_config.yaml`` instead of the config-table ``name``. ``fresh_cache``:
    empty the allocator's cache once the weights are placed, so the step starts
    from the state the estimate starts from (weights allocated, nothing else
    cached); without it the cache keeps what building the model left, and
    blocks the allocator does not split can count up to 1 MiB more each."""
    import torch

    flags = {f"lora_{t}": t in targets for t in _ALL}
    kwargs = dict(lora_r=r, lora_alpha=alpha, lora_dropout=dropout, **flags)
    config = lora.Config.from_file(config_file, **kwargs) if config_file else lora.Config.from_name(name, **kwargs)
    # fabric.init_module() under bf16-true: the model, LoRA parameters included, is created in bf16.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = lora.GPT(config)
    torch.set_default_dtype(torch.float32)
    lora.mark_only_lora_as_trainable(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-4, weight_decay=0.0, betas=(0.9, 0.95))
    model.max_seq_length = seq_len
    torch.cuda.synchronize()
    if fresh_cache:
        torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for it in range(OPTIMIZER_STEPS * accum):
        # fit(): `input_ids, targets = batch["input_ids"], batch["labels"]`, two tensors of the batch.
        ids = torch.randint(0, 1000, (micro_batch, seq_len), device="cuda")
        labels = ids.clone()
        # finetune/lora.py fit(): logits and loss stay bound until the next iteration rebinds them.
        # Lightning 2.4's _FabricModule.forward (fabric/wrappers.py) passes the output through
        # precision.convert_output, which for bf16-true (HalfPrecision) and BitsandbytesPrecision alike is
        # `tensor.to(torch.get_default_dtype())` on every floating tensor (plugins/precision/half.py,
        # bitsandbytes.py): each bf16 logit chunk comes back as an fp32 copy, made inside the call, before
        # `logits` lets go of the last micro-step's chunks.
        logits = fabric_forward(model, ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, labels[..., 1:])
        (loss / accum).backward()
        if (it + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
        peaks.append(torch.cuda.max_memory_allocated())
    step_peak = torch.cuda.max_memory_allocated()
    # fit() runs validate() every eval.interval optimizer steps, right after an optimizer step, while its
    # frame still binds the last micro-step's `logits` (the chunk list) and `loss`. validate() (no_grad,
    # eval mode): an unchunked forward, then chunked_cross_entropy(logits[..., :-1, :], ..., chunk_size=0),
    # whose reshape of the sliced view copies it. Validation batches are micro_batch_size samples.
    model.eval()
    with torch.no_grad():
        val_ids = torch.randint(0, 1000, (micro_batch, seq_len), device="cuda")
        val_logits = fabric_forward(model, val_ids)
        flat = val_logits[..., :-1, :].reshape(-1, val_logits.size(-1))
        val_loss = torch.nn.functional.cross_entropy(flat, val_ids[..., 1:].reshape(-1), ignore_index=-100)
        del val_logits, flat, val_loss
    model.train()
    out = {
        "config": config_file or name, "micro_batch_size": micro_batch, "grad_accum": accum, "seq_len": seq_len,
        "lora": {"r": r, "alpha": alpha, "dropout": dropout, "targets": list(targets)},
        "weights_bytes": weights,
        "step_max_memory_allocated": step_peak,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "peak_allocated_after_each_micro_step": peaks,
    }
    del model, optimizer, logits, loss, trainable
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", type=Path, required=True,
                   help="litgpt-0.4.13-py3-none-any.whl, or an installed litgpt package directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default=None, help="comma-separated row ids")
    p.add_argument("--case", default=None,
                   help="instead of the rows, one JSON case: {config_file, micro_batch, accum, r, alpha, dropout, "
                        "targets, seq_len}, run with a fresh cache after the weights (tests/stub/test_litgpt.py)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device: run under stubcuda/run (see the module docstring)")
    torch.backends.cudnn.enabled = False  # the stub's cuDNN computes nothing; LoRAQKVLinear's conv1d then
    # runs PyTorch's own grouped convolution (what it allocates is transient, a few KiB at rank 8-32)
    torch.backends.cuda.enable_cudnn_sdp(False)  # on sm90 SDPA would pick cuDNN attention, which the stub cannot
    # run; torch then chooses among flash, mem-efficient and math, as the estimate does with it off
    lora = load_litgpt(args.wheel)
    if args.case:
        c = json.loads(args.case)
        row = run_row(lora, "", c["micro_batch"], c["accum"], c["r"], c["alpha"], c["dropout"], tuple(c["targets"]),
                      seq_len=c["seq_len"], config_file=c["config_file"], fresh_cache=True)
        args.out.write_text(json.dumps(row) + "\n")
        return 0
    ids = args.only.split(",") if args.only else list(ROWS)
    unknown = [i for i in ids if i not in ROWS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: not a litgpt LoRA row here; valid: {', '.join(ROWS)}")
    rows = {}
    for row_id in ids:
        rows[row_id] = run_row(lora, *ROWS[row_id])
        print(f"{row_id}: {rows[row_id]['max_memory_allocated'] / 2**30:.3f} GiB allocated", flush=True)
    doc = {
        "what": "litgpt 0.4.13's own LoRA step on the stub CUDA device (benchmarks/published/litgpt_stub.py)",
        "date": datetime.date.today().isoformat(),
        "environment": {
            "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "python": platform.python_version(),
            "machine": platform.machine(), "litgpt_wheel": args.wheel.name, "cudnn": False,
        },
        "rows": rows,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
