"""An HF Trainer or Lightning run on the stub CUDA device with the adapters' snapshots on, for
tests/stub/test_snapshot.py.

Usage: ``_snapshot_job.py {hf,lightning} OUT_DIR CAPACITY_BYTES``. The run uses a tiny Llama
(2 layers, hidden 64) for 3 steps; with a capacity below its step it runs out of memory,
and the exception leaves the process as a job's would.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch
import transformers


def tiny_config():
    """A 2-layer Llama (the shape of tests.conftest's tiny llama, which imports pytest the stub venv lacks)."""
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                    max_position_embeddings=256)

SEQ_LEN, BATCH, NUM_STEPS = 64, 4, 3


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab_size: int, n: int) -> None:
        self.ids = torch.randint(0, vocab_size, (n, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf(out: str, capacity: int) -> None:
    from llmem_plugin.integrations.hf import LLMemCallback

    cfg = tiny_config()
    model = transformers.LlamaForCausalLM(cfg).cuda()
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, max_steps=NUM_STEPS, learning_rate=1e-4,
        save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True, seed=0,
        dataloader_pin_memory=False)
    cb = LLMemCallback(gpu="h100-sxm", gpu_memory=capacity, on_wont_fit="warn", snapshot_dir=os.path.join(out, "snaps"),
                       compare_after_steps=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(cfg.vocab_size, 64), callbacks=[cb])
    trainer.train()
    print("TRAINED", flush=True)


def _lightning(out: str, capacity: int) -> None:
    import lightning.pytorch as pl

    cfg = tiny_config()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.LlamaForCausalLM(cfg)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    loader = torch.utils.data.DataLoader(_Tokens(cfg.vocab_size, 64), batch_size=BATCH)
    from llmem_plugin.integrations.lightning import strategy_class

    strategy = strategy_class()(gpu="h100-sxm", gpu_memory=capacity, on_wont_fit="warn",
                                snapshot_dir=os.path.join(out, "snaps"), compare_after_steps=2)
    trainer = pl.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=NUM_STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(Module(), loader)
    print("TRAINED", flush=True)


if __name__ == "__main__":
    from llmem_plugin.device.overheads import device_overheads

    kind, out, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # The stub's device holds no CUDA context: the estimate's capacity adds back what lies outside the allocator.
    outside = device_overheads((9, 0), torch_version=torch.__version__.split("+")[0]).outside_allocator_bytes
    {"hf": _hf, "lightning": _lightning}[kind](out, capacity + outside)
