"""Replay alloc/free streams through torch's real CUDA caching allocator.

Runs in the stub environment (``stubcuda/run -- python ...``); imports only
torch and the standard library. ``PYTORCH_CUDA_ALLOC_CONF`` and the device
capacity (``stubcuda/run --capacity``) are the process's own: they are fixed
once the allocator has initialised, so one process serves one setting and
every case of the input file runs under it.

    python stub_allocator_worker.py CASES.json

CASES.json: ``{"cases": [{"name": str, "events": [[+1|-1, key, nbytes], ...],
"memory_fraction": float | null}, ...]}``. Prints one JSON line:
``{"torch": version, "total_memory_bytes": int, "capacity_bytes": int,
"results": [{"name", "per_event": [[allocated, reserved], ...],
"peak_allocated", "peak_reserved", "oom_event"}, ...]}``. ``per_event``
holds the state after each event up to (not including) the first OOM, where
the case stops, as ``llmem_plugin.device.allocator.replay`` does.

Between cases every block is freed, the fraction reset to 1.0 (no limit),
the cache emptied and the peaks reset; the worker then checks that nothing is
allocated, reserved, or held from the device, and fails otherwise. What
survives a case is the pools' get_free_blocks_call_count, which only GC ages
are measured against, as differences; the GC cases of the matrix gave the
same results batched as one process per case.
"""

from __future__ import annotations

import json
import sys

import torch


def _stats() -> tuple[int, int]:
    # torch._C._cuda_memoryStats is what torch.cuda.memory_stats() flattens;
    # read directly it costs about 20 us instead of 300 us.
    s = torch._C._cuda_memoryStats(0)
    return s["allocated_bytes"]["all"]["current"], s["reserved_bytes"]["all"]["current"]


def _peaks() -> tuple[int, int]:
    s = torch._C._cuda_memoryStats(0)
    return s["allocated_bytes"]["all"]["peak"], s["reserved_bytes"]["all"]["peak"]


def _clean(live: dict[int, int], capacity: int) -> None:
    for ptr in live.values():
        torch.cuda.caching_allocator_delete(ptr)
    live.clear()
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = _stats()
    free, _ = torch.cuda.mem_get_info()
    if allocated or reserved or free != capacity:
        raise RuntimeError(f"allocator not clean between cases: allocated {allocated}, reserved {reserved}, "
                           f"device free {free} of {capacity}")


def run_case(case: dict, capacity: int) -> dict:
    live: dict[int, int] = {}
    _clean(live, capacity)
    if case.get("memory_fraction") is not None:
        torch.cuda.set_per_process_memory_fraction(case["memory_fraction"])
    per_event = []
    oom_event = -1
    for i, (sign, key, nbytes) in enumerate(case["events"]):
        if sign > 0:
            if nbytes > 0:  # a zero-byte tensor gets a null pointer, no block
                try:
                    live[key] = torch.cuda.caching_allocator_alloc(nbytes)
                except torch.OutOfMemoryError:
                    oom_event = i
                    break
        else:
            ptr = live.pop(key, None)
            if ptr is not None:
                torch.cuda.caching_allocator_delete(ptr)
        per_event.append(_stats())
    peak_allocated, peak_reserved = _peaks()
    _clean(live, capacity)
    return {"name": case["name"], "per_event": per_event, "peak_allocated": peak_allocated,
            "peak_reserved": peak_reserved, "oom_event": oom_event}


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)["cases"]
    torch.cuda.init()
    # With nothing held, free memory is what cudaMalloc may hand out: the
    # stub's --capacity (the device memory by default).
    capacity, total = torch.cuda.mem_get_info()
    results = [run_case(case, capacity) for case in cases]
    print(json.dumps({"torch": torch.__version__, "total_memory_bytes": total, "capacity_bytes": capacity,
                      "results": results}))


if __name__ == "__main__":
    main()
