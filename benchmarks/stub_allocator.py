"""Differential check of ``llmem_plugin.device.allocator`` against torch's real allocator.

Every case is one event stream under one setting. The real side replays it
through torch 2.13's CUDA caching allocator on the stub device
(``stub_allocator_worker.py`` in ``.stubvenv``, one process per
``PYTORCH_CUDA_ALLOC_CONF`` and capacity, many cases per process); the
simulated side through :func:`llmem_plugin.device.allocator.replay` with the same
``AllocatorConfig.from_env(conf)``, capacity, memory fraction and device
memory. A case is identical when the OOM event, both peaks and the
(allocated, reserved) bytes after every event agree.

    python benchmarks/stub_allocator.py [--out PATH] [--quick]

writes ``results/stub-allocator-<date>.json``. Streams: seeded random ones
(sizes from 1 B to 1 GiB, frees in random order) and the estimator's own
allocator streams (``estimate.allocator_events`` of a traced step).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmem_plugin.device.allocator import replay
from llmem_plugin.device.allocator_config import AllocatorConfig

__all__ = [
    "BIG_STREAM", "Case", "big_stream", "compare", "estimator_stream", "full_matrix", "random_stream", "run_cases",
]

_MiB = 1 << 20
_GiB = 1 << 30
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_allocator_worker.py")
GPU = "h100-sxm"
# What the stub reports as totalGlobalMem for h100-sxm: the catalog's
# driver_memory_bytes (llmem_plugin/device/gpus.json), read back by the worker.
DEVICE_MEMORY_BYTES = 85_520_809_984
# Cases per worker process. Each expandable segment reserves 1 1/8 of the
# device memory of address space that the stub never reuses (its arena is
# 16 TiB, stubcuda/src/cudart.c), so a process must not open too many.
_CASES_PER_PROCESS = 24

Event = tuple[int, int, int]


@dataclass(frozen=True, kw_only=True)
class Case:
    """One stream under one setting.

    Attributes:
        stream: Name of the event stream.
        conf: ``PYTORCH_CUDA_ALLOC_CONF``.
        capacity_bytes: What cudaMalloc may hand out (None: the device memory).
        memory_fraction: ``set_per_process_memory_fraction``, or None.
    """

    stream: str
    conf: str = ""
    capacity_bytes: int | None = None
    memory_fraction: float | None = None

    @property
    def name(self) -> str:
        cap = f"{self.capacity_bytes / _GiB:g}GiB" if self.capacity_bytes else "-"
        frac = "-" if self.memory_fraction is None else f"{self.memory_fraction:g}"
        return f"{self.stream} | conf={self.conf or 'default'} | capacity={cap} | fraction={frac}"


def random_stream(seed: int, num_events: int = 3000, *, live_target_bytes: int = 6 * _GiB) -> list[Event]:
    """A seeded stream: half small (< 1 MiB), a third 1-10 MiB, the rest
    10 MiB - 1 GiB, with odd sizes, repeats of earlier sizes and exact powers
    of two; live bytes hover around ``live_target_bytes``; frees pick a
    random live tensor. Every size is drawn log-uniformly within its band."""
    rng = random.Random(seed)
    live: dict[int, int] = {}
    live_bytes, key, seen = 0, 0, []
    out: list[Event] = []
    while len(out) < num_events:
        p_alloc = 0.85 if live_bytes < live_target_bytes else 0.3
        if live and rng.random() > p_alloc:
            k = rng.choice(list(live))
            live_bytes -= live.pop(k)
            out.append((-1, k, 0))
            continue
        band = rng.random()
        if seen and rng.random() < 0.2:
            n = rng.choice(seen)  # the same shape again, as layers repeat
        elif band < 0.5:
            n = int(2 ** rng.uniform(0, 20))
        elif band < 0.83:
            n = int(2 ** rng.uniform(20, 20 + 3.33))
        else:
            n = int(2 ** rng.uniform(23.33, 30))
        if rng.random() < 0.1:
            n = 1 << max(n.bit_length() - 1, 0)
        seen.append(n)
        live[key] = n
        live_bytes += n
        out.append((1, key, n))
        key += 1
    return out


BIG_STREAM = "random-big"


def big_stream() -> list[Event]:
    """A random stream whose live bytes reach 96 GiB, past the device memory:
    an OOM on the device, and under a larger capacity a second expandable
    segment."""
    return random_stream(101, 4000, live_target_bytes=110 * _GiB)


def estimator_stream(model: str, *, seq_len: int = 256, batch_size: int = 1, lora: bool = False) -> list[Event]:
    """The allocator stream :func:`llmem_plugin.estimate` replays for a catalog
    model's single-GPU step on the H100 SXM (bf16 autocast, AdamW), cuBLAS
    workspaces included."""
    est = importlib.import_module("llmem_plugin.estimate")
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.workload import LoraSpec, Workload

    wl = Workload(seq_len=seq_len, micro_batch_size=batch_size, lora=LoraSpec() if lora else None)
    gpu = get_gpu(GPU)
    module = modelbuild.build_model(model, wl, device="meta")
    overheads = device_overheads(gpu.compute_capability, uses_cublaslt=est.uses_cublaslt(module))
    events, _ = est.allocator_events(est._trace(module, wl, gpu), overheads)
    return [tuple(e) for e in events]


# Settings. GC acts only under a memory fraction below 1.0, so its confs run
# with fractions; a fraction of 1.0 is "no limit" to torch.
_CONFS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:128",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[64:8,256:4,1024:2,>:1]",
    "roundup_power2_divisions:[64:8,256:4,512:2,>:1]",
    "max_split_size_mb:256,max_non_split_rounding_mb:64",
    "max_split_size_mb:128,roundup_power2_divisions:4",
    "expandable_segments:True,roundup_power2_divisions:4",
    "large_segment_size_mb:64",
    "expandable_segments:True,large_segment_size_mb:64",
]
_GC_CONFS = [
    "garbage_collection_threshold:0.6",
    "garbage_collection_threshold:0.8,max_split_size_mb:256",
    "expandable_segments:True,garbage_collection_threshold:0.7",
]
_CAPPED_CONFS = [
    "", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4",
    "expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:256,max_non_split_rounding_mb:64",
]


def full_matrix(random_names: list[str], model_names: list[str]) -> list[Case]:
    """Every stream under every plain setting; the random streams also under
    memory fractions, GC thresholds and capacity caps small enough to force
    the free-the-cache-and-retry path and OOMs; ``model_names`` (the
    estimator's streams and any other long ones) under caps too, and under a
    capacity above the device memory (where an expandable segment, 1 1/8 of
    the device memory long, can fill and a second one opens)."""
    cases = [Case(stream=s, conf=c) for c in _CONFS for s in random_names + model_names]
    for s in random_names:
        cases += [Case(stream=s, memory_fraction=f) for f in (0.05, 0.1, 0.5, 0.9, 1.0)]
        cases += [Case(stream=s, conf="expandable_segments:True", memory_fraction=f) for f in (0.05, 0.1)]
        cases += [Case(stream=s, conf=c, memory_fraction=f) for c in _GC_CONFS for f in (0.06, 0.1)]
        cases += [Case(stream=s, conf=c, capacity_bytes=cap) for c in _CAPPED_CONFS for cap in (4 * _GiB, 7 * _GiB)]
    for s in model_names:
        cases += [Case(stream=s, conf=c, memory_fraction=0.1) for c in _GC_CONFS[:1]]
        cases += [Case(stream=s, conf=c, capacity_bytes=cap) for c in _CAPPED_CONFS[:2] for cap in (3 * _GiB,)]
        cases += [Case(stream=s, conf=c, capacity_bytes=200 * _GiB) for c in _CAPPED_CONFS[:2]]
        # A fraction of 1.0 is no limit, and leaves GC off, even past the device memory.
        cases += [Case(stream=s, conf=c, capacity_bytes=200 * _GiB, memory_fraction=1.0)
                  for c in ("", _GC_CONFS[0])]
    return cases


def _run_real(cases: list[Case], streams: dict[str, list[Event]], workers: int) -> dict[str, dict]:
    """The real allocator's results by case name: one stub process per
    (conf, capacity) and chunk of cases."""
    from stubcuda import runner

    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault((c.conf, c.capacity_bytes), []).append(c)
    jobs = [(k, v[i:i + _CASES_PER_PROCESS]) for k, v in groups.items() for i in range(0, len(v), _CASES_PER_PROCESS)]

    def one(job: tuple[tuple, list[Case]]) -> dict:
        (conf, capacity), chunk = job
        payload = {"cases": [{"name": c.name, "events": streams[c.stream], "memory_fraction": c.memory_fraction}
                             for c in chunk]}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(payload, f)
        try:
            return runner.run_json([WORKER, f.name], gpu=GPU, capacity=capacity,
                                   env={"PYTORCH_CUDA_ALLOC_CONF": conf}, timeout_s=1800)
        finally:
            os.unlink(f.name)

    out: dict[str, dict] = {}
    with ThreadPoolExecutor(workers) as pool:
        for res in pool.map(one, jobs):
            if res["total_memory_bytes"] != DEVICE_MEMORY_BYTES:
                raise RuntimeError(f"stub device reports {res['total_memory_bytes']} B, expected {DEVICE_MEMORY_BYTES}")
            for r in res["results"]:
                out[r["name"]] = {**r, "torch": res["torch"]}
    return out


def _run_sim(case: Case, events: list[Event], modules: tuple | None = None) -> dict:
    replay_fn, config_cls = modules or (replay, AllocatorConfig)
    res = replay_fn(events, config_cls.from_env(case.conf),
                 capacity_bytes=case.capacity_bytes or DEVICE_MEMORY_BYTES,
                 memory_fraction=case.memory_fraction, device_memory_bytes=DEVICE_MEMORY_BYTES,
                 timeline_points=len(events) + 1)
    return {"per_event": [[a, r] for _, _, a, r in res.timeline], "peak_allocated": res.peak_allocated_bytes,
            "peak_reserved": res.peak_reserved_bytes, "oom_event": res.oom_event}


def compare(real: dict, sim: dict) -> dict:
    """``identical`` and, when not, the first event whose (allocated,
    reserved) differ (or -1 when only a peak or the OOM event does)."""
    first = next((i for i, (a, b) in enumerate(zip(real["per_event"], sim["per_event"])) if list(a) != list(b)), -1)
    if first < 0 and len(real["per_event"]) != len(sim["per_event"]):
        first = min(len(real["per_event"]), len(sim["per_event"]))
    same = (first < 0 and real["oom_event"] == sim["oom_event"] and real["peak_allocated"] == sim["peak_allocated"]
            and real["peak_reserved"] == sim["peak_reserved"])
    row = {"identical": same, "first_differing_event": None, "num_events_compared": len(real["per_event"]),
           "oom_event": real["oom_event"], "peak_allocated_bytes": real["peak_allocated"],
           "peak_reserved_bytes": real["peak_reserved"]}
    if not same:
        row["first_differing_event"] = first
        if 0 <= first < min(len(real["per_event"]), len(sim["per_event"])):
            row["real_at_first"] = real["per_event"][first]
            row["sim_at_first"] = sim["per_event"][first]
        row["sim"] = {k: sim[k] for k in ("oom_event", "peak_allocated", "peak_reserved")}
    return row


def baseline_modules(rev: str) -> tuple:
    """``replay`` and ``AllocatorConfig`` as they were at git revision ``rev``,
    loaded from ``git show`` under private module names."""
    import subprocess
    import types

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mods = {}
    for name in ("allocator_config", "allocator"):
        # the allocator moved to llmem_plugin/device/ with the stage layout; older revisions hold it at the top
        for path in (f"llmem_plugin/device/{name}.py", f"llmem_plugin/{name}.py"):
            show = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
            if show.returncode == 0:
                break
        show.check_returncode()
        src = show.stdout
        for old in ("from llmem_plugin.device.allocator_config import", "from llmem_plugin.allocator_config import"):
            src = src.replace(old, "from _baseline_allocator_config import")
        mod = types.ModuleType(f"_baseline_{name}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["allocator"].replay, mods["allocator_config"].AllocatorConfig


def run_cases(cases: list[Case], streams: dict[str, list[Event]], *, workers: int = 2,
              baseline: tuple | None = None) -> list[dict]:
    """Run every case on both sides; one row per case, in order. With
    ``baseline`` (see :func:`baseline_modules`) each row also says whether
    that version of the simulation was identical."""
    real = _run_real(cases, streams, workers)
    rows = []
    for c in cases:
        row = {"name": c.name, "stream": c.stream, "conf": c.conf, "capacity_bytes": c.capacity_bytes,
               "memory_fraction": c.memory_fraction, "num_events": len(streams[c.stream])}
        row.update(compare(real[c.name], _run_sim(c, streams[c.stream])))
        if baseline is not None:
            row["identical_at_baseline"] = compare(real[c.name], _run_sim(c, streams[c.stream], baseline))["identical"]
        rows.append(row)
    return rows


MODELS = [("gpt2", {}), ("opt-125m", {}), ("qwen2.5-0.5b", {}), ("llama-3.2-1b", {}), ("llama-3.1-8b", {}),
          ("llama-3.1-8b-lora", {"lora": True})]


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import _common
    from stubcuda import runner

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="result path (default results/stub-allocator-<date>.json)")
    ap.add_argument("--quick", action="store_true", help="4 random streams and 2 models only")
    ap.add_argument("--baseline", metavar="REV", help="also compare the simulation as of this git revision")
    args = ap.parse_args()
    num_random = 4 if args.quick else 16
    models = MODELS[:2] if args.quick else MODELS
    streams = {f"random-{s}": random_stream(s, live_target_bytes=(2 + s % 5) * _GiB) for s in range(num_random)}
    random_names = list(streams)
    streams[BIG_STREAM] = big_stream()
    for name, kw in models:
        streams[name] = estimator_stream(name.removesuffix("-lora"), **kw)
    cases = full_matrix(random_names, [BIG_STREAM] + [name for name, _ in models])
    rows = run_cases(cases, streams, baseline=baseline_modules(args.baseline) if args.baseline else None)
    stub_torch = runner.run_json(["-c", "import json, torch; print(json.dumps(torch.__version__))"])
    num_same = sum(r["identical"] for r in rows)
    print(f"{num_same} of {len(rows)} cases identical")
    baseline = {}
    if args.baseline:
        baseline = {"baseline": {"rev": args.baseline,
                                 "num_identical": sum(r["identical_at_baseline"] for r in rows)}}
        print(f"at {args.baseline}: {baseline['baseline']['num_identical']} identical")
    for r in rows:
        if not r["identical"]:
            print("DIFFERS:", r["name"], {k: r.get(k) for k in ("first_differing_event", "real_at_first",
                                                                  "sim_at_first", "oom_event", "sim")})
    _common.write("stub-allocator", {
        "stub": {"gpu": GPU, "device_memory_bytes": DEVICE_MEMORY_BYTES, "torch": stub_torch},
        "streams": {k: {"num_events": len(v)} for k, v in streams.items()},
        "model_streams": "estimate.allocator_events of a seq 256, batch 1, bf16-mixed, AdamW step on h100-sxm",
        "num_cases": len(rows), "num_identical": num_same, **baseline, "cases": rows,
    }, args.out)


if __name__ == "__main__":
    main()
