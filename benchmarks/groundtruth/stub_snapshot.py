"""Predicted snapshots against the stub device's real ones, entry by entry.

    python -m benchmarks.groundtruth.stub_snapshot [--out benchmarks/results/snapshot-stub-DATE.jsonl]

Runs each case of :data:`CASES` on the stub device with the allocator's history recorded from the peak
reset on (``LLMEM_STUB_SNAPSHOT_DIR``, benchmarks/groundtruth/cuda.py), makes the predicted snapshot of
the same step from the same point (``snapshot_of(..., after_load=True)``) and records, per case: the peaks
read back from each history, the end states, how many entries each holds, and how far the two streams of
``(action, size, stream)`` agree: identical, identical but for the order within runs of frees, and
(``difflib.SequenceMatcher``) the entries in equal runs and the differing stretches.
A markdown table goes next to the JSONL.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

CASES = (
    "tiny-llama-3.2-1b-bf16-mixed-s64-b2-sdpa",
    "tiny-gpt2-bf16-mixed-s64-b2-lora-eager",
    "tiny4-llama-3.2-1b-bf16-s256-b4-lora-sdpa-nf4-kbit-off",
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b4-gc-every2-sdpa",
    "tiny4-llama-3.2-1b-bf16-mixed-s256-b2-sdpa",
    "tiny4-llama-3.2-1b-bf16-s256-b4-gc-reentrant-lora-sdpa",
)


def free_runs_as_sets(entries: list) -> list:
    """``entries`` with each run of consecutive (free_requested, free_completed) pairs in one order: where
    an autocast region exits, torch frees its cached casts in the order of a C++ hash map keyed by host
    pointers (autocast_mode.cpp ``cached_casts``), which no trace can know."""
    out, i = [], 0
    while i < len(entries):
        j = i
        while j + 1 < len(entries) and entries[j][0] == "free_requested" and entries[j + 1][0] == "free_completed":
            j += 2
        if j > i:
            out += sorted(entries[i:j][k:k + 2] for k in range(0, j - i, 2))
            i = j
        else:
            out.append(entries[i])
            i += 1
    return out


def segments_in_use(snap) -> list:
    """Each segment's pool and size, and the blocks in use (pool, size, state), as sorted lists."""
    return [sorted((s["segment_type"], s["total_size"]) for s in snap["segments"]),
            sorted((s["segment_type"], b["size"], b["state"]) for s in snap["segments"] for b in s["blocks"]
                   if b["state"] != "inactive")]


def _end_state(snap) -> dict[str, int]:
    return {"reserved_bytes": sum(s["total_size"] for s in snap["segments"]),
            "allocated_bytes": sum(b["size"] for s in snap["segments"] for b in s["blocks"]
                                   if b["state"] == "active_allocated"),
            "segments": len(snap["segments"])}


def compare_case(row: dict, real: dict) -> dict:
    """The record of one case: its predicted snapshot against the stub's."""
    from llmem_plugin.snapshot.history import read_history
    from llmem_plugin.snapshot.predict import snapshot_of
    from llmem_plugin.verify.validate import estimate_row

    pred = snapshot_of(estimate_row(row, keep_trace=True), after_load=True)
    hp, hr = read_history(pred), read_history(real)
    a = [(e["action"], e["size"], e["stream"]) for e in pred["device_traces"][0] if e["action"] != "snapshot"]
    b = [(e["action"], e["size"], e["stream"]) for e in real["device_traces"][0] if e["action"] != "snapshot"]
    ops = difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes()
    return {
        "id": row["id"], "measured": row["measured"],
        "predicted": {"peak_allocated_bytes": hp.peak_allocated_bytes, "peak_reserved_bytes": hp.peak_reserved_bytes,
                      "end": _end_state(pred), "entries": len(a)},
        "real": {"peak_allocated_bytes": hr.peak_allocated_bytes, "peak_reserved_bytes": hr.peak_reserved_bytes,
                 "end": _end_state(real), "entries": len(b)},
        "entries_in_equal_runs": sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "equal"),
        "differing_stretches": sum(1 for tag, *_ in ops if tag != "equal"),
        "identical": a == b,
        "identical_up_to_free_runs": free_runs_as_sets(a) == free_runs_as_sets(b),
        "segments_and_blocks_in_use_equal": segments_in_use(pred) == segments_in_use(real),
    }


def _verdict(record: dict) -> str:
    if record["identical"]:
        return "identical"
    return "identical but the order within runs of frees" if record["identical_up_to_free_runs"] else "no"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=f"benchmarks/results/snapshot-stub-{time.strftime('%Y-%m-%d')}.jsonl")
    args = p.parse_args(argv)
    from benchmarks.groundtruth import run
    from llmem_plugin.snapshot.history import load_snapshot

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LLMEM_STUB_SNAPSHOT_DIR"] = tmp
        rows_path = Path(tmp) / "rows.jsonl"
        if run.main(["--device", "stub", "--out", str(rows_path), "--steps", "2", "--only", *CASES]) != 0:
            return 1
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
        records = [compare_case(r, load_snapshot(Path(tmp) / f"{r['id']}.pickle")) for r in rows]
    out = Path(args.out)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ["| case | peak allocated (pred = real = measured) | peak reserved | end-state segments and blocks in use "
             "| entries pred / real | event for event | in equal runs | differing stretches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        pa, ra, m = r["predicted"], r["real"], r["measured"]
        same_a = pa["peak_allocated_bytes"] == ra["peak_allocated_bytes"] == m["allocated_bytes"]
        same_r = pa["peak_reserved_bytes"] == ra["peak_reserved_bytes"] == m["reserved_bytes"]
        lines.append(f"| {r['id']} | {pa['peak_allocated_bytes']:,} B {'(equal)' if same_a else '(DIFFERS)'} | "
                     f"{pa['peak_reserved_bytes']:,} B {'(equal)' if same_r else '(DIFFERS)'} | "
                     f"{'equal' if r['segments_and_blocks_in_use_equal'] else 'DIFFER'} | "
                     f"{pa['entries']:,} / {ra['entries']:,} | "
                     f"{_verdict(r)} | "
                     f"{r['entries_in_equal_runs'] / max(ra['entries'], 1):.1%} | {r['differing_stretches']} |")
    out.with_suffix(".table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
