"""Issue 45: why the H200 rows (torch 2.11) reserve other amounts than the stub (torch 2.13) and the estimate.

Diagnostic, not a measurement; results in benchmarks/results/version-diff-h200-2026-12-06.md.
It works on copies of this checkout with their own stub build (this checkout's
``.stubvenv`` and ``stubcuda/build`` are never touched):

    # a copy at DIR with torch 2.11.0+cu130 / transformers 5.17.0 / peft 0.21.0 (as on the H200)
    python -m benchmarks.groundtruth.version_diff prepare --dir /tmp/vd211 \\
        --torch 2.11.0 --transformers 5.17.0 --peft 0.21.0
    # a copy using this checkout's stub venv (torch 2.13) read-only
    python -m benchmarks.groundtruth.version_diff prepare --dir /tmp/vd213 --venv .stubvenv
    # per-step peaks of harness rows on DIR's stub, for each address order
    python -m benchmarks.groundtruth.version_diff rows --dir /tmp/vd211 CASE...
    # from DIR: its stub's whole malloc/free stream, replayed through llmem_plugin's allocator with
    # segments at ascending and at descending addresses, and where the two part
    cd /tmp/vd211 && python -m benchmarks.groundtruth.version_diff replay CASE...
    cd /tmp/vd211 && python -m benchmarks.groundtruth.version_diff explain CASE [--size BYTES]
    # the driver's address order and the allocator's tie-break, on a GPU or (VD_ADDR=..., stubcuda/run) a stub
    python -m benchmarks.groundtruth.version_diff tie

``prepare`` copies the working tree to DIR and adds one switch to the copy's
``stubcuda/src/cudart.c``: ``VD_ADDR=down`` makes ``cudaMalloc`` hand out
addresses from the top of its arena downwards (each new segment lies *below*
every earlier one), ``VD_ADDR=split`` does that for calls above 2 MiB only;
unset or ``up`` is the stub's own order (each new segment above the earlier
ones). Then it builds DIR's venv (torch's CUDA build from PyPI, ``--no-deps``,
as ``stubcuda/setup.sh``) and the stand-in libraries.

Why the order matters: up to torch 2.11 the caching allocator keeps free
blocks ordered by (stream, size, address) (``BlockComparatorSize``), so of
two free blocks of the same size the one at the lower address is taken. Later
torch (2.13 here) orders by (stream, size, cudaMalloc counter, address)
(pytorch#183591), which on every device behaves as the stub's ascending
addresses do under 2.11.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_MODULE = "benchmarks.groundtruth.version_diff"

_OLD = """    size_t start = (g_arena_top + align - 1) & ~(align - 1);
    if (start + bytes <= ARENA_BYTES) {
        p = g_arena + start;
        g_arena_top = start + bytes;
    }"""
_NEW = """    /* version_diff: VD_ADDR=down hands out addresses from the top of the arena
     * downwards (each new segment below the earlier ones); VD_ADDR=split does so
     * for cudaMalloc calls above 2 MiB only, 2 MiB (small-pool) ones still go up. */
    static int mode = -1;
    static size_t down_used;
    if (mode < 0) { const char *m = getenv("VD_ADDR"); mode = (m && m[0] == 'd') ? 1 : (m && m[0] == 's') ? 2 : 0; }
    if (mode == 1 || (mode == 2 && bytes > ((size_t)2 << 20))) {
        size_t start = (ARENA_BYTES - down_used - bytes) & ~(align - 1);
        if (start > g_arena_top + ARENA_BYTES / 2) { p = g_arena + start; down_used = ARENA_BYTES - start; }
    } else {
    size_t start = (g_arena_top + align - 1) & ~(align - 1);
    if (start + bytes <= ARENA_BYTES) {
        p = g_arena + start;
        g_arena_top = start + bytes;
    }
    }"""


def _pip(py: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--index-url", "https://pypi.org/simple", *args], check=True, env=env)


def prepare(d: Path, torch: str, transformers: str | None, peft: str | None, venv: str | None) -> None:
    """Copy the working tree to ``d``, patch the stub's address order, build venv and stand-ins."""
    ignore = shutil.ignore_patterns(".git", ".stubvenv", ".frameworks", ".hypothesis", ".pytest_cache", "build",
                                    "__pycache__", "wheels")
    shutil.copytree(_ROOT, d, ignore=ignore, dirs_exist_ok=True)
    src = d / "stubcuda" / "src" / "cudart.c"
    text = src.read_text()
    if _NEW not in text:
        assert _OLD in text, "stubcuda/src/cudart.c changed: update version_diff._OLD"
        src.write_text(text.replace(_OLD, _NEW))
    link = d / ".stubvenv"
    if venv:  # an existing stub venv, used read-only
        if not link.exists():
            link.symlink_to((_ROOT / venv).resolve())
    else:
        if not (link / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(link)], check=True)
        py = str(link / "bin" / "python")
        _pip(py, "--no-deps", f"torch=={torch}")
        _pip(py, "typing_extensions", "filelock", "sympy", "networkx", "jinja2", "fsspec", "numpy", "rich",
             "psutil", "pyyaml")
        _pip(py, f"transformers=={transformers}" if transformers else "transformers")
        _pip(py, "--no-deps", f"peft=={peft}" if peft else "peft", "accelerate", "safetensors",
             "bitsandbytes==0.50.2")
        _pip(py, "--no-deps", "-e", str(d))
    py = str(link / "bin" / "python")
    subprocess.run([py, "stubcuda/build.py", "--python", py], cwd=d, check=True)


def rows(d: Path, cases: list[str], orders: list[str], gpu: str = "h200") -> list[dict]:
    """Run ``cases`` with DIR's harness on its stub, once per address order; print the per-step peaks."""
    out = []
    for order in orders:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.jsonl")
            subprocess.run([sys.executable, "-m", "benchmarks.groundtruth.run", "--device", "stub", "--out", path,
                            "--stub-gpu", gpu, "--only", *cases], cwd=d, env={**os.environ, "VD_ADDR": order}, check=False)
            for line in open(path, encoding="utf-8"):
                r = json.loads(line)
                r["vd_addr"] = order
                out.append(r)
                print(order, r["env"]["torch"], r["env"]["transformers"], r["env"]["peft"], r["id"],
                      [(s["allocated_bytes"], s["reserved_bytes"]) for s in r["steps"]], flush=True)
    return out


# ---- explain: the whole allocation stream of one stub run, replayed in both address orders ------------

def _frames(e: dict) -> list[str]:
    keep = []
    for f in e.get("frames", []):
        fn = f["filename"]
        if fn.startswith("??") or "groundtruth/stub.py" in fn or "version_diff" in fn:
            continue
        if "torch/" in fn and not any(k in fn for k in ("torch/optim", "torch/nn", "torch/autograd")):
            continue
        keep.append(f"{fn.split('site-packages/')[-1]}:{f['line']} {f['name'][:60]}")
    return keep[:4]


def _worker(case_id: str, steps: int, out: str) -> None:
    """In the stub process: run the case with the allocator history on from the start (model build included)."""
    import torch

    from benchmarks.groundtruth import cuda, stub
    from benchmarks.groundtruth.run import select_cases

    (case,) = select_cases("stub", [case_id])
    reset, record = cuda._Recorder.reset, cuda._Recorder.record
    marks: dict[str, Any] = {"steps": []}

    def trace_len() -> int:
        return len(torch.cuda.memory._snapshot()["device_traces"][0])

    def reset_and_mark(self) -> None:
        reset(self)
        marks["reset"] = trace_len()

    def record_and_mark(self, step: int) -> None:
        record(self, step)
        marks["steps"].append(trace_len())

    cuda._Recorder.reset, cuda._Recorder.record = reset_and_mark, record_and_mark
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=4_000_000)
    info: dict[str, Any] = {}
    with stub.stub_settings(info):
        row = cuda.run_case(case, steps=steps, stub=info)
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    keep = ("alloc", "free_completed")
    idx = [i for i, e in enumerate(trace) if e["action"] in keep]
    events = [[trace[i]["action"], int(trace[i]["addr"]), int(trace[i]["size"]), _frames(trace[i])] for i in idx]

    def position(n: int) -> int:  # trace index -> index in ``events``
        return sum(1 for i in idx if i < n)

    with open(out, "w", encoding="utf-8") as f:
        json.dump({"steps": row["steps"], "torch": torch.__version__, "events": events,
                   "reset_at": position(marks["reset"]), "step_ends": [position(n) for n in marks["steps"]]}, f)
    sys.stdout.flush()
    os._exit(0)


def _descending():
    """llmem_plugin's CachingAllocator with each new cudaMalloc segment placed below every earlier one."""
    from llmem_plugin.device import allocator as A

    class Descending(A.CachingAllocator):
        _top = 1 << 60

        def _alloc_block(self, pool, size, alloc_size, *, retry=False):
            if self.config.expandable_segments:
                return super()._alloc_block(pool, size, alloc_size, retry=retry)
            saved, self._next_base = self._next_base, self._top - alloc_size - A._SEGMENT_GAP
            block = super()._alloc_block(pool, size, alloc_size, retry=retry)
            if block is not None:
                self._top = block.segment.base
            self._next_base = saved
            return block

    return A.CachingAllocator, Descending


def _replay(data: dict, cls, stop: int | None = None):
    """Feed ``data``'s stream to ``cls``; per malloc: (event, size, segment creation number, offset, new segment)."""
    alloc, handles, seg_no, log = cls(None), {}, {}, []
    peaks, peak = [], [0, 0]
    ends = data["step_ends"]
    for i, (action, addr, size, _) in enumerate(data["events"][:stop]):
        if i == data["reset_at"]:
            alloc.empty_cache()
            peak = [alloc.stats.allocated, alloc.stats.reserved]
        if action == "alloc":
            before = len(alloc.stats.segments)
            h = handles[addr] = alloc.malloc(size)
            base = alloc._live[h].segment.base
            seg_no.setdefault(base, len(seg_no))
            log.append((i, size, seg_no[base], h - base, len(alloc.stats.segments) > before))
        else:
            alloc.free(handles.pop(addr))
        if i >= data["reset_at"]:
            peak = [max(peak[0], alloc.stats.allocated), max(peak[1], alloc.stats.reserved)]
        if i + 1 in ends:
            peaks.append(tuple(peak))
    return alloc, log, peaks


def _record(case_id: str, steps: int) -> dict:
    """Run ``_worker`` on this checkout's stub (run from DIR: its ``stubcuda`` and venv) and load its stream."""
    from stubcuda import runner

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        proc = runner.run_python(["-m", _MODULE, "--worker", case_id, "--steps", str(steps), "--out", out],
                                 env={"PYTHONPATH": str(runner.ROOT)}, timeout_s=900)
        if not os.path.exists(out):
            raise RuntimeError(f"stub worker failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def replay(case_id: str, steps: int, *, verbose: bool = False) -> tuple[dict, list, list]:
    """The stub's per-step peaks and the same stream replayed through llmem_plugin's allocator in both orders."""
    data = _record(case_id, steps)
    asc_cls, desc_cls = _descending()
    _, up, peaks_up = _replay(data, asc_cls)
    _, dn, peaks_dn = _replay(data, desc_cls)
    print(f"{case_id}: torch {data['torch']}")
    print(f"  stub, per step (allocated, reserved):      {[(s['allocated_bytes'], s['reserved_bytes']) for s in data['steps']]}")
    print(f"  replay, new segments at ascending bases:  {peaks_up}")
    print(f"  replay, new segments at descending bases: {peaks_dn}", flush=True)
    return data, up, dn


def explain(case_id: str, steps: int, size: int | None) -> None:
    """Record one stub run of ``case_id`` (run from DIR), replay it ascending and descending, show where they part."""
    data, up, dn = replay(case_id, steps)
    asc_cls, desc_cls = _descending()
    events, ends = data["events"], data["step_ends"]

    def where(i: int) -> str:
        step = 1 + sum(1 for e in ends if i >= e)
        fr = events[i][3][:1]
        if not fr:  # the autograd engine's thread has no Python frames: the nearest ones before
            fr = next((["(autograd thread; last Python frame " + events[j][3][0] + ")"] for j in range(i - 1, 0, -1)
                       if events[j][3]), [""])
        return f"step {step}: {fr[0]}"

    k = next((j for j, (x, y) in enumerate(zip(up, dn)) if x[4] != y[4]), None)
    if k is None:
        print("both orders call cudaMalloc alike")
        return
    print(f"first cudaMalloc in one order only: malloc #{k}, {up[k][1]} B, ascending new segment {up[k][4]}, "
          f"descending {dn[k][4]}; {where(up[k][0])}")
    for name, cls in (("ascending", asc_cls), ("descending", desc_cls)):
        alloc, _, _ = _replay(data, cls, stop=up[k][0])
        heads: dict[int, int] = {}
        for b in list(alloc.large.blocks.values()) + list(alloc._live.values()):
            heads[b.segment.base] = heads.get(b.segment.base, 0) + b.size
        free = sorted(((b.size, heads[b.segment.base], b.addr - b.segment.base) for b in alloc.large.blocks.values()),
                      reverse=True)
        print(f"  {name}: free large blocks >= 64 MiB before it (MiB, in a segment of MiB, at offset MiB): "
              f"{[(s >> 20, n >> 20, o >> 20) for s, n, o in free if s >= 64 << 20]}")
    size = size or max(x[1] for x in up)
    print(f"every {size} B malloc: segment creation number (ascending | descending)")
    for (i, sz, sa, oa, na), (_, _, sd, od, nd) in zip(up, dn):
        if sz == size and i >= data["reset_at"]:
            print(f"  {where(i)}: seg {sa}{' NEW' if na else ''} | seg {sd}{' NEW' if nd else ''}"
                  f"{'' if (sa, oa) == (sd, od) else '   <- differs'}")


def tie() -> None:
    """On the current CUDA device (a GPU, or a stub under stubcuda/run): the driver's address order and
    which of two equal free blocks the caching allocator hands out again."""
    import torch

    n = 30 << 20  # large pool, one 30 MiB segment each
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty(n, dtype=torch.uint8, device="cuda")
    pa, pb = a.data_ptr(), b.data_ptr()
    del a, b
    c = torch.empty(n, dtype=torch.uint8, device="cuda")
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
                      "second_segment_below_first": pb < pa,
                      "reuse_takes": "first-allocated" if c.data_ptr() == pa else "second-allocated",
                      "reuse_takes_lower_address": c.data_ptr() == min(pa, pb)}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("cmd", nargs="?", choices=["prepare", "rows", "replay", "explain", "tie"])
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--torch", default="2.11.0")
    ap.add_argument("--transformers")
    ap.add_argument("--peft")
    ap.add_argument("--venv", help="use this existing stub venv (relative to the repo root) instead of building one")
    ap.add_argument("--size", type=int, help="explain: list every malloc of this size (default: the largest)")
    ap.add_argument("--gpu", default="h200", help="rows: the catalog GPU the stub reports (default h200)")
    ap.add_argument("--orders", nargs="+", default=["up", "down", "split"])
    a = ap.parse_intermixed_args(argv)
    if a.worker:
        _worker(a.worker, a.steps, a.out)
    if a.cmd == "prepare":
        prepare(a.dir, a.torch, a.transformers, a.peft, a.venv)
    elif a.cmd == "rows":
        rows(a.dir, a.cases, a.orders, a.gpu)
    elif a.cmd == "explain":
        explain(a.cases[0], a.steps, a.size)
    elif a.cmd == "replay":
        for case in a.cases:
            replay(case, a.steps)
    elif a.cmd == "tie":
        tie()
    else:
        ap.error("give prepare, rows, replay, explain or tie")
    return 0


if __name__ == "__main__":
    sys.exit(main())
