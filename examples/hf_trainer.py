"""Fine-tune a causal LM with the HF Trainer, checked by llmem before the first step.

``callbacks=[LLMemCallback()]`` is the whole integration: before the first
forward the callback estimates the job the TrainingArguments describe on the
live model (single GPU, DDP under torchrun, DeepSpeed or FSDP) and stops it
with the memory report if it will not fit; after the first steps it logs
predicted vs actual peak memory through the Trainer's logging and appends a
row to ``<output_dir>/llmem-verify.jsonl`` (``llmem validate`` reads it).

On a CPU machine pass ``--gpu`` (the GPU to check the job for) and a tiny
model; the real CPU run is measured by the project's tracker:

    python examples/hf_trainer.py --tiny --gpu h100-sxm --steps 3
    torchrun --nproc_per_node 2 examples/hf_trainer.py --tiny --gpu h100-sxm   # DDP

On a GPU machine, a ~1B model from the bundled catalog (random weights, no
download):

    python examples/hf_trainer.py --model llama-3.2-1b --seq-len 2048 --batch-size 4 --bf16
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import transformers
from transformers import Trainer, TrainingArguments

from llmem_plugin.models import catalog
from llmem_plugin.integrations.hf import LLMemCallback

TINY = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 512}


class RandomTokens(torch.utils.data.Dataset):
    """Fixed-length random token sequences (labels = inputs), reproducible per index."""

    def __init__(self, vocab: int, seq_len: int, n: int) -> None:
        self.vocab, self.seq_len, self.n = vocab, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.2-1b", help="catalog name or config.json path")
    ap.add_argument("--tiny", action="store_true", help="shrink the model to 2 layers of width 64 (CPU runs)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 weights")
    ap.add_argument("--gpu", default=None, help="catalog GPU to check for (default: this machine's)")
    ap.add_argument("--gpu-memory", default=None, help="capacity override, e.g. 20GiB")
    ap.add_argument("--on-wont-fit", default="abort", choices=["abort", "warn"])
    ap.add_argument("--output-dir", default="llmem-hf-example")
    a = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # launched by torchrun
    config = catalog.load_config(a.model, TINY if a.tiny else None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args = TrainingArguments(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
        max_steps=a.steps, bf16=a.bf16, use_cpu=not torch.cuda.is_available(), report_to=[], logging_steps=1,
        save_strategy="no",
        ddp_backend="gloo" if distributed and not torch.cuda.is_available() else None,
    )
    callback = LLMemCallback(gpu=a.gpu, gpu_memory=a.gpu_memory, on_wont_fit=a.on_wont_fit,
                             compare_after_steps=min(3, a.steps))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(config.vocab_size, a.seq_len, 256),
                      callbacks=[callback])
    trainer.train()
    if trainer.is_world_process_zero():
        if callback.check is None:  # nothing to check against (the callback warned why) and training went on
            return
        print(callback.check.message())
        if callback.comparison is not None:
            print("llmem:", callback.comparison.summary())
            print(json.dumps({k: v for k, v in callback.comparison.metrics().items()}))


if __name__ == "__main__":
    main()
