"""One HF Trainer run on this CPU with ``LLMemCallback`` attached, for
tests/integrations/test_hf_distributed.py (launched by torchrun, or as one
process with the distributed environment set).

Usage: ``_hf_job.py OUT_DIR {single,ddp,zero1,zero2,zero3}``.

Each rank prints one JSON line: the callback's prediction and comparison,
the Trainer's global step and the ``llmem/*`` entries of its log history.
The process then leaves through a barrier and ``os._exit`` (see
tests/methods/_gloo.py: a normal exit can abort in gloo's or DeepSpeed's
C++ destructors after the result was printed).
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch
import torch.distributed as dist
import transformers
from llmem_plugin.integrations.hf import LLMemCallback

from tests.conftest import tiny_config

SEQ_LEN, BATCH, NUM_STEPS = 16, 2, 2


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences, labels equal to the inputs."""

    def __init__(self, vocab_size: int, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab_size, (n, SEQ_LEN), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _deepspeed_config(method: str, cfg) -> dict:
    """The config ``to_deepspeed_config`` gives for a plan pinned to ``method``."""
    from llmem_plugin.integrations.deepspeed import to_deepspeed_config

    from llmem_plugin import plan
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=SEQ_LEN, micro_batch_size=BATCH, precision="bf16-mixed", optimizer="adamw")
    p = plan(cfg, gpu="h100-sxm", num_gpus=2, workload=wl, methods=[method], micro_batch=BATCH,
             global_batch=2 * BATCH, grad_checkpointing=False)
    return to_deepspeed_config(p, optimizer=False)  # the Trainer builds the optimizer, as autoconfigure leaves it


def _breakdown(est) -> dict:
    worst = getattr(est, "worst", est)
    return {str(getattr(k, "value", k)): v for k, v in worst.breakdown.items()}


def main(out_dir: str, method: str) -> None:
    torch.set_num_threads(1)
    cfg = tiny_config("llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    kw = {}
    if method == "ddp":
        kw.update(ddp_backend="gloo")
    elif method != "single":
        ds = _deepspeed_config(method, cfg)
        kw.update(deepspeed=ds, bf16=True,
                  gradient_accumulation_steps=ds["gradient_accumulation_steps"])
    args = transformers.TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=NUM_STEPS,
        learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
        disable_tqdm=True, seed=0, **kw)
    cb = LLMemCallback(gpu="h100-sxm", compare_after_steps=NUM_STEPS,
                       record_file=os.path.join(out_dir, "verify.jsonl"))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(cfg.vocab_size, 64), callbacks=[cb])
    trainer.train()
    p = cb.check.prediction if cb.check is not None else None
    c = cb.comparison
    result = {
        "rank": int(args.process_index),
        "world_size": int(args.world_size),
        "global_step": int(trainer.state.global_step),
        "wrapped": type(trainer.model_wrapped).__name__,
        "method": p.method if p else None,
        "num_gpus": p.num_gpus if p else None,
        "predicted_tensor_bytes": p.tensor_bytes if p else None,
        "measured_bytes": c.measurement.allocated_bytes if c else None,
        "measured_breakdown": c.measurement.breakdown if c else None,
        "measured_steps": [st["allocated_bytes"] for st in c.measurement.steps] if c else None,
        "predicted_breakdown": _breakdown(cb.check.estimate) if p else None,
        "param_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "llmem_logs": [{k: v for k, v in e.items() if k.startswith("llmem/") or k == "step"}
                       for e in trainer.state.log_history if any(k.startswith("llmem/") for k in e)],
    }
    print("LLMEM-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
    os._exit(0)
