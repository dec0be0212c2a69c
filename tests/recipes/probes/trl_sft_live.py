"""Train a tiny Llama with TRL 1.16.0's own SFTTrainer and LLMemCallback on the CPU; print JSON.

Run in a subprocess with TRL and datasets on PYTHONPATH (.frameworks/). The
trainer is built as users build it: a pre-tokenized dataset, a LoRA
``peft_config`` or none, ``packing`` with the given strategy, and a callback asked to
check the job for an H100. SFTTrainer patches the model with its fused LM head
(``add_fused_lm_head``); the callback estimates that step and, after the second
optimizer step, compares it with the peak the project's tracker measured on the
real tensors (CUDA emulation: the head's compact path, its Triton folds run as
TRL's torch folds without their temporaries).

Usage: trl_sft_live.py PACKING DTYPE GC TUNING, with PACKING one of wrapped,
bfd, none; DTYPE fp32 (autocast-free fp32) or bf16 (bf16 weights, bf16=True);
GC 0 or 1; TUNING lora (a LoRA ``peft_config``) or full.
"""

import sys

import datasets
import pyarrow as pa
import torch
from _trl_live import callback, tokenizer, train_and_report
from _trl_live import model as tiny_model
from datasets.table import InMemoryTable
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

packing, dtype, gc, tuning = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
model = tiny_model(dtype)
vocab = model.config.vocab_size
g = torch.Generator().manual_seed(0)
rows = [torch.randint(2, vocab, (int(torch.randint(20, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(64)]
# Dataset.from_dict fingerprints the table with dill, which fails on this pyarrow build; a given fingerprint skips it.
data = datasets.Dataset(InMemoryTable(pa.table({"input_ids": rows})), fingerprint="llmem-sft-probe")
args = SFTConfig(output_dir="/tmp/llmem-sft-probe",
                 per_device_train_batch_size=2, max_steps=3, use_cpu=True, report_to=[], logging_steps=1,
                 save_strategy="no", dataloader_num_workers=0, max_length=64, packing=packing != "none",
                 packing_strategy="bfd" if packing == "none" else packing, bf16=dtype == "bf16",
                 gradient_checkpointing=gc)
cb = callback()
lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if tuning == "lora" else None
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(vocab), callbacks=[cb],
                     peft_config=lora)
train_and_report(trainer, cb)
