"""Host RSS of a training process before any model state: the framework's
resident memory that :data:`llmem_plugin.device.host.FRAMEWORK_RSS_BYTES` records.

Each case runs in a fresh process and reports its resident set size
(``psutil.Process().memory_info().rss``) and peak (``ru_maxrss``) after:

- ``torch``: ``import torch``;
- ``transformers``: also ``import transformers`` (and its ``LlamaForCausalLM``);
- ``step``: also a 2-layer Llama of hidden size 64 (about 1 MB of
  parameters) built and trained for two AdamW steps on the CPU, so the
  autograd engine, the optimizer and the allocator's first arenas are loaded.

CPU only: the host side of a CUDA context cannot be measured on this machine
(no GPU); docs/planner.md says where that figure comes from.

    python benchmarks/host_baseline.py      # writes results/host-baseline-<date>.json
"""

from __future__ import annotations

import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import run_cases, write  # noqa: E402

CASES = [{"stage": "torch"}, {"stage": "transformers"}, {"stage": "step"}]


def one(case: dict) -> dict:
    import psutil
    import torch

    params = 0
    if case["stage"] in ("transformers", "step"):
        from transformers import LlamaConfig, LlamaForCausalLM

        if case["stage"] == "step":
            torch.manual_seed(0)
            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, vocab_size=512)
            model = LlamaForCausalLM(cfg)
            params = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ids = torch.randint(0, 512, (1, 32))
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
    rss = psutil.Process().memory_info().rss
    return {**case, "rss_bytes": rss, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "model_params": params}


def main() -> None:
    rows = run_cases(os.path.abspath(__file__), CASES, one)
    if rows is None:
        return
    write("host-baseline", {"what": "host RSS of a fresh process (psutil rss, ru_maxrss), CPU torch build",
                            "rows": rows})


if __name__ == "__main__":
    main()
