"""Fine-tune a tiny Llama with Lightning and ``strategy="llmem-auto"``.

On this CPU it runs anywhere (DDP is the only multi-process method Lightning
runs on the CPU); on GPUs the same script lets llmem pick DDP, FSDP,
DeepSpeed ZeRO or offload for the model and batch.

    python examples/lightning_fit.py --devices 2 --gpu h100-sxm --steps 3
    LLMEM_GPU=h100-sxm python examples/lightning_fit.py --devices 2 --strategy name

Each rank prints one ``llmem-lightning:`` line with the strategy and
precision plugin it trained with; ``<root>/llmem-verify.jsonl`` gets one
predicted-vs-measured row per rank.
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.loggers import CSVLogger
from llmem_plugin.integrations.lightning import LLMemAutoStrategy
from torch.utils.data import DataLoader, Dataset

import llmem_plugin  # noqa: F401 - registers "llmem-auto"; before the Trainer is built


class RandomTokens(Dataset):
    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CausalLM(pl.LightningModule):
    def __init__(self, config: transformers.PretrainedConfig, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # use_cache=False: the KV cache is for generation. Left at the config's
        # default (True), transformers builds a DynamicCache in training too
        # (models/llama/modeling_llama.py, LlamaModel.forward) whose torch.cat
        # copies of every layer's keys and values stay alive to the end of
        # forward (cache_utils.py, DynamicLayer.update), memory the estimate,
        # which runs use_cache=False (llmem_plugin/trace/step.py, _forward), omits.
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class FreeGradsAfterStep(CausalLM):
    """Frees the gradients right after the optimizer step, as a plain PyTorch
    loop does. Lightning zeroes them later, after the next training_step and
    before its backward (lightning/pytorch/loops/optimization/automatic.py,
    ``Closure.closure``), so its next forward runs with the previous step's
    gradients alive: a higher peak than the estimate's (docs/lightning.md)."""

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.zero_grad(set_to_none=True)


def tiny_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--gpu", default=None, help="catalog GPU to estimate for (needed on the CPU)")
    parser.add_argument("--gpu-memory", default=None, help='capacity override, e.g. "0.05GiB"')
    parser.add_argument("--strategy", choices=("object", "name"), default="object",
                        help='"name": Trainer(strategy="llmem-auto"), configured by $LLMEM_GPU')
    parser.add_argument("--on-wont-fit", choices=("abort", "warn"), default="abort")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--root", default="lightning_logs_llmem")
    parser.add_argument("--free-grads-after-step", action="store_true",
                        help="free the gradients after the optimizer step, as the estimate assumes")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    config = tiny_llama()
    module = (FreeGradsAfterStep if args.free_grads_after_step else CausalLM)(config)
    data = DataLoader(RandomTokens(num_samples=args.batch_size * args.devices * (args.steps + 1),
                                   seq_len=args.seq_len, vocab_size=config.vocab_size),
                      batch_size=args.batch_size, shuffle=True)
    strategy = "llmem-auto" if args.strategy == "name" else LLMemAutoStrategy(
        gpu=args.gpu, gpu_memory=args.gpu_memory, on_wont_fit=args.on_wont_fit, compare_after_steps=args.steps)
    trainer = pl.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices,
                         max_steps=args.steps, precision=args.precision, default_root_dir=args.root,
                         logger=CSVLogger(args.root), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("llmem/")}
    print("llmem-lightning: " + json.dumps({
        "rank": trainer.global_rank, "strategy": type(trainer.strategy).__name__,
        "precision_plugin": type(trainer.precision_plugin).__name__, "global_step": trainer.global_step,
        "metrics": metrics}), flush=True)


if __name__ == "__main__":
    main()
