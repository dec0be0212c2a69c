"""Where a stub row and its estimate part: the two allocation streams, aligned.

``python -m benchmarks.groundtruth.stub_diff CASE_ID [--context N]`` (main
environment) runs the case's CUDA worker on the stub device
(:mod:`benchmarks.groundtruth.stub`) with the caching allocator's history
recorded (``torch.cuda.memory._record_memory_history``, Python stacks) from
the moment the harness resets the peaks, and traces the same workload with
the estimator (:func:`llmem_plugin.estimate.allocator_events`, cuDNN SDPA off
as on the stub). Both streams become ``(+1 | -1, size rounded to 512 B)``
tokens; :class:`difflib.SequenceMatcher` aligns them and every differing
stretch is printed with the stub's Python frames and the estimator's phase.

This is a diagnostic, not a measurement: it found the causes listed in
``benchmarks/results/stub-wholestep-2026-11-25.md``.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["estimator_stream", "main", "stub_stream"]

_MODULE = "benchmarks.groundtruth.stub_diff"
_ROUND = 512  # kMinBlockSize: the allocator rounds every request up to 512 B (CUDACachingAllocator.cpp)


def _round(n: int) -> int:
    return max(_ROUND, -(-n // _ROUND) * _ROUND)


def _stub_side(case_id: str, steps: int, out: str) -> None:
    """In the stub process: run the case, recording the allocator's history after the peak reset."""
    import torch

    from benchmarks.groundtruth import cuda, stub
    from benchmarks.groundtruth.run import select_cases

    (case,) = select_cases("stub", [case_id])
    reset = cuda._Recorder.reset

    def reset_and_record(self) -> None:
        reset(self)
        torch.cuda.memory._record_memory_history(enabled="all", context="all",
                                                 stacks=os.environ.get("STUB_DIFF_STACKS", "python"),
                                                 max_entries=2_000_000)

    cuda._Recorder.reset = reset_and_record
    info: dict[str, Any] = {}
    with stub.stub_settings(info):
        row = cuda.run_case(case, steps=steps, stub=info)
    snap = torch.cuda.memory._snapshot()
    events = []
    for e in snap["device_traces"][0]:
        if e["action"] not in ("alloc", "free_completed"):
            continue
        frames = [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name'][:80]}" for f in e.get("frames", [])
                  if ("torch/" not in f["filename"] or "torch/optim" in f["filename"] or "torch/nn" in f["filename"]
                  or "torch/utils/checkpoint" in f["filename"]) and "groundtruth/stub.py" not in f["filename"]
                  and not f["filename"].startswith("??") and "c10/" not in f["filename"]
                  and "CUDACachingAllocator" not in f["filename"]]
        events.append((1 if e["action"] == "alloc" else -1, int(e["size"]), e["addr"], frames[:12]))
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"measured": row["measured"], "status": row["status"], "error": row["error"],
                   "events": events}, f)
    sys.stdout.flush()
    os._exit(0)


def _stub_side_whole(case_id: str, steps: int, out: str) -> None:
    """In the stub process: record every allocator event of the case, model build included."""
    import torch

    from benchmarks.groundtruth import cuda, stub
    from benchmarks.groundtruth.run import select_cases

    (case,) = select_cases("stub", [case_id])
    reset = cuda._Recorder.reset
    marks: dict[str, int] = {}

    def reset_and_mark(self) -> None:
        reset(self)
        marks["reset"] = len(torch.cuda.memory._snapshot()["device_traces"][0])

    cuda._Recorder.reset = reset_and_mark
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)
    info: dict[str, Any] = {}
    with stub.stub_settings(info):
        row = cuda.run_case(case, steps=steps, stub=info)
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    events = [(e["action"], int(e["addr"]), int(e["size"])) for e in trace
              if e["action"] in ("alloc", "free_completed", "segment_free", "segment_alloc")]
    reset_at = sum(1 for e in trace[:marks["reset"]] if e["action"] in ("alloc", "free_completed", "segment_free",
                                                                      "segment_alloc"))
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"measured": row["measured"], "status": row["status"], "events": events, "reset_at": reset_at,
                   "num_trace": len(trace)}, f)
    sys.stdout.flush()
    os._exit(0)


def replay_stub(case_id: str, *, steps: int = 2) -> dict[str, Any]:
    """Replay the stub's own allocation stream through :mod:`llmem_plugin.device.allocator`.

    The stub process records every malloc and free of the case (model build,
    ``empty_cache`` at the peak reset, the steps); the simulated allocator
    gets the same requests in the same order, ``empty_cache`` where the
    harness called it, and its peaks after that point are compared with the
    stub's ``max_memory_allocated`` / ``max_memory_reserved``. Equal peaks
    mean the allocator simulation is right for this stream, and any
    difference between the stub and the estimate lies in the event stream.
    """
    from llmem_plugin.device.allocator import CachingAllocator

    data = _stub_events("--stub-whole", case_id, steps)
    alloc = CachingAllocator(None)
    handles: dict[int, int] = {}
    peak_alloc = peak_res = 0
    for i, (action, addr, size) in enumerate(data["events"]):
        if i == data["reset_at"]:
            alloc.empty_cache()
            peak_alloc, peak_res = alloc.stats.allocated, alloc.stats.reserved
        if action == "alloc":
            handles[addr] = alloc.malloc(size)
        elif action == "free_completed":
            alloc.free(handles.pop(addr))
        if i >= data["reset_at"]:
            peak_alloc = max(peak_alloc, alloc.stats.allocated)
            peak_res = max(peak_res, alloc.stats.reserved)
    return {"stub": data["measured"], "replayed": {"allocated_bytes": peak_alloc, "reserved_bytes": peak_res},
            "num_events": len(data["events"]), "num_trace": data["num_trace"]}


def stub_stream(case_id: str, *, steps: int = 2) -> dict[str, Any]:
    """The stub's allocation events after the peak reset: ``(sign, block bytes, addr, frames)``."""
    return _stub_events("--stub-side", case_id, steps)


def _stub_events(flag: str, case_id: str, steps: int) -> dict[str, Any]:
    """Run this module's stub side (``flag``) for ``case_id`` and load what it wrote."""
    from stubcuda import runner

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "events.json")
        proc = runner.run_python(["-m", _MODULE, flag, case_id, "--steps", str(steps), "--out", out],
                                 timeout_s=900)
        if not os.path.exists(out):
            raise RuntimeError(f"stub side failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def estimator_stream(case_id: str) -> tuple[list[tuple[int, int, int]], list[str], Any]:
    """The estimator's allocator events for the case, with their phases, and the estimate's overheads."""
    import torch

    from benchmarks.groundtruth.run import select_cases
    from llmem_plugin.models import modelbuild
    from llmem_plugin.estimate import _trace, allocator_events, uses_cublaslt
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.device.overheads import device_overheads

    (case,) = select_cases("stub", [case_id])
    torch.backends.cuda.enable_cudnn_sdp(False)
    gpu = get_gpu("h100-sxm")
    model = modelbuild.build_model(case.config(), case.workload, device="meta")
    overheads = device_overheads(gpu.compute_capability, torch_version="2.13.0", uses_cublaslt=uses_cublaslt(model))
    from torch.utils._python_dispatch import TorchDispatchMode

    from llmem_plugin.trace.tracker import MemoryTracker

    tracker = MemoryTracker()
    op_at: list[tuple[int, str]] = []  # (tracker event count after the op, op name)

    class _OpLog(TorchDispatchMode):  # on top of the tracker: names the op behind each event
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            op_at.append((len(tracker._events), str(func)))
            return out

    trace = _trace(model, case.workload, gpu, tracker=tracker, contexts=(_OpLog(),))
    events, phases = allocator_events(trace, overheads)
    # The op that made each tracker event: the first op that ended after it.
    import bisect

    ends = [n for n, _ in op_at]
    names_by_tracker = [op_at[bisect.bisect_right(ends, i)][1] if bisect.bisect_right(ends, i) < len(op_at) else "?"
                        for i in range(len(tracker._events))]
    ops = [names_by_tracker[i] for i, _, _ in trace.timeline]
    estimator_stream.ops = ops  # aligned with trace.events (before the workspaces are inserted)
    return events, phases, overheads


def _tokens_stub(events: list) -> list[tuple[int, int]]:
    return [(s, _round(n)) for s, n, _, _ in events]


def _nearest(offset: dict[int, int], i: int) -> int:
    """The alignment's index offset (estimator - stub) at stub index ``i``."""
    keys = [k for k in offset if k <= i]
    return offset[max(keys)] if keys else 0


def _tokens_est(events: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(s, _round(n)) for s, _, n in events]


def _fmt(tok: tuple[int, int]) -> str:
    return f"{'+' if tok[0] > 0 else '-'}{tok[1]:,}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument("case", help="a stub case id (python -m benchmarks.groundtruth.run --list)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--context", type=int, default=3, help="tokens of context around a difference")
    p.add_argument("--max-diffs", type=int, default=20)
    p.add_argument("--counts", action="store_true", help="compare how often each (sign, size) occurs, no alignment")
    p.add_argument("--largest", action="store_true", help="list the largest differences first")
    p.add_argument("--window", type=int, default=64, help="events apart that still count as a reordering")
    p.add_argument("--replay", action="store_true",
                   help="replay the stub's own allocation stream through the simulated allocator instead")
    p.add_argument("--stub-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stub-whole", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stub_side:
        _stub_side(args.case, args.steps, args.out)
        return 0
    if args.stub_whole:
        _stub_side_whole(args.case, args.steps, args.out)
        return 0
    if args.replay:
        print(json.dumps(replay_stub(args.case, steps=args.steps)))
        return 0
    stub = stub_stream(args.case, steps=args.steps)
    est, phases, _ = estimator_stream(args.case)
    # The estimator's stream starts with the weights (and runs NUM_ITERATIONS
    # steps); the stub's starts after the reset, with the weights already
    # resident. Align the estimator's tail against the stub's.
    # The stub records from the peak reset on, with the weights resident:
    # the estimator's setup events (weights, optimizer construction) are not in it.
    first = next((j for j, ph in enumerate(phases) if ph != "setup"), 0)
    est, phases = est[first:], phases[first:]
    a, b = _tokens_stub(stub["events"]), _tokens_est(est)
    print(f"stub: {len(a)} events ({stub['status']}, {stub['measured']}); estimator: {len(b)} events")
    if args.counts:
        # No alignment: which (sign, size) tokens one stream has more of, largest total first.
        ca, cb = collections.Counter(a), collections.Counter(b)
        for title, more, other, src in (("stub has more", ca - cb, cb, "stub"), ("estimator has more", cb - ca, ca,
                                                                                  "est")):
            print(title + ":")
            for tok, n in sorted(more.items(), key=lambda kv: -kv[0][1] * kv[1])[:args.max_diffs]:
                where = ""
                if src == "stub":
                    k = a.index(tok)
                    frames = next((stub["events"][j][3] for j in range(k, max(-1, k - 50), -1)
                                   if stub["events"][j][3]), [])
                    where = " first at stub[%d]: %s" % (k, " <- ".join(frames[:3]))
                else:
                    k = b.index(tok)
                    where = " first at estimator[%d] (phase %s): %s" % (
                        k, phases[k], " ".join(_fmt(t) for t in b[max(0, k - 4):k + 5]))
                print(f"  {_fmt(tok)} x{n} (other has {other[tok]}){where}")
        return 0
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    # Tokens in one stream only; a token both streams have a few events
    # apart is a reordering (e.g. autocast's weight copy before or after
    # the matmul output), listed apart from true differences.
    only_a: list[int] = []
    only_b: list[int] = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            only_a += range(i1, i2)
            only_b += range(j1, j2)
    offset = {}
    for tag, i1, _, j1, _ in sm.get_opcodes():
        offset[i1] = j1 - i1
    unmatched_b = set(only_b)
    true_a = []
    num_reordered = 0
    for i in only_a:
        near = [j for j in unmatched_b if b[j] == a[i] and abs(j - i - _nearest(offset, i)) <= args.window]
        if near:
            unmatched_b.discard(min(near, key=lambda j: abs(j - i - _nearest(offset, i))))
            num_reordered += 1
        else:
            true_a.append(i)
    print(f"reordered within {args.window} events: {num_reordered}; stub only: {len(true_a)}; "
          f"estimator only: {len(unmatched_b)}")
    if args.largest:  # the largest differences first
        true_a.sort(key=lambda i: -a[i][1])
        unmatched_b = set(sorted(unmatched_b, key=lambda j: -b[j][1])[:args.max_diffs])
    for i in true_a[:args.max_diffs]:
        frames = next((stub["events"][k][3] for k in range(i, max(-1, i - 50), -1) if stub["events"][k][3]), [])
        ctx = " ".join(_fmt(t) for t in a[max(0, i - args.context):i + args.context + 1])
        print(f"  stub only      [{i}] {_fmt(a[i])}: context {ctx}; last frames:", " <- ".join(frames[:4]))
    for j in sorted(unmatched_b, key=(lambda j: -b[j][1]) if args.largest else None)[:args.max_diffs]:
        ctx = " ".join(_fmt(t) for t in b[max(0, j - args.context):j + args.context + 1])
        print(f"  estimator only [{j}] {_fmt(b[j])} (phase {phases[j]}): context {ctx}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
