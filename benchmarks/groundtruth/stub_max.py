"""``llmem max`` against the stub CUDA device: the found value runs, the next one up runs out of memory.

From the repository root (the stub environment built by ``stubcuda/setup.sh``)::

    python -m benchmarks.groundtruth.stub_max --out benchmarks/results/max-stub-DATE.jsonl
    python -m benchmarks.groundtruth.stub_max --only lora-batch --out rows.jsonl

For each config the search (:mod:`llmem_plugin.planner.largest`, headroom 0)
runs in this process with cuDNN attention off, as on the stub. Then the
found value and the next value up each run two optimizer steps of the rank
on the stub device (:mod:`.stub_worker`: torch's CUDA build, its real caching
allocator, the real FSDP2 code on torch's fake process group), with the
stub's capacity set to what the estimate leaves the caching allocator on
the GPU: the GPU's capacity less what the estimator puts outside the
allocator (CUDA context, NCCL buffers: the stub has neither). The first
must finish, the second must raise ``torch.OutOfMemoryError``.

The GPU is a catalog GPU whose memory is given with ``gpu_memory`` (small,
so that the stub runs take seconds; the rest of the GPU's properties, which
decide kernels and workspaces, are the catalog's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from benchmarks.groundtruth.stub_distributed import StubConfig, measure

__all__ = ["CONFIGS", "MaxConfig", "check", "main"]

GPU = "h100-sxm"
# Llama-3.2-1B's catalog config cut to 2 layers of hidden 256 with an 8192-token vocabulary: the logits
# (seq x vocab per row) grow with the batch and the length, the model stays small for the stub.
SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192}


@dataclass(frozen=True, kw_only=True)
class MaxConfig:
    """One search and its check on the stub.

    Attributes:
        id: Stable name.
        what: ``batch_size`` or ``seq_len``.
        method: Estimator preset; ``worker`` its :mod:`.stub_worker` method.
        world: World size (the stub runs rank 0).
        workload: ``Workload`` fields (the searched one is the start).
        gpu_memory: The GPU's capacity for both sides.
        seq_lens: Sample lengths (variable-length batches), one GPU only.
        steps: Optimizer steps (the estimate replays as many with ``seq_lens``).
        multiple_of: Values searched.
    """

    id: str
    what: str
    method: str = "single"
    worker: str = "single"
    world: int = 1
    workload: dict[str, Any] = field(default_factory=dict)
    gpu_memory: str = "2GiB"
    seq_lens: str | None = None
    steps: int = 2
    multiple_of: int = 1
    overrides: dict[str, Any] = field(default_factory=lambda: dict(SMALL))


_BASE = {"seq_len": 256, "micro_batch_size": 1, "precision": "bf16-mixed"}
CONFIGS: list[MaxConfig] = [
    MaxConfig(id="full-batch", what="batch_size", workload=dict(_BASE)),
    MaxConfig(id="lora-batch", what="batch_size", workload={**_BASE, "lora": {"rank": 8}}),
    MaxConfig(id="gc-batch", what="batch_size", workload={**_BASE, "grad_checkpointing": True,
                                                          "precision": "bf16"}),
    MaxConfig(id="fsdp-batch", what="batch_size", method="fsdp", worker="fsdp", world=2, workload=dict(_BASE)),
    MaxConfig(id="varlen-batch", what="batch_size", workload={**_BASE, "seq_len": 512, "attn_implementation": "eager"},
              seq_lens="16:512:120", steps=4),
    MaxConfig(id="eager-seq", what="seq_len", workload={**_BASE, "micro_batch_size": 4,
                                                        "attn_implementation": "eager"}, multiple_of=16),
    MaxConfig(id="lora-seq", what="seq_len", workload={**_BASE, "micro_batch_size": 8, "lora": {"rank": 8}},
              multiple_of=16),
]


def search(config: MaxConfig) -> Any:
    """The :class:`~llmem_plugin.planner.largest.MaxResult` of ``config``, cuDNN attention off as on the stub."""
    import torch

    from benchmarks.groundtruth.matrix import case_config
    from llmem_plugin.methods import Layout
    from llmem_plugin.planner import largest
    from llmem_plugin.workload import Workload

    fn = largest.max_batch_size if config.what == "batch_size" else largest.max_seq_len
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return fn(case_config("llama-3.2-1b", config.overrides), Workload(**config.workload), gpu=GPU,
                  gpu_memory=config.gpu_memory, headroom=0.0,
                  method=config.method, layout=Layout(num_gpus=config.world), lengths=config.seq_lens,
                  steps=config.steps if config.seq_lens else None, multiple_of=config.multiple_of,
                  **({"limit": 4096} if config.what == "seq_len" else {}))
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def check(config: MaxConfig) -> dict[str, Any]:
    """Search, then run the answer and the next value up on the stub; the row."""
    t0 = time.perf_counter()
    result = search(config)
    answer = result.answer
    room = _allocator_room(result, answer)
    field_ = "micro_batch_size" if config.what == "batch_size" else "seq_len"
    stub = StubConfig(id=config.id, method=config.method, worker=config.worker, world=config.world, ranks=(0,),
                      overrides=config.overrides, workload=dict(config.workload))
    extra = {"steps": config.steps, **({"seq_lens": config.seq_lens} if config.seq_lens else {})}

    def run(value: int) -> dict[str, Any]:
        spec = StubConfig(**{**stub.__dict__, "workload": {**stub.workload, field_: value}})
        return measure(spec, 0, gpu=GPU, capacity=room, extra=extra)

    if result.next_value is None:
        raise RuntimeError(f"{config.id}: the search stopped at its limit ({result.capped_by}); no value above "
                           "the answer to run")
    with ThreadPoolExecutor(2) as pool:
        at, above = pool.map(run, [result.value, result.next_value])
    return {"id": config.id, "what": config.what, "method": config.method, "world": config.world,
            "workload": config.workload, "seq_lens": config.seq_lens, "gpu": GPU, "gpu_memory": config.gpu_memory,
            "stub_capacity_bytes": room, "value": result.value, "next_value": result.next_value,
            "estimates": len(result.points), "search_seconds": round(result.seconds, 2),
            "predicted_allocated_bytes": answer.peak_allocated_bytes,
            "predicted_reserved_bytes": answer.peak_reserved_bytes,
            "at_value": _outcome(at), "at_next": _outcome(above), "seconds": round(time.perf_counter() - t0, 1)}


def _allocator_room(result: Any, answer: Any) -> int:
    """What the estimate leaves PyTorch's allocator: the limit less what it puts outside the allocator."""
    return result.limit_bytes - (answer.device_total_bytes - answer.peak_reserved_bytes)


def _outcome(out: dict[str, Any]) -> dict[str, Any]:
    if "error" in out:
        oom = "OutOfMemoryError" in out["error"] or "out of memory" in out["error"]
        return {"status": "oom" if oom else "error", "error": out["error"][:300]}
    last = out["steps"][-1]
    return {"status": "ok", "allocated_bytes": last["allocated_bytes"], "reserved_bytes": last["reserved_bytes"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSONL file to append rows to")
    p.add_argument("--only", nargs="*", help="config ids (default: all)")
    args = p.parse_args(argv)
    bad = 0
    for config in [c for c in CONFIGS if not args.only or c.id in args.only]:
        row = check(config)
        ok = row["at_value"]["status"] == "ok" and row["at_next"]["status"] == "oom"
        bad += not ok
        print(f"{row['id']}: {config.what} {row['value']} {row['at_value']['status']}, {row['next_value']} "
              f"{row['at_next']['status']} ({row['estimates']} estimates, {row['seconds']} s)", file=sys.stderr)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
