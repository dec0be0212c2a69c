"""Train a tiny Llama with TRL 1.16.0's own DPOTrainer and LLMemCallback on the CPU; print JSON.

Run in a subprocess with TRL and datasets on PYTHONPATH (.frameworks/). Each
example is a one-token prompt and a chosen and a rejected completion of the
same length (EOS included), so a batch has no padding and every label after
the prompt counts, as the estimate assumes. DPOTrainer patches the policy with
its fused LM head, concatenates chosen and rejected rows, and scores them again
with the reference under no_grad: with LoRA the policy with its adapters
disabled, otherwise the given frozen copy. The callback compares its estimate
with the peak the project's tracker measured after the second optimizer step.

Usage: trl_dpo_live.py REFERENCE DTYPE, with REFERENCE lora (adapters disabled)
or copy (a full fine-tune with ref_model=deepcopy(model)); DTYPE fp32 or bf16
(bf16 weights, bf16=True).
"""

import copy
import sys

import datasets
import pyarrow as pa
import torch
from _trl_live import callback, tokenizer, train_and_report
from _trl_live import model as tiny_model
from datasets.table import InMemoryTable
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

reference, dtype = sys.argv[1], sys.argv[2]
model = tiny_model(dtype)
vocab = model.config.vocab_size
g = torch.Generator().manual_seed(0)


def completion(n: int) -> str:
    return "".join(f" w{int(i)}" for i in torch.randint(3, vocab, (n - 1,), generator=g)) + " </s>"


table = pa.table({"prompt": ["w2"] * 32, "chosen": [completion(40) for _ in range(32)],
                  "rejected": [completion(40) for _ in range(32)]})
# Dataset.from_dict fingerprints the table with dill, which fails on this pyarrow build; a given fingerprint skips it.
data = datasets.Dataset(InMemoryTable(table), fingerprint="llmem-dpo-probe")
args = DPOConfig(output_dir="/tmp/llmem-dpo-probe", per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                 report_to=[], logging_steps=1, save_strategy="no", dataloader_num_workers=0, max_length=64,
                 bf16=dtype == "bf16", gradient_checkpointing=False)
cb = callback()
extra = ({"peft_config": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")}
         if reference == "lora" else {"ref_model": copy.deepcopy(model)})
trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer(vocab), callbacks=[cb],
                     **extra)
train_and_report(trainer, cb)
